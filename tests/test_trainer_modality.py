"""Per-modality advantages (trainer/algorithms/modality.py, `advantage.streams`): closed forms of
the stream rewards and advantages, and one in-process DiffusionNFT step on tiny_t2va through the
real embedded engine and learner (no Ray).

The step's check is a derivation: with the old policy equal to the current one and no reference
KL, a stream whose advantage is 0 (optimality 1/2) contributes no gradient to NFT's policy loss
(its positive and negative branches cancel), so a step whose audio reward is flat within every
group equals share_video x the step that trains the video entries alone, and vice versa; the
two differ (the streams' entries are really separated)."""
from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from adapters.tiny_t2va import TinyT2VAFamily
from contract import (Algorithm, ConfigError, NonFiniteError, RewardReport, RolloutOutput,
                      SamplerKind)
from rollout.engine import EmbeddedEngine
from rollout.engine_api import EngineRequest
from tests.test_trainer_local import _grads_of
from trainer.algorithms.modality import stream_advantages, stream_masks, stream_rewards
from trainer.config import PromptSource, SamplerSettings, TrainerConfig, load_trainer_config
from trainer.learner import Learner
from trainer.prompts import captions, make_requests
from trainer.rollout_batch import build_batch
from trainer.updates import UPDATES


def test_stream_rewards_and_advantages_closed_forms():
    values = {"v": torch.tensor([1.0, 2.0, 3.0, 5.0]), "a": torch.tensor([0.0, 4.0, 0.0, 0.0]),
              "av": torch.tensor([1.0, float("nan"), 3.0, 1.0])}
    weights = {"v": 1.0, "a": 2.0, "av": 1.0}
    r = stream_rewards(values, weights, {"video": ["v", "av"], "audio": ["a", "av"]})
    torch.testing.assert_close(r["video"], torch.tensor([1.0, 2.0, 3.0, 3.0], dtype=torch.float64))
    torch.testing.assert_close(r["audio"], torch.tensor([1 / 3, 4.0, 1.0, 1 / 3],
                                                        dtype=torch.float64))
    adv = stream_advantages(values, weights, {"video": ["v"], "audio": ["a"]}, [0, 0, 1, 1],
                            global_std=False)
    torch.testing.assert_close(adv["video"], torch.tensor([-1.0, 1.0, -1.0, 1.0]), rtol=0,
                               atol=1e-3)
    torch.testing.assert_close(adv["audio"][2:], torch.zeros(2))       # a flat group: 0
    for streams, field in [({"video": ["x"]}, "streams.video"), ({"video": []}, "streams.video"),
                           ({}, "streams")]:
        with pytest.raises(ConfigError) as e:
            stream_rewards(values, weights, streams)
        assert e.value.field == field
    with pytest.raises(NonFiniteError):
        stream_rewards({"av": values["av"]}, weights, {"video": ["av"]})
    masks = stream_masks({"a": torch.tensor([[0.0, 1.0]]), "b": torch.tensor([[2.0]])}, (4,),
                         ["a", "b"])
    assert masks["a"].tolist() == [True, True, False, False] and int(masks["b"].sum()) == 1
    with pytest.raises(ConfigError):
        stream_masks({"a": torch.tensor([0.0])}, (4,), ["c"])


def test_streams_are_a_validated_nft_option():
    cfg = load_trainer_config({"advantage": {"streams": {"video_latent": ["v"]}}})
    assert cfg.advantage.streams == {"video_latent": ["v"]}
    for extra in ({"algorithm": "flow_grpo"}, {"advantage": {"per_reward": True}},
                  {"advantage": {"zero_advantage": "rows"}}):
        data = {"advantage": {"streams": {"video_latent": ["v"]}}}
        for k, v in extra.items():
            data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) else v
        with pytest.raises(ConfigError) as e:
            load_trainer_config(data)
        assert "advantage.streams" in str(e.value)


def _batch(adapter, engine, learner, settings, video, audio):
    tensors, scale = learner.export()
    engine.load_lora("mod-v0", tensors, scale)
    prompts = adapter.conditioner.tokenize(captions(PromptSource.CLIPS, 2, 3))
    requests = make_requests(adapter, prompts, settings, 4, 0, "mod-v0")

    async def go():
        return [await engine.generate(EngineRequest(r, learner.encode([p]), None,
                                                    ("video_latent", "audio_latent"), {},
                                                    "mod-v0"))
                for r, p in zip(requests, prompts)]
    results = asyncio.run(go())
    outputs = []
    for i, (r, e) in enumerate(zip(requests, results)):
        v, a = video[4 * i:4 * i + 4], audio[4 * i:4 * i + 4]
        report = RewardReport({}, tuple(x + y for x, y in zip(v, a)), {"v": 1.0, "a": 1.0},
                              {"v": tuple(v), "a": tuple(a)})
        outputs.append(RolloutOutput(r.request_id, dict(e.latents), e.trajectory,
                                     e.policy_version, r.sampling.seeds, rewards=report))
    return build_batch(learner, prompts, outputs, [r.sampling for r in requests])


def test_per_modality_nft_step_on_tiny_t2va_trains_each_stream_with_its_own_advantage():
    torch.set_num_threads(1)
    adapter = TinyT2VAFamily()
    transformers = adapter.load_transformers()
    engine = EmbeddedEngine(adapter, copy.deepcopy(transformers), {})
    settings = SamplerSettings(sampler=SamplerKind.ODE, num_steps=3)
    base = TrainerConfig(samples_per_prompt=4, prompts_per_step=2, sampler=settings)
    learner = Learner(adapter, transformers, adapter.load_encoders(), base.lora, base.optimizer)
    try:
        with torch.no_grad():
            for p in learner.params:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.05)
        learner.refresh_old(0.0)                 # old = current: flat streams give no gradient
        varied, flat = [0.1, 0.9, 0.3, 0.5, 0.7, 0.2, 0.4, 0.8], [0.5] * 4 + [0.2] * 4
        cfg = lambda streams: TrainerConfig(  # noqa: E731
            samples_per_prompt=4, prompts_per_step=2, sampler=settings,
            nft={"train_timesteps": 2, "ref_kl_coef": 0.0}, advantage={"streams": streams})
        both = {"video_latent": ["v"], "audio_latent": ["a"]}
        update = UPDATES[Algorithm.NFT]
        vid_batch = _batch(adapter, engine, learner, settings, varied, flat)
        state = vid_batch.x0.shape[1:]
        index = torch.arange(vid_batch.x0[0].numel(), dtype=torch.float64).reshape(1, *state)
        masks = stream_masks(adapter.codec.split_state(index, vid_batch.sampling), state,
                             list(both))
        total = sum(int(m.sum()) for m in masks.values())
        share = {k: int(m.sum()) / total for k, m in masks.items()}
        assert 0 < share["audio_latent"] < 1
        g_both, m = _grads_of(update, learner, vid_batch, cfg(both))
        g_video, _ = _grads_of(update, learner, vid_batch, cfg({"video_latent": ["v"]}))
        assert m["adv_abs_mean_audio_latent"] == 0.0 and m["adv_abs_mean_video_latent"] > 0.5
        assert max(float(g.abs().max()) for g in g_video) > 0
        for gb, gv in zip(g_both, g_video):
            torch.testing.assert_close(gb, share["video_latent"] * gv, rtol=1e-4,
                                       atol=1e-6 * float(gv.abs().max()) + 1e-12)
        aud_batch = _batch(adapter, engine, learner, settings, flat, varied)
        a_both, _ = _grads_of(update, learner, aud_batch, cfg(both))
        a_audio, _ = _grads_of(update, learner, aud_batch, cfg({"audio_latent": ["a"]}))
        for gb, ga in zip(a_both, a_audio):
            torch.testing.assert_close(gb, share["audio_latent"] * ga, rtol=1e-4,
                                       atol=1e-6 * float(ga.abs().max()) + 1e-12)
        assert any(not torch.allclose(a / share["audio_latent"], v / share["video_latent"])
                   for a, v in zip(a_both, g_both))
        before = [p.detach().clone() for p in learner.params]
        metrics = update(learner, vid_batch, cfg(both), torch.Generator().manual_seed(0))
        assert metrics["grad_norm"] > 0
        assert any(not torch.equal(a, b) for a, b in zip(before, learner.params))
    finally:
        asyncio.run(engine.shutdown())


def test_ltx2_streams_partition_its_joint_state(tiny_checkpoint):
    """On LTX-2's packed audio-video state (tiny checkpoint) the stream masks from its codec's
    split cover every entry once: video tokens and audio tokens, disjoint."""
    from adapters.registry import get_family
    from contract import SamplingSpec
    family = get_family("ltx2", tiny_checkpoint("ltx2"), {"max_sequence_length": 16,
                                                          "frame_rate": 25.0, "image_crf": 0})
    sampling = SamplingSpec(seeds=(0,), height=64, width=96, num_frames=9)
    state = family.codec.state_shape(sampling)
    numel = int(torch.tensor(state).prod())
    parts = family.codec.split_state(torch.arange(numel, dtype=torch.float64).reshape(1, *state),
                                     sampling)
    masks = stream_masks(parts, state, ["video_latent", "audio_latent"])
    video, audio = masks["video_latent"], masks["audio_latent"]
    assert int(video.sum()) == parts["video_latent"].numel() > 0
    assert int(audio.sum()) == parts["audio_latent"].numel() > 0
    assert not bool((video & audio).any()) and bool((video | audio).all())
