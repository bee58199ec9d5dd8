"""The explicit adapter registry: name -> adapter class (no import-time registration)."""
from __future__ import annotations

from adapters.base import DiffusionAdapter
from adapters.tiny_t2i import TinyT2IAdapter
from adapters.tiny_t2va import TinyT2VAAdapter
from contract import ConfigError

ADAPTERS: dict[str, type[DiffusionAdapter]] = {
    "tiny_t2i": TinyT2IAdapter,
    "tiny_t2va": TinyT2VAAdapter,
}


def get_adapter(name: str) -> DiffusionAdapter:
    """A fresh adapter instance for `name`; ConfigError listing the known names otherwise."""
    if name not in ADAPTERS:
        raise ConfigError(f"unknown adapter {name!r}", field="adapter", expected=sorted(ADAPTERS),
                          actual=name)
    return ADAPTERS[name]()
