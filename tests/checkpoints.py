"""Session fixture: tiny real-layout checkpoints (testing/tiny_checkpoints.py), each built on
first use and cached on disk under a key of its entry (adapters/families.py), its builder's
sources and the library versions they write with (a changed entry, builder or library builds
anew); each session copies its own."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from importlib.metadata import version
from pathlib import Path
from typing import Callable

import pytest

from testing.tiny_checkpoints import Family, build, tiny_entry

BUILDERS = ("tiny_checkpoints.py", "tiny_families.py", "tiny_tokenizers.py")   # + each builder's
LIBRARIES = ("torch", "diffusers", "transformers", "tokenizers", "safetensors")
CACHE_ENV = "OMNI_TINY_CHECKPOINT_CACHE"     # default ~/.cache/omni-rollout/tiny-checkpoints


def cache_key(family: str | Family) -> str:
    """Hash of the checkpoint's entry, the builder sources (the shared ones and its builder's
    module) and the installed versions of the libraries that write them."""
    entry = tiny_entry(family)
    digest = hashlib.sha256(repr(entry).encode() + b"\0")
    testing = Path(__file__).resolve().parent.parent / "testing"
    sources = [testing / name for name in BUILDERS]
    builder = Path(importlib.util.find_spec(entry.source_module).origin)
    for path in sources + ([builder] if builder not in sources else []):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for lib in LIBRARIES:
        digest.update(f"{lib}=={version(lib)}\0".encode())
    return digest.hexdigest()[:20]


def cached(family: Family, cache: Path) -> Path:
    """The family's checkpoint in the cache, built there (atomically, by rename) when missing."""
    target = cache / family.value
    if not target.is_dir():
        try:
            build(family, cache)
        except (FileExistsError, OSError):
            if not target.is_dir():        # not another process's build that won the rename
                raise
    return target


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Callable[[str], Path]:
    """`tiny_checkpoint("sd3")` -> path of the tiny SD3 checkpoint (seed 0): this session's copy
    of the cached build (tests may copy and alter it, never the cache)."""
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "omni-rollout" /
                 "tiny-checkpoints")
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    copies: dict[Family, Path] = {}

    def get(family: str | Family) -> Path:
        family = Family(family)
        if family not in copies:
            copies[family] = Path(shutil.copytree(cached(family, cache / cache_key(family)),
                                                  root / family.value))
        return copies[family]

    return get
