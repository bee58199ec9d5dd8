"""The learner at scale on this CPU machine: data-parallel throughput and the memory knobs.

    python -m bench.trainer_scale_bench [--only dp memory] [--dp-repeats 3] [--layers N|auto]
-> bench/results/trainer_scale.json + bench/results/trainer_scale.png

dp: learner samples/s (rows of the global batch trained per second of `update`, rollouts not
    included) of one DiffusionNFT step on the same batch, same run: the Ray Train worker group
    with 1 worker holding every core vs 2 workers holding one core each (gloo, LoRA gradients
    summed by one all-reduce), and the in-process learner on every core as the reference a user
    without a worker group has. Model: an SD3-layout checkpoint in the real diffusers layout
    (the tiny SD3 text encoders and tokenizers, a wider 4-block MMDiT transformer with random
    weights) loaded by every worker from disk as a user's checkpoint is. On 2 cores the two
    workers split the same 2 cores one worker uses, so the ratio measures the data-parallel
    overhead, not a speed-up from more hardware.
memory: the peak resident memory one learner step adds (DiffusionNFT, 1 trained timestep with
    the reference forward, LoRA r32 in fp32 on bf16 weights) with and without gradient
    checkpointing, with micro-batches of 1 row vs the whole group of 4, each configuration in a
    fresh process (peak RSS reset after a warm-up step; glibc returns freed blocks: mmap threshold
    64 KiB). Architecture: SD3.5-medium's transformer blocks at full width (1536, 24 x 64 heads,
    joint attention 4096, qk RMSNorm, dual attention in the first 13 blocks) at 256x256 with
    154 text tokens, random weights; as many of its 24 blocks as this machine's free memory
    allows in memory and time (`--layers auto`, from 2- and 3-block pilots) or, by default, 4
    of them (the ratios are per block; the JSON says how many and why).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
MEMORY_CONFIGS = {                      # name: (gradient_checkpointing, micro_batch_size)
    "whole_group": (False, None), "whole_group_checkpointed": (True, None),
    "micro_1": (False, 1), "micro_1_checkpointed": (True, 1)}
GROUP, SIDE, T5_TOKENS = 4, 256, 77
DP_TRANSFORMER = dict(sample_size=16, patch_size=2, in_channels=16, out_channels=16,
                      num_layers=4, attention_head_dim=64, num_attention_heads=8,
                      caption_projection_dim=512, joint_attention_dim=96,
                      pooled_projection_dim=80, pos_embed_max_size=16, qk_norm="rms_norm",
                      dual_attention_layers=(0,))


def _env() -> None:
    from trainer.demo import RAY_ENV
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)


def machine() -> dict:
    return {"cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "load_average": os.getloadavg(),
            "mem_available_gib": round(_mem_available() / 2**30, 2)}


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


# ---- data parallel -------------------------------------------------------------------------------
def dp_checkpoint(root: Path) -> Path:
    """The tiny SD3 checkpoint with its transformer replaced by a wider random one."""
    from diffusers import SD3Transformer2DModel

    from testing.tiny_checkpoints import Family, build
    path = build(Family.SD3, root)
    torch.manual_seed(0)
    SD3Transformer2DModel(**DP_TRANSFORMER).save_pretrained(path / "transformer")
    return path


def dp_config(ckpt: Path, run_dir: Path, workers: int):
    from trainer.config import load_trainer_config
    per_worker = {"CPU": float(os.cpu_count() // max(workers, 1))}
    return load_trainer_config({
        "graph": {"app_name": "bench_scale", "rollout": {
            "adapter": "sd3", "weights_path": str(ckpt),
            "adapter_options": {"max_sequence_length": 32}}},
        "algorithm": "nft", "prompts_per_step": 2, "samples_per_prompt": 4,
        "sampler": {"sampler": "dpm2", "num_steps": 4, "height": 128, "width": 128},
        "lora": {"rank": 32, "alpha": 64}, "nft": {"train_timesteps": 2},
        "run_dir": str(run_dir),
        "learner": {"workers": workers, "resources_per_worker": per_worker}})


def dp_batch(learner, cfg):
    """8 rows (2 prompt groups of 4): conditions encoded by the learner's own text encoders,
    random clean latents (speed does not depend on their values)."""
    from contract import SamplingSpec
    from trainer.config import PromptSource
    from trainer.prompts import captions
    from trainer.updates import Batch
    family = learner.family
    prompts = family.conditioner.tokenize(captions(PromptSource.SHAPES, 2, 0))
    g = cfg.samples_per_prompt
    sampling = SamplingSpec(num_steps=cfg.sampler.num_steps, seeds=tuple(range(g)),
                            height=128, width=128, guidance_scale=1.0)
    rows = len(prompts) * g
    x0 = torch.randn((rows, *family.codec.state_shape(sampling)),
                     generator=torch.Generator().manual_seed(0))
    return Batch(x0=x0, rewards=torch.randn(rows, generator=torch.Generator().manual_seed(1)),
                 group_ids=tuple(f"p{i // g}" for i in range(rows)),
                 cond=learner.encode(prompts).repeat_rows([g] * len(prompts)), trajectory=None,
                 versions=("base",) * rows, scores={}, sampling=sampling,
                 seeds=tuple(range(rows)))


def _time_updates(update, repeats: int) -> list[float]:
    update()                                                             # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        update()
        times.append(time.perf_counter() - t0)
    return times


def run_dp(repeats: int) -> dict:
    import ray

    from trainer.distributed import Colocation, RayTrainLearners
    from trainer.learner import Learner
    from adapters.registry import get_family
    _env()
    root = Path(tempfile.mkdtemp(prefix="trainer_scale_"))
    ckpt = dp_checkpoint(root)
    out: dict = {"architecture": {"transformer": DP_TRANSFORMER, "image": "128x128",
                                  "text_tokens": 77 + 32, "checkpoint": "tiny SD3 (real "
                                  "layout) with this transformer, random weights"},
                 "algorithm": "nft, 2 trained timesteps, ref forward, LoRA r32, fp32",
                 "rows_per_step": 8}
    cfg0 = dp_config(ckpt, root / "inproc", 0)
    family = get_family("sd3", str(ckpt), {"max_sequence_length": 32})
    torch.set_num_threads(os.cpu_count())
    local = Learner.load(family, cfg0.lora, cfg0.optimizer, cfg0.seed, cfg0.learner)
    batch = dp_batch(local, cfg0)
    from trainer.updates import UPDATES
    gen = torch.Generator().manual_seed(0)
    times = _time_updates(lambda: UPDATES[cfg0.algorithm](local, batch, cfg0, gen), repeats)
    out["in_process"] = _rate(times, 8, f"{os.cpu_count()} torch threads, no Ray")
    local = None                                 # free it before the worker groups load theirs
    gc.collect()
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False,
             log_to_driver=False, object_store_memory=256 * 2**20, namespace="bench_scale")
    try:
        for workers in (1, 2):
            cfg = dp_config(ckpt, root / f"w{workers}", workers)
            t0 = time.perf_counter()
            group = RayTrainLearners(cfg, cfg.graph_config(), root / f"w{workers}",
                                     Colocation(None))
            start_s = time.perf_counter() - t0
            gen = torch.Generator().manual_seed(0)
            try:
                times = _time_updates(lambda: group.update(batch, gen), repeats)
            finally:
                group.close()
            entry = _rate(times, 8, f"{workers} Ray Train worker(s) x "
                          f"{cfg.learner.resources_per_worker['CPU']:g} CPU, gloo")
            entry["worker_group_start_s"] = round(start_s, 1)
            out[f"workers_{workers}"] = entry
    finally:
        ray.shutdown()
    out["ratio_2_workers_vs_1"] = out["workers_2"]["samples_per_s"] / \
        out["workers_1"]["samples_per_s"]
    out["ratio_1_worker_vs_in_process"] = out["workers_1"]["samples_per_s"] / \
        out["in_process"]["samples_per_s"]
    return out


def _rate(times: list[float], rows: int, how: str) -> dict:
    median = statistics.median(times)
    return {"how": how, "seconds_per_step": median, "seconds_all": times,
            "samples_per_s": rows / median}


# ---- memory (one configuration per process) --------------------------------------------------------
def memory_child(layers: int, checkpointing: bool, micro: int | None) -> dict:
    """Build SD3.5-medium blocks x `layers` (bf16, random), a LoRA learner, one group; warm up
    one step, reset the peak RSS, measure one step."""
    from adapters.checkpoint import component_class, read_json, read_model_index
    from adapters.sd3 import SD3Family
    from bench.sd35_skeleton import SD35_MEDIUM_TRANSFORMER, write_skeleton
    from contract import Condition, SamplingSpec
    from trainer.config import TrainerConfig
    from trainer.learner import Learner
    from trainer.updates import UPDATES, Batch
    torch.set_num_threads(os.cpu_count())
    arch = dict(SD35_MEDIUM_TRANSFORMER, num_layers=layers,
                dual_attention_layers=list(range(min(13, layers))))
    root = write_skeleton(Path(tempfile.mkdtemp(prefix="sd35_blocks_")), arch)
    family = SD3Family(root, {"max_sequence_length": T5_TOKENS})
    torch.manual_seed(0)
    cls = component_class(read_model_index(root), "transformer", root)
    model = cls.from_config(read_json(root, "transformer", "config.json")).to(torch.bfloat16)
    cfg = TrainerConfig(algorithm="nft", samples_per_prompt=GROUP, prompts_per_step=1,
                        nft={"train_timesteps": 1, "ref_kl_coef": 1e-4},
                        learner={"dtype": "bfloat16", "gradient_checkpointing": checkpointing,
                                 "micro_batch_size": micro})
    learner = Learner(family, {"transformer": model.eval()}, {}, cfg.lora, cfg.optimizer,
                      settings=cfg.learner)
    sampling = SamplingSpec(num_steps=10, seeds=tuple(range(GROUP)), height=SIDE, width=SIDE,
                            guidance_scale=1.0)
    gen = torch.Generator().manual_seed(0)
    text = 77 + T5_TOKENS
    cond = Condition({"prompt_embeds": torch.randn(GROUP, text, arch["joint_attention_dim"],
                                                   generator=gen),
                      "pooled": torch.randn(GROUP, arch["pooled_projection_dim"], generator=gen)})
    batch = Batch(x0=torch.randn((GROUP, *family.codec.state_shape(sampling)), generator=gen),
                  rewards=torch.randn(GROUP, generator=gen), group_ids=("p0",) * GROUP,
                  cond=cond, trajectory=None, versions=("base",) * GROUP, scores={},
                  sampling=sampling, seeds=tuple(range(GROUP)))
    step = lambda: UPDATES[cfg.algorithm](learner, batch, cfg, gen)       # noqa: E731
    step()                                   # warm-up: AdamW state, LoRA grads, kernels
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")                      # reset VmHWM
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    return {"layers": layers, "gradient_checkpointing": checkpointing,
            "micro_batch_size": micro, "rows": GROUP, "seconds": seconds,
            "resident_before_mib": before / 1024, "peak_mib": peak / 1024,
            "step_peak_mib": (peak - before) / 1024,
            "weights_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20}


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _child(layers: int, name: str) -> dict:
    checkpointing, micro = MEMORY_CONFIGS[name]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "bench.trainer_scale_bench", "--memory-child",
                           json.dumps([layers, checkpointing, micro])], capture_output=True,
                          text=True, env=env, cwd=Path(__file__).resolve().parent.parent)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def choose_layers(requested: str, step_budget_s: float) -> tuple[int, dict]:
    """All 24 blocks when they fit in half the free memory (and one step of the slowest
    configuration in `step_budget_s`), else the most that do, from 2- and 3-block pilots."""
    if requested != "auto":
        return int(requested), {"how": "given on the command line"}
    # 2 blocks at least: SD3's last block is context-pre-only (no attn.to_add_out to adapt)
    one, two = _child(2, "whole_group"), _child(3, "whole_group")
    if "error" in one or "error" in two:
        return 2, {"how": "pilot failed", "pilots": [one, two]}
    per_layer = (two["peak_mib"] - one["peak_mib"]) * 2**20
    fixed = one["peak_mib"] * 2**20 - 2 * per_layer
    budget = 0.5 * _mem_available()
    fits = int((budget - fixed) // max(per_layer, 1))
    # checkpointing recomputes the forward: its steps take ~1.3x; keep each under the budget
    per_layer_s = max(two["seconds"] - one["seconds"], 1e-3)
    in_time = int(step_budget_s / 1.3 / per_layer_s)
    layers = max(2, min(24, fits, in_time))
    return layers, {"how": "auto: the most of SD3.5-medium's 24 blocks whose estimated peak "
                           "fits in half of MemAvailable and whose slowest step fits the time "
                           "budget", "mem_available_gib": round(_mem_available() / 2**30, 2),
                    "per_block_peak_mib": per_layer / 2**20, "fixed_mib": fixed / 2**20,
                    "fits_blocks_memory": fits, "fits_blocks_time": in_time,
                    "step_budget_s": step_budget_s, "per_block_step_s": per_layer_s,
                    "pilots": [one, two]}


def run_memory(layers_arg: str, step_budget_s: float) -> dict:
    layers, why = choose_layers(layers_arg, step_budget_s)
    configs = {name: _child(layers, name) for name in MEMORY_CONFIGS}
    out = {"architecture": {"of": "SD3.5-medium transformer blocks, full width, random "
                                  "weights, bf16", "blocks": layers, "published_blocks": 24,
                            "image": f"{SIDE}x{SIDE}", "text_tokens": 77 + T5_TOKENS,
                            "group_rows": GROUP, "choice": why},
           "configs": configs}
    ok = {k: v["step_peak_mib"] for k, v in configs.items() if "step_peak_mib" in v}
    pairs = {"checkpointing_vs_none": ("whole_group_checkpointed", "whole_group"),
             "micro_1_vs_whole_group": ("micro_1", "whole_group"),
             "micro_1_checkpointed_vs_whole_group": ("micro_1_checkpointed", "whole_group")}
    out["step_peak_ratios"] = {name: ok[a] / ok[b] for name, (a, b) in pairs.items()
                               if a in ok and b in ok}
    times = {k: v["seconds"] for k, v in configs.items() if "seconds" in v}
    out["step_time_ratios"] = {name: times[a] / times[b] for name, (a, b) in pairs.items()
                               if a in times and b in times}
    return out


# ---- report ----------------------------------------------------------------------------------------
def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    dp = data.get("data_parallel", {})
    names = [k for k in ("in_process", "workers_1", "workers_2") if k in dp]
    rates = [dp[k]["samples_per_s"] for k in names]
    ax1.bar(names, rates, color=["C7", "C0", "C1"][:len(names)])
    for i, r in enumerate(rates):
        ax1.text(i, r, f"{r:.2f}", ha="center", va="bottom", fontsize=8)
    ax1.set_ylabel("learner samples / s")
    if "ratio_2_workers_vs_1" in dp:
        ax1.set_title(f"NFT step, {dp['rows_per_step']} rows, {data['machine']['cpus']} cores: "
                      f"2 workers / 1 = {dp['ratio_2_workers_vs_1']:.2f}", fontsize=9)
    mem = data.get("memory", {})
    configs = mem.get("configs", {})
    names = [k for k in MEMORY_CONFIGS if "step_peak_mib" in configs.get(k, {})]
    peaks = [configs[k]["step_peak_mib"] for k in names]
    ax2.bar(range(len(names)), peaks, color="C2")
    ax2.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names], fontsize=8)
    for i, p in enumerate(peaks):
        ax2.text(i, p, f"{p:.0f} MiB\n{configs[names[i]]['seconds']:.0f} s", ha="center",
                 va="bottom", fontsize=8)
    ax2.set_ylabel("peak memory added by one step (MiB)")
    if mem:
        arch = mem["architecture"]
        ax2.set_title(f"SD3.5-M blocks x {arch['blocks']}/24, {arch['image']}, "
                      f"{arch['group_rows']} rows, bf16 + LoRA", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=["dp", "memory"], default=None)
    parser.add_argument("--dp-repeats", type=int, default=3)
    parser.add_argument("--layers", default="4", help="SD3.5-medium blocks of the memory "
                        "measurement, or 'auto' (the most that fit: on a 2-core machine 23 "
                        "blocks, whose four configurations take over 30 minutes)")
    parser.add_argument("--step-budget-s", type=float, default=240.0, help="auto layers: the "
                        "slowest configuration's step stays under this")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS / "trainer_scale.json")
    args = parser.parse_args(argv)
    if args.memory_child is not None:
        print(json.dumps(memory_child(*json.loads(args.memory_child))), flush=True)
        return None
    only = set(args.only or ("dp", "memory"))
    data: dict = {"bench": "trainer_scale", "machine": machine()}
    if args.out.is_file():                      # a part not rerun keeps its earlier result
        previous = json.loads(args.out.read_text())
        for key, part in (("data_parallel", "dp"), ("memory", "memory")):
            if part not in only and key in previous:
                data[key] = previous[key]
    if "dp" in only:
        data["data_parallel"] = run_dp(args.dp_repeats)
    if "memory" in only:
        data["memory"] = run_memory(args.layers, args.step_budget_s)
    data["machine"]["load_average_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2, default=str) + "\n")
    plot(data, args.out.with_suffix(".png"))
    print(json.dumps({k: data[k] for k in data if k != "machine"}, indent=2, default=str)[:4000])
    return data


if __name__ == "__main__":
    main()
