"""The GPU check's measurements (bench/gpu_check.py runs them, each on its own).

A `Setup` holds the family (adapters.sd3.SD3Family on the config-only checkpoint), the rollout
engine's transformer and an identical copy for the learner; conditions are random tensors of the
real text shapes, one (cond, negative) pair per request index, seeded.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from adapters.checkpoint import component_class, read_json, read_model_index, resolve_dtype
from adapters.sd3 import SD3Family
from bench.plain_loop import plain_loop
from bench.sd35_skeleton import write_skeleton
from contract import Condition, PromptBundle, RolloutRequest, SamplerKind, SamplingSpec, Task
from rollout.engine import EmbeddedEngine
from rollout.engine_api import EngineRequest, EngineResult

GUIDANCE_SCALE = 4.5          # flow_grpo's SD3.5 recipe (CFG doubles every forward's rows)
MODES = ("engine_concurrent", "engine_sequential", "static_batch", "one_at_a_time_loop")


@dataclass(frozen=True)
class CheckSize:
    name: str
    transformer: dict[str, Any]
    resolutions: tuple[int, ...]
    requests: int
    steps: int
    group: int                  # rows of the learner's GRPO group and of the parity rollout
    max_sequence_length: int    # T5 window (SD3Options.max_sequence_length)
    device: str
    dtype: str
    budget_s: float
    parity_tolerance: float     # max |ratio - 1| accepted on-policy (bf16 rounding measured
    # here at ~3e-4; a 2 % sigma error in the recompute gives ~5e-3)
    min_left_s: float = 0.0     # a measurement starts only with this much budget left


@dataclass
class Setup:
    size: CheckSize
    family: SD3Family
    device: torch.device
    dtype: torch.dtype
    model: torch.nn.Module                 # the rollout engine's transformer
    learner_model: torch.nn.Module         # an identical copy for the learner
    text_tokens: int
    engine: EmbeddedEngine | None = None
    learner: Any = None
    conds: dict[int, tuple[Condition, Condition]] = field(default_factory=dict)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def random_condition(setup: Setup, seed: int) -> Condition:
    """One row of random text conditions with the real shapes (prompt_embeds: CLIP + T5 tokens x
    joint_attention_dim; pooled: pooled_projection_dim)."""
    cfg = setup.size.transformer
    g = torch.Generator().manual_seed(seed)
    return Condition({
        "prompt_embeds": torch.randn(1, setup.text_tokens, cfg["joint_attention_dim"],
                                     generator=g),
        "pooled": torch.randn(1, cfg["pooled_projection_dim"], generator=g)})


def conditions(setup: Setup, i: int) -> tuple[Condition, Condition]:
    if i not in setup.conds:
        setup.conds[i] = (random_condition(setup, 2 * i), random_condition(setup, 2 * i + 1))
    return setup.conds[i]


def make_requests(setup: Setup, n: int, side: int, steps: int, rows: int = 1, first: int = 0,
                  version: str = "base") -> list[EngineRequest]:
    """`n` requests of `rows` rows at side x side; prompt ids are placeholders (the conditions
    are given)."""
    out = []
    for i in range(first, first + n):
        sampling = SamplingSpec(sampler=SamplerKind.SDE, num_steps=steps,
                                seeds=tuple(1000 + rows * i + k for k in range(rows)),
                                guidance_scale=GUIDANCE_SCALE, height=side, width=side)
        prompt = PromptBundle(token_ids=(0,), encoder_token_ids={"clip_g": (0,), "t5": (0,)})
        cond, negative = conditions(setup, i)
        rr = RolloutRequest(prompt=prompt, sampling=sampling, task=Task.T2I,
                            policy_version=version, request_id=f"r{side}-{i}-{version}")
        out.append(EngineRequest(rr, cond, negative, ("image_latent",), {}, version))
    return out


def build(size: CheckSize, root: Path) -> Setup:
    device = torch.device(size.device)
    dtype = resolve_dtype(size.dtype, device)
    write_skeleton(root, size.transformer)
    family = SD3Family(root, {"max_sequence_length": size.max_sequence_length})
    cls = component_class(read_model_index(root), "transformer", root)
    torch.manual_seed(0)
    with torch.device(device):
        model = cls.from_config(read_json(root, "transformer", "config.json"))
    model = model.to(dtype).eval().requires_grad_(False)
    text_tokens = family.spec.encoder("clip_l").max_length + family.spec.encoder("t5").max_length
    setup = Setup(size, family, device, dtype, model, model, text_tokens)
    return setup


@torch.no_grad()
def calibrate(setup: Setup) -> dict:
    """Scale proj_out so the raw output has unit RMS on noise at sigma = 1 (random weights give
    an arbitrary scale); then copy the transformer for the learner (identical weights)."""
    side = setup.size.resolutions[0]
    request = make_requests(setup, 1, side, setup.size.steps)[0]
    shape = setup.family.codec.state_shape(request.request.sampling)
    x = torch.randn(1, *shape, generator=torch.Generator().manual_seed(7))
    cond = request.cond.to(setup.device, setup.dtype)
    out = setup.family.denoiser.forward(
        {"transformer": setup.model}, x.to(setup.device, setup.dtype), None,
        torch.full((1,), 1000.0, device=setup.device), cond, None, None).float()
    rms = float(out.pow(2).mean().sqrt())
    if not math.isfinite(rms) or rms == 0:
        raise FloatingPointError(f"the random transformer's output RMS is {rms}")
    setup.model.proj_out.weight.div_(rms)
    setup.model.proj_out.bias.div_(rms)
    setup.learner_model = copy.deepcopy(setup.model)
    params = sum(p.numel() for p in setup.model.parameters())
    return {"parameters": params, "raw_output_rms": rms, "output_rms_after": 1.0,
            "text_tokens": setup.text_tokens}


def run_engine(engine: EmbeddedEngine, requests: list[EngineRequest],
               concurrent: bool) -> list[EngineResult]:
    if concurrent:
        futures = [engine.submit(r) for r in requests]
        return [f.result() for f in futures]
    return [engine.submit(r).result() for r in requests]


def mode_runner(setup: Setup, mode: str, requests: list[EngineRequest]) -> Callable[[], Any]:
    models = {"transformer": setup.model}
    return {"engine_concurrent": lambda: run_engine(setup.engine, requests, True),
            "engine_sequential": lambda: run_engine(setup.engine, requests, False),
            "static_batch": lambda: plain_loop(setup.family, models, requests, setup.device),
            "one_at_a_time_loop": lambda: [plain_loop(setup.family, models, [r], setup.device)
                                           for r in requests]}[mode]


def warm_up(setup: Setup, side: int) -> dict:
    """Every mode once on 2 requests x 2 steps (kernels, allocator) before anything is timed."""
    requests = make_requests(setup, 2, side, 2, first=10_000)
    t0 = time.perf_counter()
    for mode in MODES:
        mode_runner(setup, mode, requests)()
    sync(setup.device)
    return {"seconds": time.perf_counter() - t0}


def time_mode(setup: Setup, mode: str, side: int) -> dict:
    requests = make_requests(setup, setup.size.requests, side, setup.size.steps)
    sync(setup.device)
    reset_peak(setup.device)
    t0 = time.perf_counter()
    out = mode_runner(setup, mode, requests)()
    sync(setup.device)
    seconds = time.perf_counter() - t0
    result = {"seconds": seconds, "samples_per_s": len(requests) / seconds,
              "peak_gpu_mib": peak_mib(setup.device)}
    if mode.startswith("engine"):
        result["batch_rows_mean"] = sum(r.metrics["batch_rows_mean"] for r in out) / len(out)
    return result


def ratios(modes: dict) -> dict:
    sps = {m: v["samples_per_s"] for m, v in modes.items() if isinstance(v, dict)
           and "samples_per_s" in v}
    pairs = {"batching_speedup": ("engine_concurrent", "engine_sequential"),
             "vs_static_batch": ("engine_concurrent", "static_batch"),
             "vs_one_at_a_time_loop": ("engine_concurrent", "one_at_a_time_loop")}
    return {name: sps[a] / sps[b] for name, (a, b) in pairs.items() if a in sps and b in sps}


def build_learner(setup: Setup) -> dict:
    from trainer.config import OptimizerConfig
    from trainer.learner import Learner
    from trainer.learner_config import LearnerConfig
    from trainer.lora import LoRATrainConfig
    settings = LearnerConfig(device=str(setup.device), dtype=setup.size.dtype,
                             gradient_checkpointing=True, micro_batch_size=setup.size.group)
    lora = LoRATrainConfig()
    setup.learner = Learner(setup.family, {"transformer": setup.learner_model}, {}, lora,
                            OptimizerConfig(), seed=0, settings=settings)
    return {"path": "trainer.learner.Learner + trainer.updates.grpo_update",
            "settings": settings.model_dump(mode="json"), "lora_rank": lora.rank,
            "lora_alpha": lora.alpha,
            "trainable_parameters": sum(p.numel() for p in setup.learner.params)}


def on_device(traj, device: torch.device):
    return dataclasses.replace(traj, latents=traj.latents.to(device),
                               sigmas=traj.sigmas.to(device),
                               model_timesteps=traj.model_timesteps.to(device),
                               log_probs=traj.log_probs.to(device))


def group_rollout(setup: Setup, side: int, version: str, first: int):
    """One GRPO group (`group` rows of one prompt) rolled out by the engine as `version`."""
    request = make_requests(setup, 1, side, setup.size.steps, rows=setup.size.group,
                            first=first, version=version)[0]
    result = setup.engine.submit(request).result()
    rows = setup.size.group
    return request, result, request.cond.expand_rows(rows), request.negative.expand_rows(rows)


def learner_step(setup: Setup, side: int, repeats: int = 2) -> dict:
    """grpo_update on one group (random rewards: the scorers are not measured), one trained
    timestep; the first update warms up, the next `repeats` are timed. The batch is held on
    the CPU as the trainer holds it (the update moves each micro-batch to the device)."""
    from trainer.config import TrainerConfig
    from trainer.learner import state_from_latents
    from trainer.updates import Batch, grpo_update
    g = setup.size.group
    request, result, cond, uncond = group_rollout(setup, side, "base", first=20_000 + side)
    sampling = request.request.sampling
    traj = result.trajectory
    x0 = state_from_latents(setup.family, {"image_latent": result.latents["image_latent"].data},
                            sampling)
    rewards = torch.randn(g, generator=torch.Generator().manual_seed(side))
    batch = Batch(x0=x0, rewards=rewards, group_ids=(request.request.request_id,) * g,
                  cond=cond, trajectory=traj, versions=("base",) * g, scores={},
                  sampling=sampling, window_groups=((torch.arange(g), traj),), uncond=uncond,
                  seeds=sampling.seeds)
    cfg = TrainerConfig(algorithm="flow_grpo", samples_per_prompt=g,
                        flow_grpo={"max_train_steps": 1}, learner=setup.learner.settings)
    gen = torch.Generator().manual_seed(0)
    grpo_update(setup.learner, batch, cfg, gen)                              # warm-up
    times, peaks, metrics = [], [], {}
    for _ in range(repeats):
        sync(setup.device)
        resident = torch.cuda.memory_allocated(setup.device) / 2**20 \
            if setup.device.type == "cuda" else None
        reset_peak(setup.device)
        t0 = time.perf_counter()
        metrics = grpo_update(setup.learner, batch, cfg, gen)
        sync(setup.device)
        times.append(time.perf_counter() - t0)
        peaks.append(peak_mib(setup.device))
    seconds = sorted(times)[len(times) // 2]
    micro = cfg.learner.micro_batch_size or g
    return {"rows": g, "micro_batch_rows": micro, "forward_rows": 2 * micro,
            "trained_timesteps": 1, "seconds": seconds,
            "seconds_all": times, "seconds_per_row_timestep": seconds / g,
            "peak_gpu_mib": peaks[-1], "resident_gpu_mib_before": resident,
            "grad_norm": metrics.get("grad_norm"),
            "loss_metrics": {k: v for k, v in metrics.items() if isinstance(v, float)}}


VELOCITY_CHANGE = 0.05    # the parity adapter moves the velocity by ~5 % (RMS, measured)
VELOCITY_CHANGE_RTOL = 0.2  # ... within 20 %, after at most VELOCITY_RESCALES rescalings of B
VELOCITY_RESCALES = 4


@torch.no_grad()
def velocity_change(setup: Setup, side: int) -> float:
    """RMS(v_current - v_reference) / RMS(v_reference) on a seeded probe state at sigma = 0.5
    (one row, unguided, the first request's conditions at this side)."""
    from trainer.lora import PolicyRole
    request = make_requests(setup, 1, side, setup.size.steps, first=40_000 + side)[0]
    shape = setup.family.codec.state_shape(request.request.sampling)
    x = torch.randn(1, *shape, generator=torch.Generator().manual_seed(side)).to(setup.device)
    sigma = torch.full((1,), 0.5, device=setup.device)
    v = {role: setup.learner.velocity(x, sigma, request.cond, role).float()
         for role in (PolicyRole.CURRENT, PolicyRole.REFERENCE)}
    change = (v[PolicyRole.CURRENT] - v[PolicyRole.REFERENCE]).pow(2).mean().sqrt()
    return float(change / v[PolicyRole.REFERENCE].pow(2).mean().sqrt())


@torch.no_grad()
def strengthen_adapter(setup: Setup, side: int) -> tuple[dict[str, torch.Tensor], float, float]:
    """The learner's trained adapter with lora_B redrawn (seeded by `side`) so the velocity
    moves by ~VELOCITY_CHANGE (a few optimizer steps from B = 0 leave it ~1e-3, too small for
    parity to tell a wrong or missing adapter); loaded back into the learner. B is drawn so each
    layer's update is ~VELOCITY_CHANGE of its output (A ~ N(0, 1/r), W ~ U(+-1/sqrt(in)):
    |scale B A x| / |W x| ~ scale std(B) sqrt(3 in)), then rescaled (at most VELOCITY_RESCALES
    times) by the measured change of the whole velocity until it is within VELOCITY_CHANGE_RTOL
    (layers and norms do not pass a per-layer change on unchanged, nor linearly).
    Returns the tensors, the adapter's scale and the velocity change they give."""
    from trainer.lora import TRAIN_ADAPTER
    packed, scale = setup.learner.export_packed()
    tensors = dict(packed.unpack())
    g = torch.Generator().manual_seed(side)
    b_keys = sorted(k for k in tensors if ".lora_B." in k)
    for key in b_keys:
        a = tensors[key.replace(".lora_B.", ".lora_A.")]
        std = VELOCITY_CHANGE / (scale * math.sqrt(3 * a.shape[1]))
        tensors[key] = (torch.randn(tensors[key].shape, generator=g) * std).to(
            tensors[key].dtype)
    setup.learner.load_adapter(TRAIN_ADAPTER, tensors)
    change = velocity_change(setup, side)
    for _ in range(VELOCITY_RESCALES):
        if not math.isfinite(change) or change == 0:
            raise FloatingPointError(f"the parity adapter changes the velocity by {change}")
        if abs(change / VELOCITY_CHANGE - 1) <= VELOCITY_CHANGE_RTOL:
            break
        for key in b_keys:
            tensors[key] = tensors[key] * (VELOCITY_CHANGE / change)
        setup.learner.load_adapter(TRAIN_ADAPTER, tensors)
        change = velocity_change(setup, side)
    return tensors, scale, change


@torch.no_grad()
def parity(setup: Setup, side: int) -> dict:
    """The learner's current adapter published to the engine as a version; a group rolled out
    with it; each window step's log-prob recomputed through the learner (Learner.velocity +
    recompute_step): |ratio - 1| on-policy. Beside it, the same recompute as the reference
    policy (adapters off): how far a rollout sampled with the wrong weights would be."""
    from trainer.algorithms import recompute_step
    from trainer.config import FlowGRPOConfig
    from trainer.lora import PolicyRole
    tensors, scale, change = strengthen_adapter(setup, side)
    version = f"learner-{side}"
    setup.engine.load_lora(version, tensors, scale)
    request, result, cond, uncond = group_rollout(setup, side, version, first=30_000 + side)
    traj = on_device(result.trajectory, setup.device)
    start, end = traj.window
    deviation = {PolicyRole.CURRENT: [], PolicyRole.REFERENCE: []}
    for j in range(start, end):
        sigma = traj.sigmas[j].expand(setup.size.group)
        for role, out in deviation.items():
            v = setup.learner.velocity(traj.latents[:, j - start], sigma, cond, role,
                                       traj.guidance_scale, uncond)
            ratio = torch.exp(recompute_step(traj, j, v).log_prob - traj.log_probs[:, j - start])
            out.append((ratio - 1).abs().cpu())
    dev = torch.stack(deviation[PolicyRole.CURRENT], dim=1)                  # (rows, W)
    wrong = torch.stack(deviation[PolicyRole.REFERENCE], dim=1)
    max_dev, clip_range = float(dev.max()), FlowGRPOConfig().clip_range
    return {"rows": setup.size.group, "window_steps": end - start, "version": version,
            "max_abs_ratio_minus_1": max_dev, "mean_abs_ratio_minus_1": float(dev.mean()),
            "max_per_step": dev.max(dim=0).values.tolist(),
            "reference_policy_max_abs_ratio_minus_1": float(wrong.max()),
            "reference_policy_mean_abs_ratio_minus_1": float(wrong.mean()),
            "reference_policy_max_per_step": wrong.max(dim=0).values.tolist(),
            "velocity_change_target": VELOCITY_CHANGE, "velocity_change": change,
            "tolerance": setup.size.parity_tolerance,
            "ok": bool(math.isfinite(max_dev) and max_dev <= setup.size.parity_tolerance),
            "flow_grpo_clip_range": clip_range, "within_clip_range": max_dev <= clip_range}
