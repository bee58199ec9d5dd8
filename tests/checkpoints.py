"""Session fixture: tiny real-layout checkpoints (scripts/tiny_checkpoints.py), each family built
on first use and cached on disk under a key of the builders' sources and the library versions
they write with (a changed builder or library builds anew); each session copies its own."""
from __future__ import annotations

import hashlib
import os
import shutil
from importlib.metadata import version
from pathlib import Path
from typing import Callable

import pytest

from scripts.tiny_checkpoints import Family, build

BUILDERS = ("tiny_checkpoints.py", "tiny_families.py", "tiny_tokenizers.py")
LIBRARIES = ("torch", "diffusers", "transformers", "tokenizers", "safetensors")
CACHE_ENV = "OMNI_TINY_CHECKPOINT_CACHE"     # default ~/.cache/omni-rollout/tiny-checkpoints


def cache_key() -> str:
    """Hash of the builder sources and the installed versions of the libraries that write them."""
    digest = hashlib.sha256()
    scripts = Path(__file__).resolve().parent.parent / "scripts"
    for name in BUILDERS:
        digest.update(name.encode() + b"\0" + (scripts / name).read_bytes() + b"\0")
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
                 "tiny-checkpoints") / cache_key()
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    copies: dict[Family, Path] = {}

    def get(family: str | Family) -> Path:
        family = Family(family)
        if family not in copies:
            copies[family] = Path(shutil.copytree(cached(family, cache), root / family.value))
        return copies[family]

    return get
