"""The house's rule, read from the source: no room imports a room above it, and no production
module imports the test and bench support (testing/, tests/, bench/, scripts/). Rooms, lowest
first (docs/ARCHITECTURE.md "Rooms"); rooms of one rank may import each other. And the trainer
composes objects with explicit inputs: none of its classes derives from another of its classes
used as a mixin."""
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


# ---- composition, not mixins -------------------------------------------------------------------
# A room's class may derive from a class of the room only where that base is a kind of value or
# an interface: an enum, a pydantic model, a Protocol, an exception, or an abstract interface (an
# ABC declaring abstract methods). Any other base is a mixin sharing the subclass's attributes
# implicitly; the room composes objects constructed with what they read instead.
KIND_ROOTS = {"Enum", "IntEnum", "StrEnum", "Flag", "IntFlag", "BaseModel", "Protocol",
              "Exception", "BaseException"}


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    if isinstance(node, ast.Subscript):                  # Generic[T], Protocol[T]
        return _dotted(node.value)
    return None


def _abstract(cls: ast.ClassDef) -> bool:
    return any(_dotted(d) in ("abstractmethod", "abc.abstractmethod")
               for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
               for d in f.decorator_list)


def project_classes(root: Path, room: str) -> dict[str, tuple[Path, ast.ClassDef, list[str]]]:
    """'room.module.Class' -> (file, class node, its bases: a qualified name for a class of
    `room`, else the name as written) for every top-level class of `root/room`."""
    out = {}
    for path in sorted((root / room).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        tree = ast.parse(path.read_text(), str(path))
        names = {n.name: f"{module}.{n.name}" for n in tree.body if isinstance(n, ast.ClassDef)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
            elif isinstance(node, ast.Import):
                names.update({a.asname or a.name: a.name for a in node.names})
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                bases = []
                for base in node.bases:
                    written = _dotted(base) or ast.unparse(base)
                    head, _, tail = written.partition(".")
                    resolved = names.get(head, head) + (f".{tail}" if tail else "")
                    bases.append(resolved if resolved.split(".")[0] == room else written)
                out[f"{module}.{node.name}"] = (path, node, bases)
    return out


def mixin_bases(root: Path, room: str) -> list[tuple[Path, int, str, str]]:
    """(file, line, class, base) for each class of `root/room` deriving from a class of the room
    that is not a kind of value or an interface (KIND_ROOTS, or an ABC with abstract methods)."""
    classes = project_classes(root, room)

    def is_kind(name: str, seen: frozenset = frozenset()) -> bool:
        if name not in classes:                          # outside the room: by its own name
            return name.split(".")[-1] in KIND_ROOTS
        if name in seen:
            return False
        _, node, bases = classes[name]
        if any(b.split(".")[-1] == "ABC" for b in bases) and _abstract(node):
            return True
        return any(is_kind(b, seen | {name}) for b in bases)

    return [(path, node.lineno, node.name, base)
            for path, node, bases in classes.values()
            for base in bases if base in classes and not is_kind(base)]


def test_trainer_classes_compose_objects_instead_of_mixins():
    bad = [f"{path.relative_to(ROOT)}:{line} class {name} derives from {base}"
           for path, line, name, base in mixin_bases(ROOT, "trainer")]
    assert not bad, "\n".join(bad)


def test_the_check_sees_mixins_and_allows_kinds_and_interfaces(tmp_path):
    room = tmp_path / "trainer"
    room.mkdir()
    (room / "parts.py").write_text(
        "from abc import ABC, abstractmethod\nfrom enum import Enum\n"
        "from pydantic import BaseModel\n"
        "class Reporting:\n    def report(self):\n        return self.step\n"
        "class Kind(str, Enum):\n    A = 'a'\n"
        "class Settings(BaseModel):\n    x: int = 0\n"
        "class Weights(ABC):\n    @abstractmethod\n    def load(self): ...\n"
        "class Shared(ABC):\n    def helper(self):\n        return self.cfg\n")
    (room / "loop.py").write_text(
        "import trainer.parts as parts\nfrom trainer.parts import Kind, Reporting as R, Settings\n"
        "from trainer.parts import Weights, Shared\n"
        "class Loop(R, parts.Shared):\n    pass\n"
        "class Big(Settings):\n    y: int = 1\n"
        "class Lora(Weights):\n    def load(self): ...\n"
        "class Error(ValueError):\n    pass\n"
        "class Local:\n    pass\n"
        "class Uses(Local):\n    pass\n")
    found = [(path.name, line, name, base) for path, line, name, base in
             mixin_bases(tmp_path, "trainer")]
    assert found == [("loop.py", 4, "Loop", "trainer.parts.Reporting"),
                     ("loop.py", 4, "Loop", "trainer.parts.Shared"),
                     ("loop.py", 14, "Uses", "trainer.loop.Local")]
