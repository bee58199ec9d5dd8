"""What the GPU check needs on the GPU machine, and what travels with the tree to get it there.

The GPU machine (one H200) has python 3.12 with torch 2.11 (CUDA 13), transformers, peft,
accelerate, safetensors and the packages in `GPU_MACHINE_PACKAGES`, but no diffusers, no
pydantic, no Ray and no network. `WHEELS` are downloaded here by `scripts/gpu_check.sh
--fetch-wheels` (cp312 manylinux binaries where a package has compiled code) into `.gpu_wheels/`
(git-ignored, carried with the tree) and installed there into a target folder on PYTHONPATH.

    python -m bench.gpu_env --requirements          # the pinned wheel list (for pip download)
    python -m bench.gpu_env --check-wheels DIR      # every carried wheel's needs are met there
"""
from __future__ import annotations

import argparse
import re
import sys
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Mapping

# Pinned to the versions the project is tested with here.
WHEELS = ("diffusers==0.42.1", "pydantic==2.14.4", "pydantic-core==2.50.5",
          "annotated-types==0.8.0", "typing-inspection==0.4.5", "typing-extensions==4.16.0")
# Requirements a carried wheel declares that its code never imports on python 3.12.
UNUSED_ON_GPU = {"importlib-metadata": "diffusers imports importlib.metadata from the standard "
                                       "library on python >= 3.8 (diffusers/utils/import_utils.py)"}
CARRY_LIMIT_MIB = 48          # the tree and the wheels travel together within 64 MiB

# The GPU machine's python3 (3.12) packages, as its image lists them.
GPU_MACHINE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp
""".split())


def normalize(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def carried() -> frozenset[str]:
    return frozenset(normalize(w.split("==")[0]) for w in WHEELS)


def available() -> frozenset[str]:
    """Distributions importable on the GPU machine once the wheels are installed."""
    return frozenset(normalize(p) for p in GPU_MACHINE_PACKAGES) | carried()


def missing_on_gpu(distributions: set[str] | frozenset[str]) -> list[str]:
    """Those of `distributions` that the GPU machine would not have."""
    have = available()
    return sorted(d for d in {normalize(x) for x in distributions} if d not in have)


PROJECT_PACKAGES = ("adapters", "bench", "contract", "deployments", "diffusion", "rewards",
                    "rollout", "scripts", "synthetic", "trainer")


def module_level_imports(modules: Mapping[str, ModuleType]) -> dict[str, set[str]]:
    """{distribution: project modules importing it at module level} over the project modules in
    `modules` (e.g. sys.modules after importing what the GPU check runs). Imports inside
    functions are left out: they run only when called."""
    import ast
    import importlib.metadata

    by_top = importlib.metadata.packages_distributions()
    std = set(sys.stdlib_module_names)
    out: dict[str, set[str]] = {}
    for name, module in sorted(modules.items()):
        path = getattr(module, "__file__", None)
        if name.split(".")[0] not in PROJECT_PACKAGES or not path:
            continue
        tree = ast.parse(Path(path).read_text())
        nodes = list(tree.body)
        while nodes:                         # module level, through if / try blocks
            node = nodes.pop()
            if isinstance(node, (ast.If, ast.Try)):
                nodes.extend(node.body + node.orelse + getattr(node, "finalbody", []) +
                             [s for h in getattr(node, "handlers", []) for s in h.body])
                continue
            tops = ([a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import)
                    else [node.module.split(".")[0]] if isinstance(node, ast.ImportFrom)
                    and node.level == 0 and node.module else [])
            for top in tops:
                if top in std or top in PROJECT_PACKAGES or top == "__future__":
                    continue
                for dist in by_top.get(top, [top]):
                    out.setdefault(normalize(dist), set()).add(name)
    return out


_MARKER_ENV = {"python_version": "3.12", "sys_platform": "linux", "platform_machine": "x86_64",
               "platform_system": "Linux", "implementation_name": "cpython", "extra": ""}


def wheel_requirements(wheel: Path) -> list[str]:
    """The Requires-Dist names of a wheel that apply on the GPU machine (no extras)."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    names = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(_MARKER_ENV):
                names.append(normalize(req.name))
    return names


def check_wheels(folder: Path) -> list[str]:
    """Problems with the carried wheels in `folder` (empty = ready): one wheel per WHEELS entry,
    each wheel's needs on the GPU machine or carried, the total within CARRY_LIMIT_MIB."""
    problems = []
    wheels = sorted(folder.glob("*.whl"))
    found = {normalize(w.name.split("-")[0]): w for w in wheels}
    for name in sorted(carried() - set(found)):
        problems.append(f"no wheel for {name}")
    for name in sorted(set(found) - carried()):
        problems.append(f"unexpected wheel {found[name].name} (one version of each, as WHEELS)")
    for name, wheel in found.items():
        for need in missing_on_gpu(set(wheel_requirements(wheel)) - set(UNUSED_ON_GPU)):
            problems.append(f"{wheel.name} needs {need}, which the GPU machine lacks")
    mib = sum(w.stat().st_size for w in wheels) / 2**20
    if mib > CARRY_LIMIT_MIB:
        problems.append(f"the wheels hold {mib:.1f} MiB (> {CARRY_LIMIT_MIB} MiB)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--requirements", action="store_true")
    group.add_argument("--check-wheels", type=Path)
    args = parser.parse_args(argv)
    if args.requirements:
        print(" ".join(WHEELS))
        return 0
    problems = check_wheels(args.check_wheels)
    for p in problems:
        print(f"wheel check: {p}", file=sys.stderr)
    if not problems:
        mib = sum(w.stat().st_size for w in args.check_wheels.glob("*.whl")) / 2**20
        print(f"wheel check: {len(WHEELS)} wheels, {mib:.1f} MiB, every need met on the GPU "
              "machine")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
