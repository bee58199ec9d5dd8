"""The house's rule, read from the source: no room imports a room above it, and no production
module imports the test and bench support (testing/, tests/, bench/, scripts/). Rooms, lowest
first (docs/ARCHITECTURE.md "Rooms"); rooms of one rank may import each other."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK = {"contract": 0, "diffusion": 1, "synthetic": 1, "adapters": 2, "rollout": 3,
        "rewards": 3, "deployments": 4, "graph": 5, "trainer": 6}
SUPPORT = {"testing", "tests", "bench", "scripts"}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def violations(room: str, files: list[Path]) -> list[tuple[Path, int, str]]:
    """(file, line, module) of each import in `files` (of `room`) of a higher room or of the
    test and bench support."""
    bad = []
    for path in files:
        for line, module in imported_modules(path):
            top = module.split(".")[0]
            if top in SUPPORT or RANK.get(top, -1) > RANK[room]:
                bad.append((path, line, module))
    return bad


def room_files(room: str) -> list[Path]:
    return [ROOT / "graph.py"] if room == "graph" else sorted((ROOT / room).rglob("*.py"))


def test_no_room_imports_a_higher_one_or_the_test_support():
    files = {room: room_files(room) for room in RANK}
    assert all(files.values()), {r: len(f) for r, f in files.items()}
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}"
           for room, paths in files.items() for path, line, module in violations(room, paths)]
    assert not bad, "\n".join(bad)


def test_the_check_sees_upward_and_support_imports(tmp_path):
    module = tmp_path / "upward.py"
    module.write_text("import torch\nfrom contract import ConfigError\nfrom graph import app\n"
                      "def f():\n    from testing.snapshots import write_clip_dir\n")
    assert [(line, name) for _, line, name in violations("deployments", [module])] == \
        [(3, "graph"), (5, "testing.snapshots")]
