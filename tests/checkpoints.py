"""Session fixture: tiny real-layout checkpoints (scripts/tiny_checkpoints.py), each family built
once per test session into one temporary directory, on first use."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from scripts.tiny_checkpoints import Family, build


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Callable[[str], Path]:
    """`tiny_checkpoint("sd3")` -> path of the tiny SD3 checkpoint (seed 0), built on first call."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    built: dict[Family, Path] = {}

    def get(family: str | Family) -> Path:
        family = Family(family)
        if family not in built:
            built[family] = build(family, root)
        return built[family]

    return get
