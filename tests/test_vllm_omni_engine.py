"""The vLLM-Omni engine end to end on CPU: real adapter + real tiny SD3 DiT + our sampler, run by
RolloutPipeline inside the AsyncOmni fake (testing/vllm_omni_fake.py)."""
from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys

import pytest
import torch

from contract import (LoRAMapError, MissingArtifactError, NonFiniteOutputError,
                      PolicyVersionError, RequestCancelledError, RolloutRequest, SamplerKind,
                      SamplingSpec, Task, UnexpectedArtifactError)
from rollout.engine_api import DiffusionEngine, EngineRequest
from rollout.vllm_omni.engine import VllmOmniEngine
from testing.vllm_omni_fake import fake_api
from rollout.vllm_omni.lowering import normalize_output

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from adapters.tiny_t2i import TinyT2IFamily

    path = tmp_path_factory.mktemp("tiny_t2i")
    TinyT2IFamily().save(TinyT2IFamily().build(seed=0), path)
    family = TinyT2IFamily(path)
    components = {"transformer": family.load("transformer"), "encoders": family.load_encoders()}
    return family, components, str(path)


@pytest.fixture()
def engine(built, tmp_path):
    _, _, path = built
    eng = VllmOmniEngine.create("tiny_t2i", path, api=fake_api(), dtype=torch.float32,
                                lora_root=str(tmp_path / "loras"))
    yield eng
    asyncio.run(eng.shutdown())


def make_request(built, seeds=(1, 2), steps=3, version="base", rid=None,
                 guidance=1.0, sampler="sde") -> EngineRequest:
    adapter, components, _ = built
    bundle = adapter.conditioner.tokenize(
        ["a red circle at the top left on a black background"])[0]
    sampling = SamplingSpec(num_steps=steps, seeds=seeds, height=32, width=32,
                            guidance_scale=guidance, sampler=SamplerKind(sampler))
    kw = {"request_id": rid} if rid else {}
    request = RolloutRequest(prompt=bundle, sampling=sampling, task=Task.T2I, **kw)
    encoders, conditioner = components["encoders"], adapter.conditioner
    cond = conditioner.encode(encoders, [bundle])
    negative = (conditioner.encode(encoders, [conditioner.null_prompt()])
                if guidance != 1.0 else None)
    return EngineRequest(request=request, cond=cond, negative=negative,
                         latent_artifacts=("image_latent",), media={}, policy_version=version)


def lora_tensors(built, rank=2, seed=0, module="transformer_blocks.0.attn.to_q"):
    _, components, _ = built
    linear = components["transformer"].get_submodule(module)
    g = torch.Generator().manual_seed(seed)
    return {f"{module}.lora_A.weight": torch.randn(rank, linear.in_features, generator=g),
            f"{module}.lora_B.weight": torch.randn(linear.out_features, rank, generator=g)}


def test_generate_returns_latents_and_trajectory(engine, built):
    assert isinstance(engine, DiffusionEngine)
    req = make_request(built, seeds=(1, 2), steps=3)
    result = asyncio.run(engine.generate(req))
    latent = result.latents["image_latent"]
    assert latent.data.shape == (2, 4, 8, 8) and latent.data.dtype == torch.float32
    t = result.trajectory
    assert t.window == (0, 2) and t.latents.shape == (2, 3, 4, 8, 8)
    assert t.log_probs.shape == (2, 2) and torch.isfinite(t.log_probs).all()
    assert t.sigmas.shape == (4,) and t.sigmas[0] == 1.0 and t.sigmas[-1] == 0.0
    assert torch.allclose(t.model_timesteps, 1000.0 * t.sigmas[:-1])
    assert t.seeds == (1, 2) and result.policy_version == "base" == t.policy_version
    # the last window state is the returned latent (window ends before the final ODE step)
    assert not torch.equal(t.latents[:, -1], latent.data)
    # token ids, never text, crossed the engine boundary; conditions travel as embeddings
    prompt, params = engine._omni.generate_calls[-1]
    assert prompt["prompt_ids"] == list(req.request.prompt.token_ids) and "prompt" not in prompt
    assert params.num_inference_steps == 3 and params.num_outputs_per_prompt == 2
    # rows are independent of batch mates and deterministic per seed
    alone = asyncio.run(engine.generate(make_request(built, seeds=(2,), steps=3)))
    assert torch.allclose(alone.latents["image_latent"].data[0], latent.data[1], atol=1e-5)


@torch.no_grad()
def test_cfg_equals_an_independent_euler_loop(engine, built):
    """Guided ODE sampling equals Euler steps written here on the raw transformer with
    v = v_neg + g (v_pos - v_neg) (SD3's form); guidance 1 is the positive branch alone."""
    _, components, _ = built
    dit = components["transformer"]

    def velocity(x, sigma, cond):
        return dit(hidden_states=x, encoder_hidden_states=cond["hidden"],
                   pooled_projections=cond["pooled"], timestep=(1000.0 * sigma).reshape(1),
                   return_dict=False)[0]

    final = {}
    for g in (1.0, 4.0):
        req = make_request(built, seeds=(3,), guidance=g, sampler="ode")
        out = asyncio.run(engine.generate(req))
        t = out.trajectory
        assert t.guidance_scale == g and (req.negative is None) == (g == 1.0)
        x = t.latents[:, 0].clone()                        # the seed's initial noise
        for sigma, sigma_next in zip(t.sigmas[:-1], t.sigmas[1:]):
            v_pos = velocity(x, sigma, req.cond)
            v = v_pos if g == 1.0 else (velocity(x, sigma, req.negative) +
                                        g * (v_pos - velocity(x, sigma, req.negative)))
            x = x + (sigma_next - sigma) * v
        final[g] = out.latents["image_latent"].data
        torch.testing.assert_close(final[g], x, rtol=0, atol=1e-4)
    assert (final[4.0] - final[1.0]).abs().max() > 1e-2     # the check can tell them apart


def test_lora_version_ids_new_per_version_reused_per_version(engine, built):
    engine.load_lora("v1", lora_tensors(built, seed=1), scale=2.0)
    id1 = engine.lora_id("v1")
    a = asyncio.run(engine.generate(make_request(built, version="v1")))
    b = asyncio.run(engine.generate(make_request(built, version="v1")))
    ids = [p.lora_request.lora_int_id for _, p in engine._omni.generate_calls[-2:]]
    assert ids == [id1, id1] and a.policy_version == "v1"
    assert torch.equal(a.latents["image_latent"].data, b.latents["image_latent"].data)
    engine.load_lora("v2", lora_tensors(built, seed=2))
    id2 = engine.lora_id("v2")
    engine.unload_lora("v1")
    engine.load_lora("v1", lora_tensors(built, seed=1), scale=2.0)
    id1_again = engine.lora_id("v1")
    assert len({0, id1, id2, id1_again}) == 4 and engine.versions() == ("base", "v2", "v1")
    base = asyncio.run(engine.generate(make_request(built)))
    v1 = asyncio.run(engine.generate(make_request(built, version="v1")))
    assert not torch.allclose(base.latents["image_latent"].data, v1.latents["image_latent"].data)
    # same tensors under a new id give the same samples: the worker really loaded them
    assert torch.allclose(v1.latents["image_latent"].data, a.latents["image_latent"].data,
                          atol=1e-5)
    with pytest.raises(PolicyVersionError) as err:
        asyncio.run(engine.generate(make_request(built, version="v9")))
    assert err.value.field == "policy_version"


@pytest.mark.parametrize("tensors_fn, field", [
    (lambda built: {}, "tensors"),
    (lambda built: lora_tensors(built, module="transformer_blocks.0.norm1.linear"),
     "tensors.transformer_blocks.0.norm1.linear.lora_A.weight"),
    (lambda built: {k.replace("blocks.0", "blocks.99"): v
                    for k, v in lora_tensors(built).items()},
     "tensors.transformer_blocks.99.attn.to_q.lora_A.weight"),
    (lambda built: {k: (v[:, :-1] if "lora_A" in k else v)
                    for k, v in lora_tensors(built).items()},
     "tensors.transformer_blocks.0.attn.to_q.lora_A.weight"),
])
def test_lora_that_matches_nothing_or_misfits_is_refused(engine, built, tensors_fn, field):
    with pytest.raises(LoRAMapError) as err:
        engine.load_lora("bad", tensors_fn(built))
    assert err.value.field == field and engine.versions() == ("base",)


def test_sleep_and_wake(engine, built):
    before = asyncio.run(engine.generate(make_request(built, seeds=(5,))))
    asyncio.run(engine.sleep(level=1))
    with pytest.raises(RuntimeError):
        asyncio.run(engine.generate(make_request(built, seeds=(5,))))
    asyncio.run(engine.wake_up())
    after = asyncio.run(engine.generate(make_request(built, seeds=(5,))))
    assert torch.equal(before.latents["image_latent"].data, after.latents["image_latent"].data)


def test_cancel_raises_request_cancelled_and_spares_others(engine, built):
    async def run():
        victim = asyncio.ensure_future(engine.generate(make_request(built, rid="victim", steps=8)))
        other = asyncio.ensure_future(engine.generate(make_request(built, rid="other", steps=2)))
        while "victim" not in engine._inflight:
            await asyncio.sleep(0.001)
        assert engine.cancel("victim") is True
        with pytest.raises(RequestCancelledError) as err:
            await victim
        assert err.value.request_id == "victim"
        assert (await other).request_id == "other"
        assert engine.cancel("victim") is False
    asyncio.run(run())


def test_missing_or_undeclared_output_fails_closed(engine, built):
    req = make_request(built, seeds=(1,), steps=2)
    captured = {}
    original = engine._last_output

    async def keep(*args):
        captured["out"] = await original(*args)
        return captured["out"]
    engine._last_output = keep
    asyncio.run(engine.generate(req))
    out = captured["out"]
    missing = dataclasses.replace(out, images=[{}])
    with pytest.raises(MissingArtifactError) as err:
        normalize_output(missing, req, engine.adapter, 0, {})
    assert err.value.field == "artifacts.image_latent"
    extra = dataclasses.replace(out, images=[{**out.images[0], "audio_latent": out.images[0][
        "image_latent"]}])
    with pytest.raises(UnexpectedArtifactError):
        normalize_output(extra, req, engine.adapter, 0, {})
    with pytest.raises(MissingArtifactError) as err:
        normalize_output(dataclasses.replace(out, trajectory_log_probs=None), req,
                         engine.adapter, 0, {})
    assert err.value.field == "trajectory_log_probs"
    with pytest.raises(MissingArtifactError):
        normalize_output(dataclasses.replace(out, multimodal_output={}), req, engine.adapter,
                         0, {})
    with pytest.raises(PolicyVersionError):
        normalize_output(out, req, engine.adapter, 7, {})
    # a non-finite value from the worker is this request's server-side fault, never a 200
    poisoned = out.trajectory_log_probs.clone()
    poisoned[0, -1] = float("nan")
    with pytest.raises(NonFiniteOutputError) as err:
        normalize_output(dataclasses.replace(out, trajectory_log_probs=poisoned), req,
                         engine.adapter, 0, {})
    assert err.value.field == "trajectory.log_probs" and err.value.http_status == 500
    latent = {"image_latent": torch.full_like(out.images[0]["image_latent"], float("inf"))}
    with pytest.raises(NonFiniteOutputError) as err:
        normalize_output(dataclasses.replace(out, images=[latent]), req, engine.adapter, 0, {})
    assert err.value.field == "artifacts.image_latent" and err.value.request_id == \
        req.request.request_id


def test_importing_the_project_does_not_import_vllm():
    code = ("import sys, importlib\n"
            "mods = ['rollout', 'rollout.engine_api', 'rollout.vllm_omni', 'rollout.vllm_omni.api',"
            " 'rollout.vllm_omni.engine', 'rollout.vllm_omni.lowering', 'rollout.vllm_omni.lora',"
            " 'rollout.vllm_omni.pipeline', 'testing.vllm_omni_fake']\n"
            "for m in ['rollout.strategy', 'rollout.engine', 'rollout.config']:\n"
            "    try: importlib.import_module(m)\n"
            "    except ImportError: pass\n"
            "for m in mods: importlib.import_module(m)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'vllm_omni'))\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_checkpoint_family_runs_the_same_step_under_vllm_omni(tiny_checkpoint, tmp_path):
    """The tiny SD3 checkpoint through the vLLM-Omni engine (fake AsyncOmni, the real
    RolloutPipeline) samples what the embedded engine samples; its folder resolves to an
    architecture the wheel registers (tests/test_vllm_omni_wheel_contract.py)."""
    from adapters.registry import get_family
    from contract import ConfigError
    from rollout.engine import EmbeddedEngine
    from rollout.vllm_omni.engine import check_architecture
    root = str(tiny_checkpoint("sd3"))
    family = get_family("sd3", root)
    encoders = family.load_encoders()
    bundle = family.conditioner.tokenize(["a red circle"], ["blurry"])[0]
    sampling = SamplingSpec(num_steps=3, seeds=(1, 2), height=32, width=48,
                            guidance_scale=2.0)
    request = RolloutRequest(prompt=bundle, sampling=sampling, task=Task.T2I)
    cond = family.conditioner.encode(encoders, [bundle])
    negative = family.conditioner.encode(encoders, [bundle.negative])
    lowered = EngineRequest(request=request, cond=cond, negative=negative,
                            latent_artifacts=("image_latent",), media={},
                            policy_version="base")
    vllm = VllmOmniEngine.create("sd3", root, api=fake_api(), dtype=torch.float32,
                                 lora_root=str(tmp_path / "loras"))
    embedded = EmbeddedEngine(family, family.load_transformers(), {})
    try:
        a = asyncio.run(vllm.generate(lowered))
        b = asyncio.run(embedded.generate(lowered))
    finally:
        asyncio.run(vllm.shutdown())
        asyncio.run(embedded.shutdown())
    assert (a.latents["image_latent"].data - b.latents["image_latent"].data).abs().max() <= 1e-5
    assert (a.trajectory.log_probs - b.trajectory.log_probs).abs().max() <= 1e-5
    family.pipeline_class = "SomeOtherPipeline"
    with pytest.raises(ConfigError) as err:
        check_architecture(family)
    assert err.value.field == "rollout.engine"
