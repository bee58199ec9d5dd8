"""Mutation run: does the default test tier fail when a core computation is wrong?

    python -m scripts.mutation_check [--rev HEAD] [--only NAME ...]
                                     [--out bench/results/mutation.json]

Each mutation changes one constant or sign in one core function (sampler step, log-prob, the
NFT / Flow-GRPO / DPO losses, advantages, the LoRA sync map, request bounds). The run exports
the committed tree at `--rev` into a temporary directory (`git archive`: never the working tree,
which may hold edits in progress), runs each mutation's tests there once unmutated (they must
pass, or the row says the baseline failed), then for each mutation writes the changed file,
runs the tests and restores the file. A mutation is caught when its tests fail. The table
(JSON) names the function, the change, the tests, the failing test ids and the seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parent.parent
PYTEST_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str                  # repo-relative file
    function: str              # the core function it breaks
    original: str              # exact text, found once in the file
    mutated: str
    tests: tuple[str, ...]     # pytest node ids / files of the default tier

    @property
    def change(self) -> str:
        return f"{self.original.strip()}  ->  {self.mutated.strip()}"


SAMPLER_TESTS = ("tests/test_diffusion_samplers.py",)
MUTATIONS: tuple[Mutation, ...] = (
    Mutation("sde_step_drift_sign", "diffusion/samplers.py", "_sde_mean (SDE / Dance-SDE step)",
             "return x * (1 + g ** 2 * d / (2 * s)) + v * (1 + g ** 2 * (1 - s) / (2 * s)) * d",
             "return x * (1 - g ** 2 * d / (2 * s)) + v * (1 + g ** 2 * (1 - s) / (2 * s)) * d",
             SAMPLER_TESTS),
    Mutation("sde_step_noise_scale", "diffusion/samplers.py", "sde_step",
             "std_dev_t = noise_level * torch.sqrt(sigma / denom)",
             "std_dev_t = 1.1 * noise_level * torch.sqrt(sigma / denom)", SAMPLER_TESTS),
    Mutation("ode_step_direction", "diffusion/samplers.py", "ode_step",
             "    mean = x + rows(dt, x.ndim) * v\n",
             "    mean = x - rows(dt, x.ndim) * v\n", SAMPLER_TESTS),
    Mutation("log_prob_variance", "diffusion/samplers.py", "_gaussian_elem (log-prob)",
             "return -((prev_sample - mean) ** 2) / (2 * s ** 2) - torch.log(s) - _LOG_SQRT_2PI",
             "return -((prev_sample - mean) ** 2) / (s ** 2) - torch.log(s) - _LOG_SQRT_2PI",
             SAMPLER_TESTS),
    Mutation("log_prob_normaliser", "diffusion/samplers.py", "_gaussian_elem (log-prob)",
             "return -((prev_sample - mean) ** 2) / (2 * s ** 2) - torch.log(s) - _LOG_SQRT_2PI",
             "return -((prev_sample - mean) ** 2) / (2 * s ** 2) + torch.log(s) - _LOG_SQRT_2PI",
             SAMPLER_TESTS),
    Mutation("nft_negative_policy_sign", "trainer/algorithms/nft.py", "nft_loss",
             "v_minus = (1.0 + beta) * v_old - beta * v_theta",
             "v_minus = (1.0 + beta) * v_old + beta * v_theta",
             ("tests/test_algorithms_nft.py",)),
    Mutation("nft_optimality_swapped", "trainer/algorithms/nft.py", "nft_loss",
             "policy_loss = adv_clip_max * (r * loss_plus / beta + (1.0 - r) * loss_minus / beta)",
             "policy_loss = adv_clip_max * ((1.0 - r) * loss_plus / beta + r * loss_minus / beta)",
             ("tests/test_algorithms_nft.py",)),
    Mutation("grpo_advantage_sign", "trainer/algorithms/flow_grpo.py",
             "clipped_surrogate (FlowGRPO, GRPO-Guard)",
             "    return torch.maximum(-advantages * ratio,\n",
             "    return torch.maximum(advantages * ratio,\n",
             ("tests/test_algorithms_flow_grpo.py",)),
    Mutation("grpo_pessimistic_bound", "trainer/algorithms/flow_grpo.py",
             "clipped_surrogate (FlowGRPO, GRPO-Guard)",
             "    return torch.maximum(-advantages * ratio,\n",
             "    return torch.minimum(-advantages * ratio,\n",
             ("tests/test_algorithms_flow_grpo.py",)),
    Mutation("dpo_reference_sign", "trainer/algorithms/dpo.py", "dpo_loss",
             "inside = -0.5 * beta * (model_diff - ref_diff)",
             "inside = -0.5 * beta * (model_diff + ref_diff)",
             ("tests/test_algorithms_dpo.py",)),
    Mutation("dpo_temperature", "trainer/algorithms/dpo.py", "dpo_loss",
             "inside = -0.5 * beta * (model_diff - ref_diff)",
             "inside = -1.0 * beta * (model_diff - ref_diff)",
             ("tests/test_algorithms_dpo.py",)),
    Mutation("advantage_centring", "trainer/algorithms/advantages.py", "group_advantages",
             "centred = r - means[index]", "centred = r - 0.9 * means[index]",
             ("tests/test_algorithms_advantages.py",)),
    Mutation("advantage_eps", "trainer/algorithms/advantages.py", "group_advantages",
             "advantages = centred / (std + eps)", "advantages = centred / (std + 10 * eps)",
             ("tests/test_algorithms_advantages.py",)),
    Mutation("lora_packed_slice", "rollout/lora.py", "map_lora_tensors (LoRA sync map)",
             "rows, start, stop = b, logical * width, (logical + 1) * width",
             "rows, start, stop = b, (num_slices - 1 - logical) * width, "
             "(num_slices - logical) * width",
             ("tests/test_rollout_lora.py",)),
    Mutation("lora_delta_sign", "rollout/lora.py", "LoRASlots hook (LoRA sync)",
             "out[..., d.start:d.stop] += d.scale * ((x @ d.a.T) @ d.b.T)",
             "out[..., d.start:d.stop] -= d.scale * ((x @ d.a.T) @ d.b.T)",
             ("tests/test_rollout_lora.py",)),
    Mutation("request_bound_off_by_one", "contract/request.py", "check_limits (request bounds)",
             "        if value > bound:\n            raise LimitExceededError(f\"{name} is beyond",
             "        if value > bound + 1:\n"
             "            raise LimitExceededError(f\"{name} is beyond",
             ("tests/test_request_bounds.py", "tests/test_contract_validation.py")),
)


def export_tree(rev: str, dest: Path) -> None:
    """The committed tree at `rev` (tracked files only) into dest."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def check_imports_resolve_to(root: Path) -> None:
    """The project's packages must import from the copy, not from the editable install."""
    probe = subprocess.run([sys.executable, "-c", "import diffusion; print(diffusion.__file__)"],
                           cwd=root, capture_output=True, text=True, env=_env(root), check=True)
    where = Path(probe.stdout.strip()).resolve()
    if root.resolve() not in where.parents:
        raise RuntimeError(f"imports resolve to {where}, not the copy at {root}")


def _env(root: Path) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               RAY_USAGE_STATS_ENABLED="0", PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


def run_tests(root: Path, tests: Sequence[str]) -> dict:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           "-rfE", *tests], cwd=root, env=_env(root), capture_output=True,
                          text=True, timeout=PYTEST_TIMEOUT_S)
    return {"returncode": proc.returncode, "failed": FAILED.findall(proc.stdout),
            "seconds": round(time.monotonic() - start, 1),
            "summary": (proc.stdout.strip().splitlines() or [""])[-1]}


def apply(root: Path, m: Mutation) -> str:
    """Write the mutated file; returns the original text to restore."""
    path = root / m.path
    text = path.read_text()
    if text.count(m.original) != 1:
        raise RuntimeError(f"{m.name}: the original text occurs {text.count(m.original)} times "
                           f"in {m.path} (expected once): the mutation list is out of date")
    path.write_text(text.replace(m.original, m.mutated))
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="HEAD", help="the commit to export and mutate")
    parser.add_argument("--only", nargs="*", default=None, help="mutation names to run")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "mutation.json"))
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.only is None or m.name in args.only]
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", args.rev], check=True,
                            capture_output=True, text=True).stdout.strip()
    root = Path(tempfile.mkdtemp(prefix="omni-mutation-"))
    rows = []
    try:
        export_tree(commit, root)
        check_imports_resolve_to(root)
        baselines: dict[tuple[str, ...], dict] = {}
        for m in chosen:
            if m.tests not in baselines:
                baselines[m.tests] = run_tests(root, m.tests)
                print(f"baseline {' '.join(m.tests)}: {baselines[m.tests]['summary']}",
                      flush=True)
            base = baselines[m.tests]
            original = apply(root, m)
            try:
                result = run_tests(root, m.tests)
            finally:
                (root / m.path).write_text(original)
            caught = base["returncode"] == 0 and result["returncode"] != 0
            rows.append({"mutation": m.name, "file": m.path, "function": m.function,
                         "change": m.change, "tests": list(m.tests),
                         "baseline_passed": base["returncode"] == 0,
                         "returncode": result["returncode"], "caught": caught,
                         "failing_tests": result["failed"], "seconds": result["seconds"]})
            print(f"{'CAUGHT ' if caught else 'MISSED '} {m.name:28s} {result['summary']}",
                  flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table = {"commit": commit, "python": sys.version.split()[0],
             "caught": sum(r["caught"] for r in rows), "total": len(rows), "mutations": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(table, indent=2) + "\n")
    print(f"{table['caught']} / {table['total']} mutations caught -> {args.out}")
    return 0 if table["caught"] == table["total"] else 1


if __name__ == "__main__":
    sys.exit(main())
