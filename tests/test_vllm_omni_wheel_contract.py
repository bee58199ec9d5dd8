"""Every vLLM-Omni name the engine uses (rollout.vllm_omni.api.REAL_API) exists in the real
vllm-omni==0.30.0 wheel. The wheel is downloaded once (`pip download --no-deps`, cached under
~/.cache/omni-rollout/wheels) and read with `ast`; nothing of it is imported."""
from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rollout.vllm_omni.api import REAL_API, VLLM_OMNI_VERSION, ApiKind

pytestmark = pytest.mark.network
CACHE = Path.home() / ".cache" / "omni-rollout" / "wheels"
WHEEL = f"vllm_omni-{VLLM_OMNI_VERSION}-py3-none-any.whl"


@pytest.fixture(scope="module")
def wheel() -> zipfile.ZipFile:
    path = CACHE / WHEEL
    if not path.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                               f"vllm-omni=={VLLM_OMNI_VERSION}", "-d", str(CACHE)],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0 or not path.is_file():
            pytest.skip(f"package index unreachable, cannot download vllm-omni=="
                        f"{VLLM_OMNI_VERSION}: {proc.stderr.strip()[-300:]}")
    return zipfile.ZipFile(path)


def _module_tree(wheel: zipfile.ZipFile, module: str) -> ast.Module:
    base = module.replace(".", "/")
    for name in (f"{base}.py", f"{base}/__init__.py"):
        if name in wheel.namelist():
            return ast.parse(wheel.read(name))
    raise AssertionError(f"module {module} is not in the wheel")


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def _imports(tree: ast.Module, name: str) -> bool:
    return any(isinstance(n, ast.ImportFrom) and any((a.asname or a.name) == name
                                                     for a in n.names) for n in tree.body)


def _members(cls: ast.ClassDef) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
    return out


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    a = fn.args
    return {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs}


def _resolve_member(wheel, module: str, cls_name: str, member: str, depth: int = 0):
    """Find `member` on class `cls_name` or its bases defined inside the wheel."""
    tree = _module_tree(wheel, module)
    cls = _class(tree, cls_name)
    assert cls is not None, f"{module}.{cls_name} is not defined"
    members = _members(cls)
    if member in members:
        return members[member]
    for base in cls.bases:
        if not isinstance(base, ast.Name) or depth > 4:
            continue
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.startswith("vllm_omni") and any(a.name == base.id
                                                                for a in node.names):
                found = _resolve_member(wheel, node.module, base.id, member, depth + 1)
                if found is not None:
                    return found
        if _class(tree, base.id) is not None:
            found = _resolve_member(wheel, module, base.id, member, depth + 1)
            if found is not None:
                return found
    return None


@pytest.mark.parametrize("entry", REAL_API, ids=lambda e: f"{e.module}:{e.name}")
def test_name_exists_in_wheel(wheel, entry):
    tree = _module_tree(wheel, entry.module)
    if entry.kind == ApiKind.CLASS:
        assert _class(tree, entry.name) is not None or _imports(tree, entry.name), entry
        return
    cls_name, _, rest = entry.name.partition(".")
    member, _, param = rest.partition(":")
    node = _resolve_member(wheel, entry.module, cls_name, member)
    assert node is not None, f"{entry.module}.{cls_name} has no {member}"
    if entry.kind == ApiKind.FIELD:
        assert isinstance(node, ast.AnnAssign), f"{entry.name} is not an annotated field"
    elif entry.kind == ApiKind.METHOD:
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)), entry
    elif entry.kind == ApiKind.PARAM:
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)), entry
        assert param in _params(node), f"{cls_name}.{member} takes no {param!r}"


def test_generate_is_an_async_generator_and_control_methods_are_async(wheel):
    for member in ("generate", "abort", "sleep", "wake_up"):
        node = _resolve_member(wheel, "vllm_omni.entrypoints.async_omni", "AsyncOmni", member)
        assert isinstance(node, ast.AsyncFunctionDef), member
    gen = _resolve_member(wheel, "vllm_omni.entrypoints.async_omni", "AsyncOmni", "generate")
    assert any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(gen))


def test_custom_pipeline_hooks_the_engine_relies_on(wheel):
    """lora_is_fused makes the worker skip its LoRA manager; the loader builds custom pipelines
    by qualified name; wake_up after level 2 is refused (so the engine sleeps at level 1)."""
    worker = wheel.read("vllm_omni/diffusion/worker/diffusion_worker.py").decode()
    assert 'getattr(pipeline, "lora_is_fused", False)' in worker
    assert 'custom_pipeline_args["pipeline_class"]' in worker
    loader = wheel.read("vllm_omni/diffusion/model_loader/diffusers_loader.py").decode()
    assert "resolve_obj_by_qualname(custom_pipeline_name)" in loader
    formatter = wheel.read("vllm_omni/diffusion/output_formatter.py").decode()
    assert '"output"' in formatter and 'mm_output["metadata"]' in formatter


def test_every_served_checkpoint_architecture_is_registered(wheel):
    """A checkpoint folder reaches vLLM-Omni through its model_index.json `_class_name`: each
    family the project serves there must be a key of the wheel's diffusion model registry."""
    from rollout.vllm_omni.api import REGISTRY_MODULE, REGISTRY_TABLE, SERVED_ARCHITECTURES
    tree = _module_tree(wheel, REGISTRY_MODULE)
    table = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", None) == REGISTRY_TABLE for t in node.targets))
    keys = {k.value for k in table.keys if isinstance(k, ast.Constant)}
    missing = [a for a in SERVED_ARCHITECTURES if a not in keys]
    assert not missing, missing
