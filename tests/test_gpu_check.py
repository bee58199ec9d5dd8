"""scripts/gpu_check.sh: the GPU check end to end at tiny size on the CPU (the same code the GPU
machine runs at full size), the full-size SD3.5-medium configuration it builds, and that every
package its modules import is on the GPU machine or carried as a wheel."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_env import missing_on_gpu
from bench.gpu_measures import MODES
from bench.sd35_skeleton import SD35_MEDIUM_TRANSFORMER, write_skeleton

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[dict, Path, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("gpu_check")
    out_dir = tmp / "device_out"
    out_dir.mkdir()
    env = dict(os.environ, OUT=str(out_dir), PYTHON=sys.executable)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--tiny", "--out",
                           str(tmp / "gpu_check.json")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp / "gpu_check.json").read_text()), out_dir, proc


def _leaves(node, prefix=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix.rstrip("."), node


def test_tiny_run_measures_everything(tiny_run):
    data, out_dir, _ = tiny_run
    bad = [k for k, _ in _leaves(data) if k.endswith((".error", ".skipped"))]
    assert bad == [], {k.rsplit(".", 1)[0]: v for k, v in _leaves(data) if k in bad}
    assert data["size"] == "tiny" and data["dtype"] == "bfloat16"
    assert "text encoders are not measured" in data["text_conditions"]
    assert data["setup"]["parameters"] > 0 and math.isfinite(data["setup"]["raw_output_rms"])
    requests = data["requests"]
    for side in (64, 128):
        key = f"{side}x{side}"
        rollout = data["rollout"][key]
        sigmas = rollout["sigmas"]
        assert len(sigmas) == data["steps"] + 1 and sigmas[0] == 1.0 and sigmas[-1] == 0.0
        for mode in MODES:
            assert rollout[mode]["seconds"] > 0 and rollout[mode]["samples_per_s"] > 0, mode
        # all requests packed into each forward vs one at a time
        assert rollout["engine_concurrent"]["batch_rows_mean"] == requests
        assert rollout["engine_sequential"]["batch_rows_mean"] == 1
        assert set(rollout["ratios"]) == {"batching_speedup", "vs_static_batch",
                                          "vs_one_at_a_time_loop"}
        assert all(r > 0 and math.isfinite(r) for r in rollout["ratios"].values())
        learner = data["learner"][key]
        assert learner["seconds"] > 0 and learner["rows"] == data["group"]
        assert learner["trained_timesteps"] == 1 and learner["forward_rows"] == 2 * data["group"]
        assert math.isfinite(learner["grad_norm"]) and learner["grad_norm"] > 0
        parity = data["parity"][key]
        assert parity["ok"] and parity["max_abs_ratio_minus_1"] <= parity["tolerance"]
        assert parity["window_steps"] == data["steps"] - 1
        # the check tells policies apart: with the adapter moving the velocity by its target
        # (measured), the reference policy's ratio moves further than bf16 rounding does
        assert abs(parity["velocity_change"] / parity["velocity_change_target"] - 1) <= 0.2
        assert parity["reference_policy_max_abs_ratio_minus_1"] > \
            2 * parity["max_abs_ratio_minus_1"]
    settings = data["learner"]["setup"]["settings"]
    assert settings["gradient_checkpointing"] and settings["dtype"] == "bfloat16"
    # what the device machine's $OUT receives: the JSON, its plot and the log
    assert json.loads((out_dir / "gpu_check.json").read_text()) == data
    assert (out_dir / "gpu_check.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[gpu_check] wrote" in (out_dir / "gpu_check.log").read_text()


def test_full_size_is_the_published_sd35_medium(tmp_path):
    """The full-size run builds SD3.5-medium: 2.24 B parameters, 13 dual-attention blocks of 24,
    SD3Family's encoders and windows (77 + 77 + 256 T5 tokens) and 1024 px default."""
    from diffusers import SD3Transformer2DModel

    from adapters.sd3 import SD3Family
    root = write_skeleton(tmp_path / "sd35", SD35_MEDIUM_TRANSFORMER)
    family = SD3Family(root)
    assert [(e.name, e.max_length) for e in family.spec.encoders] == [
        ("clip_l", 77), ("clip_g", 77), ("t5", 256)]
    assert family.spec.sampling_defaults["height"] == 1024
    assert family.schedule_shift(_sampling(512)) == 3.0           # static shift, any size
    with torch.device("meta"):
        model = SD3Transformer2DModel.from_config(SD35_MEDIUM_TRANSFORMER)
    params = sum(p.numel() for p in model.parameters())
    assert 2.2e9 < params < 2.3e9
    assert sum(b.attn2 is not None for b in model.transformer_blocks) == 13


def _sampling(side: int):
    from contract import SamplingSpec
    return SamplingSpec(seeds=(0,), height=side, width=side)


def test_everything_it_imports_is_on_the_gpu_machine(tiny_run):
    """A module-level import of a package the GPU machine lacks (and no wheel carries) would
    fail there before measuring anything: the run lists what its modules import."""
    imports = tiny_run[0]["imports"]
    assert {"torch", "diffusers", "pydantic", "peft"} <= set(imports["distributions"])
    assert imports["missing_on_gpu_machine"] == []
    assert missing_on_gpu({"ray", "torch"}) == ["ray"]          # Ray stays behind


def test_plain_loop_samples_what_the_engine_samples(tmp_path):
    """The baselines do the engine's work: the same rows, seeds, sigmas and CFG give the same
    final latents (fp32), whether the engine packs the requests or the loop stacks them."""
    import asyncio
    import dataclasses

    from bench import gpu_measures as m
    from bench.gpu_check import TINY
    from bench.plain_loop import plain_loop
    from rollout.config import EngineLimits
    from rollout.engine import EmbeddedEngine

    setup = m.build(dataclasses.replace(TINY, dtype="float32"), tmp_path / "sd35")
    m.calibrate(setup)
    engine = EmbeddedEngine(setup.family, {"transformer": setup.model}, {},
                            EngineLimits(max_batch_rows=4))
    try:
        requests = m.make_requests(setup, 3, 64, 4, rows=2)
        results = m.run_engine(engine, requests, concurrent=True)
    finally:
        asyncio.run(engine.shutdown())
    engine_x = torch.cat([r.latents["image_latent"].data for r in results])
    loop_x = plain_loop(setup.family, {"transformer": setup.model}, requests)
    assert engine_x.shape == loop_x.shape == (6, 16, 8, 8)
    torch.testing.assert_close(loop_x, engine_x, rtol=1e-5, atol=1e-5)
    assert not torch.equal(engine_x[0], engine_x[1])            # rows have their own seeds
