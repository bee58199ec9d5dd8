"""MiniMax-H3 from a tiny modular-layout checkpoint against diffusers' MiniMaxH3ModularPipeline
(MiniMaxH3Blocks): the same initial video / audio noise and step count give the same latents of
both streams (fp32, <= 1e-4), decoded frames within one level and audio within 1e-4, for t2va
and for fl2va with a first, a last and both keyframes (the keyframes' presentation through the
Qwen3-VL conditioner equal to the pipeline's prompt_embeds), and for ref2va; the contract tasks
l2va and ref2va as requests through the encoder stage's conditioner and the embedded engine
(same figures), over HTTP (`media` by role) and through the TextEncoder stage; the two
schedules; the Qwen3-VL ETP plan sharded over 2 gloo ranks equal to the unsharded encoder;
typed bad input."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from adapters.minimax_h3 import KEYFRAME_ROWS, QWEN3_VL, MiniMaxH3Family
from contract import (ConfigError, GuidanceKind, InvalidRequestError, MediaFormatError,
                      MediaInput, MediaRole, Modality, RequestLimits, RolloutRequest, SamplerKind,
                      SamplingSpec, Task)
from diffusion.noise import initial_noise
from diffusion.step import Guidance, denoise_step
from tests.family_conformance import FamilyChecks

torch.set_num_threads(1)

SIZE = {"height": 32, "width": 64, "num_frames": 124}
STEPS, SEED = 3, 7
PROMPT = "a red ball bounces"
_gen = torch.Generator().manual_seed(5)
FIRST = torch.randint(0, 256, (3, 32, 64), generator=_gen, dtype=torch.uint8)
LAST = torch.randint(0, 256, (3, 32, 64), generator=_gen, dtype=torch.uint8)
KEYFRAMES = {MediaRole.FIRST_FRAME: FIRST, MediaRole.LAST_FRAME: LAST}


@pytest.fixture(scope="session")
def minimax_root(tiny_checkpoint) -> Path:
    """This session's copy of the tiny checkpoint (testing/tiny_minimax_h3.py, cached)."""
    return tiny_checkpoint("minimax_h3")


@pytest.fixture(scope="module")
def setup(minimax_root):
    from diffusers import MiniMaxH3Blocks

    from adapters.sample import LocalModels
    family = MiniMaxH3Family(minimax_root)
    models = LocalModels.load(family)
    processor = family.load("processor")
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(
        text_encoder=models.encoders[QWEN3_VL], transformer=models.transformers["transformer"],
        vae=models.decoders["video_latent"]["vae"],
        audio_vae=models.decoders["audio_latent"]["audio_vae"],
        tokenizer=family.load("tokenizer"), processor=processor,
        scheduler=family.load("scheduler"), audio_scheduler=family.load("audio_scheduler"))
    return family, models, processor, pipe


def sampling(**over) -> SamplingSpec:
    fields = {"num_steps": STEPS, "guidance_scale": 1.0, "seeds": (SEED,), **SIZE, **over}
    return SamplingSpec(sampler=SamplerKind.ODE, noise_level=0.0, **fields)


def run_ours(family, models, processor, media: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(initial state, final state) of one row through diffusion.step with the family's parts."""
    s = sampling()
    bundle = family.conditioner.tokenize([PROMPT])[0]
    cond = family.conditioner.encode(models.encoders, [bundle]) if not media else \
        family.conditioner.encode_presentation(models.encoders[QWEN3_VL], processor, bundle,
                                               list(media.values()))
    mc = family.codec.encode_media(models.media, s, media)
    sigmas = family.sigmas(s)
    x0 = initial_noise([SEED], family.codec.state_shape(s))
    x = x0
    for i in range(STEPS):
        x = denoise_step(family.denoiser, models.transformers, x, sigmas[i].expand(1),
                         sigmas[i + 1].expand(1), cond, Guidance.none(1), SamplerKind.ODE, 0.0,
                         media=mc.inputs).prev_sample
    return x0, x, cond


def run_pipeline(family, pipe, x0: torch.Tensor, media: dict, outputs):
    from PIL import Image
    layout = family.codec.layout(sampling())
    video, audio = layout.tokens(x0)
    kwargs = {}
    pil = lambda t: Image.fromarray(t.permute(1, 2, 0).contiguous().numpy())   # noqa: E731
    if MediaRole.FIRST_FRAME in media:
        kwargs["image"] = pil(media[MediaRole.FIRST_FRAME])
    if MediaRole.LAST_FRAME in media:
        kwargs["last_image"] = pil(media[MediaRole.LAST_FRAME])
    return pipe(prompt=PROMPT, num_inference_steps=STEPS + 1, latents=layout.unpack_video(video),
                audio_latents=audio[0].reshape(2, layout.audio, -1).permute(0, 2, 1),
                generator=torch.Generator().manual_seed(SEED), output_type="pt",
                output=list(outputs), **SIZE, **kwargs)


def pipeline_audio_rows(audio_latents: torch.Tensor) -> torch.Tensor:
    """The pipeline's (2, Ca, L) audio latents -> our channel-major rows (1, 2L, Ca)."""
    return audio_latents.permute(0, 2, 1).reshape(1, -1, audio_latents.shape[1])


ROLE_SETS = {"t2va": (), "first": (MediaRole.FIRST_FRAME,), "last": (MediaRole.LAST_FRAME,),
             "first_last": (MediaRole.FIRST_FRAME, MediaRole.LAST_FRAME)}


@pytest.mark.parametrize("case", list(ROLE_SETS))
def test_latents_and_media_equal_the_modular_pipeline(setup, case):
    family, models, processor, pipe = setup
    media = {r: KEYFRAMES[r] for r in ROLE_SETS[case]}
    x0, x, cond = run_ours(family, models, processor, media)
    decode = case in ("t2va", "first_last")
    out = run_pipeline(family, pipe, x0, media, ["latents", "audio_latents", "prompt_embeds"] +
                       (["videos", "audio"] if decode else []))
    ours = family.codec.split_state(x, sampling())
    assert torch.equal(cond["prompt_embeds"][:, :int(cond["text_length"][0])],
                       out["prompt_embeds"].float())
    video_diff = (ours["video_latent"] - out["latents"]).abs().max().item()
    audio_diff = (ours["audio_latent"] - pipeline_audio_rows(out["audio_latents"])).abs().max()
    assert video_diff <= 1e-4 and float(audio_diff) <= 1e-4, (video_diff, float(audio_diff))
    assert (ours["video_latent"] - x0.new_zeros(1)).abs().max() > 0.1      # it moved
    if decode:
        s = sampling()
        frames = family.codec.decode("video_latent", models.decoders["video_latent"],
                                     ours["video_latent"], s)
        want = (out["videos"] * 255).round().to(torch.uint8)
        assert frames.shape == want.shape == (1, 124, 3, 32, 64)
        assert (frames.int() - want.int()).abs().max() <= 1
        audio = family.codec.decode("audio_latent", models.decoders["audio_latent"],
                                    ours["audio_latent"], s)
        assert audio.shape == out["audio"].shape == (1, 2, 165600)
        assert (audio - out["audio"]).abs().max() <= 1e-4


def test_two_schedules_are_the_pipelines(setup):
    """The video table is the `scheduler`'s sigmas, the audio rows step down the
    `audio_scheduler`'s; both are what set_timesteps(steps + 1) builds."""
    family, _, _, pipe = setup
    s = sampling(num_steps=5)
    pipe.scheduler.set_timesteps(6)
    pipe.audio_scheduler.set_timesteps(6)
    assert torch.equal(family.sigmas(s), pipe.scheduler.sigmas.float())
    assert torch.equal(family.audio_sigmas(s), pipe.audio_scheduler.sigmas.float())
    assert not torch.equal(family.sigmas(s), family.audio_sigmas(s))
    # off the table the coupling is continuous: g(s) through the shared base grid
    video, audio = family.sigmas(s), family.audio_sigmas(s)
    sa, _ = family.schedules.audio_sigma(video[1:-1])
    assert torch.allclose(sa, audio[1:-1], atol=1e-6)


def test_state_artifacts_round_trip(setup):
    family = setup[0]
    s = sampling(seeds=(1, 2))
    x = initial_noise([1, 2], family.codec.state_shape(s))
    latents = family.codec.split_state(x, s)
    assert latents["video_latent"].shape == (2, 8, 37, 2, 4)
    assert latents["audio_latent"].shape == (2, 2 * 207, 8)
    assert torch.equal(family.codec.join_state(latents, s), x)


def test_spec_declares_no_guidance_and_two_decoders(setup):
    spec = setup[0].spec
    assert spec.guidance.kind is GuidanceKind.NONE
    assert spec.guidance.source.startswith("minimax_h3/denoise.py:")
    assert spec.decoders == {"video_latent": ("vae",), "audio_latent": ("audio_vae",)}
    rates = {a.name: a.sample_rate for a in spec.io_spec.artifacts}
    assert rates["audio"] == 32000


def request(family, media=(), **over) -> RolloutRequest:
    bundle = family.conditioner.tokenize([PROMPT])[0]
    task = Task.FL2VA if media else Task.T2VA
    return RolloutRequest(request_id="r1", task=task, prompt=bundle, sampling=sampling(**over),
                          media=tuple(MediaInput(Modality.IMAGE, role, data)
                                      for role, data in media))


@pytest.mark.parametrize("over, field", [
    ({"num_frames": 125}, "sampling.num_frames"),           # not 17 n + 5: nothing is rounded
    ({"num_frames": 107}, "sampling.num_frames"),           # under 5 s
    ({"height": 48}, "sampling.height"),                    # not a multiple of 32
    ({"width": 160}, "sampling.width"),                     # 5:1 is outside 1:4 .. 4:1
    ({"guidance_scale": 3.0}, "sampling.guidance_scale"),   # guidance-distilled
])
def test_bad_sizes_and_guidance_are_typed_errors(setup, over, field):
    family = setup[0]
    with pytest.raises(InvalidRequestError) as err:
        family.validate_request(request(family, **over), RequestLimits())
    assert err.value.field == field


@pytest.mark.parametrize("frame, field", [
    (torch.zeros(3, 64, 64, dtype=torch.uint8), "media.first_frame"),     # wrong size
    (torch.zeros(3, 32, 64, dtype=torch.float32), "media.first_frame"),   # wrong dtype
    (torch.zeros(4, 32, 64, dtype=torch.uint8), "media.first_frame"),     # wrong channels
])
def test_keyframes_of_another_size_are_refused_not_resized(setup, frame, field):
    family, models = setup[0], setup[1]
    with pytest.raises(MediaFormatError) as err:
        family.codec.encode_media(models.media, sampling(), {MediaRole.FIRST_FRAME: frame})
    assert err.value.field == field


def test_keyframe_roles_and_counts(setup):
    family, models = setup[0], setup[1]
    with pytest.raises(InvalidRequestError) as err:     # an edit's image is not a keyframe
        family.codec.encode_media(models.media, sampling(), {MediaRole.IMAGE: FIRST})
    assert err.value.field == "media"
    with pytest.raises(InvalidRequestError) as err:     # references are an ordered tuple
        family.codec.encode_media(models.media, sampling(), {MediaRole.REFERENCE: FIRST})
    assert err.value.field == "media.reference"
    with pytest.raises(InvalidRequestError) as err:     # and ride alone
        family.codec.encode_media(models.media, sampling(), {MediaRole.REFERENCE: (FIRST,),
                                                             MediaRole.LAST_FRAME: LAST})
    assert err.value.field == "media"
    mc = family.codec.encode_media(models.media, sampling(seeds=(1, 2)), dict(KEYFRAMES))
    rows = mc.inputs[KEYFRAME_ROWS]
    assert rows.shape == (2, 2 * 2, 8 * 4)        # per row seed: 2 keyframes x 2 rows each
    assert not torch.equal(rows[0], rows[1])      # each row's own noise draw
    served = family.validate_request(request(family, media=list(KEYFRAMES.items())),
                                     RequestLimits())
    assert set(served) == set(KEYFRAMES)                  # fl2va: both keyframes
    with pytest.raises(InvalidRequestError) as err:       # fl2va takes both; first alone is i2va
        family.validate_request(request(family, media=[(MediaRole.FIRST_FRAME, FIRST)]),
                                RequestLimits())
    assert err.value.field == "media"
    with pytest.raises(MediaFormatError) as err:          # a keyframe off the canvas: refused
        family.validate_request(request(family, media=[
            (MediaRole.FIRST_FRAME, FIRST), (MediaRole.LAST_FRAME, LAST[:, :, :32])]),
            RequestLimits())
    assert err.value.field == "media.last_frame"


def test_the_encoder_stage_encodes_keyframes_with_the_prompt(setup, minimax_root):
    """The TextEncoder stage (in process, etp 1) given a request's keyframes returns the FL2VA
    presentation the pipeline encodes (equal to the conditioner's), uncached; without them the
    text; media it does not read, or not one mapping per prompt, is a typed error."""
    import asyncio

    from deployments.encoder import TextEncoderServer
    family, models, processor = setup[0], setup[1], setup[2]
    server = TextEncoderServer("minimax_h3", str(minimax_root), etp=1,
                               prompt_cache_bytes=2 ** 20)
    bundles = family.conditioner.tokenize([PROMPT, "a small dog sings"])
    got = asyncio.run(server.encode(bundles, [dict(KEYFRAMES), {}]))
    first = family.conditioner.encode_presentation(models.encoders[QWEN3_VL], processor,
                                                   bundles[0], [FIRST, LAST])
    text = family.conditioner.encode(models.encoders, bundles[1:])
    n0, n1 = int(got["text_length"][0]), int(got["text_length"][1])
    assert torch.equal(got["prompt_embeds"][0], first["prompt_embeds"][0])   # padded alike
    assert torch.equal(got["text_tags"][0], first["text_tags"][0])
    assert torch.equal(got["prompt_embeds"][1], text["prompt_embeds"][0])
    assert n0 > n1 and (got["text_tags"][0, :n0] == 0).sum() > 0   # the vision blocks
    assert server.cache.stats()["entries"] == 0            # keyframe encodings are not cached
    plain = asyncio.run(server.encode(bundles[1:]))
    assert torch.equal(plain["prompt_embeds"], text["prompt_embeds"])
    for media, field in (([{MediaRole.REFERENCE: FIRST}, {}], "media[0]"),
                         ([{MediaRole.FIRST_FRAME: FIRST.float()}, {}], "media[0]"),
                         ([dict(KEYFRAMES)], "media")):
        with pytest.raises(InvalidRequestError) as err:
            asyncio.run(server.encode(bundles, media))
        assert err.value.field == field


# ---- ref2va: ordered image references, the transformer_ref partition ---------------------------

_rgen = torch.Generator().manual_seed(9)
REFERENCES = [torch.randint(0, 256, (3, 32, 64), generator=_rgen, dtype=torch.uint8),
              torch.randint(0, 256, (3, 64, 32), generator=_rgen, dtype=torch.uint8)]


def run_ref2va(family, models, processor, transformer_ref, references):
    s = sampling()
    bundle = family.conditioner.tokenize([PROMPT])[0]
    cond = family.conditioner.encode_presentation(models.encoders[QWEN3_VL], processor, bundle,
                                                  references)
    mc = family.codec.encode_references(models.media, s, references, 32)
    sigmas = family.sigmas(s)
    x0 = initial_noise([SEED], family.codec.state_shape(s))
    x = x0
    for i in range(STEPS):
        x = denoise_step(family.denoiser, {"transformer_ref": transformer_ref}, x,
                         sigmas[i].expand(1), sigmas[i + 1].expand(1), cond, Guidance.none(1),
                         SamplerKind.ODE, 0.0, media=mc.inputs).prev_sample
    return x0, x, cond


def test_ref2va_equals_the_modular_pipeline_and_order_matters(setup):
    """Two references of different shapes, at the short edge the pipeline is configured to
    encode them at (reference_image_short_edge 32 here, 2048 released): embeddings, latents of
    both streams; swapping them is another request."""
    from PIL import Image
    from diffusers.modular_pipelines.minimax_h3.references import MiniMaxH3ImageReference
    family, models, processor, pipe = setup
    transformer_ref = family.load("transformer_ref")
    x0, x, cond = run_ref2va(family, models, processor, transformer_ref, REFERENCES)
    layout = family.codec.layout(sampling())
    video, audio = layout.tokens(x0)
    pipe.update_components(transformer_ref=transformer_ref)
    pipe.register_to_config(reference_image_short_edge=32)
    pil = lambda t: Image.fromarray(t.permute(1, 2, 0).contiguous().numpy())   # noqa: E731
    out = pipe(prompt=PROMPT, references=[MiniMaxH3ImageReference(image=pil(r))
                                          for r in REFERENCES],
               num_inference_steps=STEPS + 1, latents=layout.unpack_video(video),
               audio_latents=audio[0].reshape(2, layout.audio, -1).permute(0, 2, 1),
               generator=torch.Generator().manual_seed(SEED), output_type="pt",
               output=["latents", "audio_latents", "prompt_embeds"], **SIZE)
    ours = family.codec.split_state(x, sampling())
    assert torch.equal(cond["prompt_embeds"][:, :int(cond["text_length"][0])],
                       out["prompt_embeds"].float())
    video_diff = (ours["video_latent"] - out["latents"]).abs().max().item()
    audio_diff = (ours["audio_latent"] - pipeline_audio_rows(out["audio_latents"])).abs().max()
    assert video_diff <= 1e-4 and float(audio_diff) <= 1e-4, (video_diff, float(audio_diff))
    _, swapped, _ = run_ref2va(family, models, processor, transformer_ref, REFERENCES[::-1])
    assert (swapped - x).abs().max() > 1e-3


@pytest.mark.parametrize("references, error, field", [
    ([torch.zeros(3, 48, 64, dtype=torch.uint8)], MediaFormatError, "media.reference[0]"),
    ([REFERENCES[0], torch.zeros(3, 32, 40, dtype=torch.uint8)], MediaFormatError,
     "media.reference[1]"),                                 # not a multiple of 32
    ([torch.zeros(3, 32, 160, dtype=torch.uint8)], MediaFormatError, "media.reference[0]"),
    ([REFERENCES[0].float()], MediaFormatError, "media.reference[0]"),
    ([], InvalidRequestError, "media.reference"),
    ([REFERENCES[0]] * 10, InvalidRequestError, "media.reference"),
])
def test_references_of_another_size_or_count_are_refused(setup, references, error, field):
    family, models = setup[0], setup[1]
    with pytest.raises(error) as err:
        family.codec.encode_references(models.media, sampling(), references, 32)
    assert err.value.field == field


def test_a_keyframe_row_without_its_presentation_is_refused(setup):
    """Keyframe rows with a text-only condition (the vision blocks missing) never run."""
    family, models = setup[0], setup[1]
    s = sampling()
    cond = family.conditioner.encode(models.encoders, family.conditioner.tokenize([PROMPT]))
    mc = family.codec.encode_media(models.media, s, {MediaRole.FIRST_FRAME: FIRST})
    x = initial_noise([SEED], family.codec.state_shape(s))
    with pytest.raises(InvalidRequestError) as err:
        denoise_step(family.denoiser, models.transformers, x, family.sigmas(s)[:1],
                     family.sigmas(s)[1:2], cond, Guidance.none(1), SamplerKind.ODE, 0.0,
                     media=mc.inputs)
    assert err.value.field == "cond.text_tags"


# ---- ETP: the Qwen3-VL conditioner split over 2 gloo ranks ------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _etp_rank(rank: int, world: int, port: int, root: str, out: str) -> None:
    import torch.distributed as dist

    from deployments.etp import shard_encoder
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        family = MiniMaxH3Family(root)
        encoder = family.load_encoders()[QWEN3_VL]
        sharded = shard_encoder(encoder, family.spec.encoder(QWEN3_VL).etp, world, "cpu")
        bundles = family.conditioner.tokenize([PROMPT, "a small dog sings"])
        text = family.conditioner.encode({QWEN3_VL: sharded}, bundles)
        shown = family.conditioner.encode_presentation(sharded, family.load("processor"),
                                                       bundles[0], [FIRST, LAST])
        refs = family.conditioner.encode_with_media(      # ref2va's ordered references
            {QWEN3_VL: sharded}, bundles[:1], [{MediaRole.REFERENCE: tuple(REFERENCES)}])
        q = sharded.get_submodule("model.language_model.layers.0.self_attn.q_proj").weight
        if rank == 0:
            torch.save({"text": dict(text.tensors), "shown": dict(shown.tensors),
                        "refs": dict(refs.tensors),
                        "q_rows": q.to_local().shape[0] if hasattr(q, "to_local")
                        else q.shape[0]}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.integration          # two spawned ranks (about a minute on the 2-core machine)
def test_qwen3_vl_etp2_equals_unsharded(setup, minimax_root, tmp_path):
    import torch.multiprocessing as mp
    family, models, processor, _ = setup
    out = tmp_path / "rank0.pt"
    mp.start_processes(_etp_rank, args=(2, _free_port(), str(minimax_root), str(out)),
                       nprocs=2, join=True, start_method="spawn")
    got = torch.load(out)
    bundles = family.conditioner.tokenize([PROMPT, "a small dog sings"])
    text = family.conditioner.encode(models.encoders, bundles)
    shown = family.conditioner.encode_presentation(models.encoders[QWEN3_VL], processor,
                                                   bundles[0], [FIRST, LAST])
    refs = family.conditioner.encode_presentation(models.encoders[QWEN3_VL], processor,
                                                  bundles[0], REFERENCES)
    assert got["q_rows"] == 8 * 8 // 2                 # each rank holds half the query heads
    for ref, name in ((text, "text"), (shown, "shown"), (refs, "refs")):
        for key, value in ref.tensors.items():
            assert torch.allclose(got[name][key].float(), value.float(), atol=1e-5), key


def test_qwen3_vl_etp_plan_checks_heads(setup):
    from deployments.etp import check_family_etp, tp_plan
    family, models = setup[0], setup[1]
    plan = family.spec.encoder(QWEN3_VL).etp
    names = tp_plan(models.encoders[QWEN3_VL], plan, 2)
    assert len(names) == 1 + 51 * 7                     # embedding + 7 linears per layer
    assert check_family_etp(family, 2) == 2 and check_family_etp(family, 4) == 4
    with pytest.raises(ConfigError) as err:             # 4 key/value heads: 3 does not divide
        check_family_etp(family, 3)
    assert err.value.field == "etp" and err.value.actual == 3
    assert err.value.expected == [1, 2, 4]


# ---- the tiny twin of configs/train_minimax_h3_gpu.yaml trains in process ---------------------

TINY_RECIPE, GPU_RECIPE = "configs/train_minimax_h3_tiny.yaml", "configs/train_minimax_h3_gpu.yaml"


def test_tiny_recipe_trains_two_nft_steps_through_the_engine_and_learner(setup, minimax_root):
    """configs/train_minimax_h3_tiny.yaml's settings: rollouts from the embedded engine with the
    learner's published LoRA, a reward of the rollouts' own latents, two DiffusionNFT steps that
    move the adapter (finite loss), the second sampled with the first step's version."""
    import asyncio
    import copy

    from rollout.engine import EmbeddedEngine
    from rollout.engine_api import EngineRequest
    from tests.test_trainer_local import _outputs
    from trainer.config import PromptSource, load_trainer_config
    from trainer.learner import Learner
    from trainer.prompts import captions, make_requests
    from trainer.rollout_batch import build_batch
    from trainer.updates import UPDATES

    family, models = setup[0], setup[1]
    # t2va in process: an in-process learner re-encodes text only (a keyframe row refuses that);
    # fl2va trains through the graph, whose encoder stage shows the keyframes to the conditioner
    cfg = load_trainer_config(TINY_RECIPE, {"graph.rollout.weights_path": str(minimax_root),
                                            "task": "t2va"})
    engine = EmbeddedEngine(family, copy.deepcopy(models.transformers), models.media)
    learner = Learner(family, copy.deepcopy(models.transformers), models.encoders, cfg.lora,
                      cfg.optimizer)
    latents = ("video_latent", "audio_latent")
    start = [p.detach().clone() for p in learner.params]
    try:
        for step in range(2):
            version = f"mm-v{step}"
            tensors, scale = learner.export()
            engine.load_lora(version, tensors, scale)
            prompts = family.conditioner.tokenize(
                captions(PromptSource.CLIPS, cfg.prompts_per_step, step))
            requests = make_requests(family, prompts, cfg.sampler, cfg.samples_per_prompt, step,
                                     version, task=cfg.task)

            async def go():
                return [await engine.generate(EngineRequest(r, learner.encode([p]), None,
                                                            latents, {}, version))
                        for r, p in zip(requests, prompts)]
            results = asyncio.run(go())
            # reward: how close each sample's audio latent is to silence (a real function of it)
            rewards = [(-e.latents["audio_latent"].data.abs().mean(dim=(1, 2))).tolist()
                       for e in results]
            batch = build_batch(learner, prompts, _outputs(requests, results, rewards),
                                [r.sampling for r in requests])
            metrics = UPDATES[cfg.algorithm](learner, batch, cfg,
                                             torch.Generator().manual_seed(step))
            assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    finally:
        asyncio.run(engine.shutdown())
    moved = max((p.detach() - s).abs().max().item() for p, s in zip(learner.params, start))
    assert moved > 0


def test_gpu_recipe_validates_with_the_reports_settings(minimax_root):
    """8 GPUs, the conditioner at ETP 4 (checked against a checkpoint of the same layout), NFT
    on FL2VA at 288 x 448, and the tiny twin is the same recipe in what it trains."""
    from deployments.etp import check_family_etp
    from trainer.config import load_trainer_config
    path = {"graph.rollout.weights_path": str(minimax_root)}
    gpu = load_trainer_config(GPU_RECIPE, path)
    tiny = load_trainer_config(TINY_RECIPE, path)
    graph = gpu.graph_config()
    assert gpu.task is Task.FL2VA and gpu.algorithm.value == "nft"
    assert (gpu.sampler.height, gpu.sampler.width) == (288, 448)
    assert graph.encoder.etp == 4 and graph.encoder.num_gpus_per_shard > 0
    # devices: one per ETP shard (nccl ranks cannot share one), per rollout replica (more than
    # half a GPU each, so two never share one), per learner worker; the two decoders fit beside
    # the rollout replicas
    assert graph.encoder.num_gpus_per_shard == 1 and graph.rollout_stage.num_gpus > 0.5
    replicas = graph.rollout_stage.autoscaling.max_replicas
    devices = (graph.encoder.etp + replicas
               + gpu.learner.workers * gpu.learner.resources_per_worker["GPU"])
    assert devices == 8
    assert 2 * graph.decoder.num_gpus <= replicas * (1 - graph.rollout_stage.num_gpus)
    assert check_family_etp(MiniMaxH3Family(minimax_root), graph.encoder.etp) == 4
    for key in ("algorithm", "sampler.sampler", "sampler.guidance_scale", "nft.beta",
                "optimizer.lr", "learner.gradient_checkpointing"):
        section, _, name = key.partition(".")
        a, b = getattr(gpu, section), getattr(tiny, section)
        assert (getattr(a, name) if name else a) == (getattr(b, name) if name else b), key


class TestMiniMaxH3Checks(FamilyChecks):
    """What every family passes: LoRA targets, the LoRA file through diffusers' loader, engine
    vs learner SDE log-probs (t2va; the audio rows' noise follows the video table's std)."""
    family = "minimax_h3"
    size = SIZE
    steps = 3

    @pytest.fixture(scope="class")
    def root(self, minimax_root):
        return minimax_root


def test_tiny_fl2va_recipe_trains_through_the_cli(ray_cluster, minimax_root, tmp_path):
    """configs/train_minimax_h3_tiny.yaml as a user runs it against the tiny graph: FL2VA with
    keyframes from its prompt files, two DiffusionNFT steps, AV-sync rewards."""
    import json

    from ray import serve

    from graph import build_app, delete_graph
    from trainer.__main__ import main, parse_overrides
    from trainer.config import load_trainer_config
    sets = [f"graph.rollout.weights_path={minimax_root}", "steps=2", f"run_dir={tmp_path}",
            "eval.every=2", "checkpoint_every=2", "gallery=false"]
    graph = load_trainer_config(TINY_RECIPE, parse_overrides(sets)).graph_config()
    serve.run(build_app(graph), name=graph.app_name, route_prefix=None)
    try:
        main(["--config", TINY_RECIPE, *[a for item in sets for a in ("--set", item)]])
    finally:
        delete_graph(graph)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train_s" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["rows"] == 4 for r in steps)


# ---- the contract tasks: l2va (last keyframe only) and ref2va (ordered references) ------------

@pytest.fixture(scope="module")
def ref_family(minimax_root):
    """The family serving ref2va (option `ref2va`: transformer_ref beside transformer), with the
    pipeline configured to encode references at a short edge of 32 as the parity test does."""
    return MiniMaxH3Family(minimax_root, {"ref2va": True, "reference_image_short_edge": 32})


def contract_request(family, task: Task, media, seeds=(SEED,)) -> RolloutRequest:
    bundle = family.conditioner.tokenize([PROMPT])[0]
    return RolloutRequest(request_id="c1", task=task, prompt=bundle,
                          sampling=sampling(seeds=seeds),
                          media=tuple(MediaInput(Modality.IMAGE, role, data)
                                      for role, data in media))


def test_l2va_and_ref2va_are_contract_tasks_with_typed_media_errors(setup, ref_family,
                                                                    minimax_root, tmp_path):
    """Each task takes exactly its roles; references keep the request's order; a count, size,
    modality or mix the task does not take, or a keyframe missing, is a typed error naming the
    field and value, raised by validate_request (no weights involved)."""
    from contract import ConfigError, Task as T
    family = setup[0]
    limits = RequestLimits()
    assert T.L2VA in family.spec.tasks and T.REF2VA not in family.spec.tasks
    assert family.spec.transformers == ("transformer",)
    got = family.validate_request(contract_request(family, T.L2VA,
                                                   [(MediaRole.LAST_FRAME, LAST)]), limits)
    assert list(got) == [MediaRole.LAST_FRAME] and torch.equal(got[MediaRole.LAST_FRAME], LAST)
    for task, media, field in (
            (T.L2VA, [(MediaRole.FIRST_FRAME, FIRST)], "media"),         # the wrong keyframe
            (T.FL2VA, [(MediaRole.LAST_FRAME, LAST)], "media"),          # the first one missing
            (T.REF2VA, [(MediaRole.REFERENCE, REFERENCES[0])], "task")):  # not served by default
        with pytest.raises(InvalidRequestError) as err:
            family.validate_request(contract_request(family, task, media), limits)
        assert err.value.field == field, (task, err.value)
    assert ref_family.spec.transformers == ("transformer", "transformer_ref")
    assert set(ref_family.spec.lora_targets) == {"transformer", "transformer_ref"}
    refs = [(MediaRole.REFERENCE, r) for r in REFERENCES]
    for order in (refs, refs[::-1]):
        got = ref_family.validate_request(contract_request(ref_family, T.REF2VA, order), limits)
        assert list(got) == [MediaRole.REFERENCE] and len(got[MediaRole.REFERENCE]) == 2
        assert all(torch.equal(a, b) for a, (_, b) in zip(got[MediaRole.REFERENCE], order))
    bad = torch.zeros(3, 32, 40, dtype=torch.uint8)
    for media, error, field, actual in (
            (refs * 5, InvalidRequestError, "media.reference", 10),             # > 9
            ([refs[0], (MediaRole.REFERENCE, bad)], MediaFormatError, "media.reference[1]",
             (32, 40)),                                                            # off-size
            ([refs[0], (MediaRole.FIRST_FRAME, FIRST)], InvalidRequestError, "media",
             ["first_frame", "reference"]),                                        # a mix
            ([], InvalidRequestError, "media", [])):                               # none
        with pytest.raises(error) as err:
            ref_family.validate_request(contract_request(ref_family, T.REF2VA, media), limits)
        assert err.value.field == field and err.value.actual == actual, err.value
    video_ref = RolloutRequest(request_id="c2", task=T.REF2VA, sampling=sampling(),
                               prompt=family.conditioner.tokenize([PROMPT])[0],
                               media=(MediaInput(Modality.VIDEO, MediaRole.REFERENCE,
                                                 torch.zeros(2, 3, 32, 32, dtype=torch.uint8)),))
    with pytest.raises(MediaFormatError) as err:
        ref_family.validate_request(video_ref, limits)
    assert err.value.field == "media[0].modality" and err.value.actual == "video"
    partial = tmp_path / "no_ref"                       # a checkpoint without transformer_ref
    partial.mkdir()
    for item in minimax_root.iterdir():
        if item.name != "transformer_ref":
            (partial / item.name).symlink_to(item)
    with pytest.raises(ConfigError) as err:
        MiniMaxH3Family(partial, {"ref2va": True})
    assert err.value.field == "adapter_options.ref2va"


def engine_rollout(family, models, request):
    """A contract request as the graph runs it, in process: validate_request, the encoder
    stage's encode_with_media (the condition media the conditioner reads), the embedded engine."""
    import asyncio

    from rollout.engine import EmbeddedEngine
    from rollout.engine_api import EngineRequest
    from rollout.lora import BASE_VERSION
    media = family.validate_request(request, RequestLimits())
    picked = {r: v for r, v in media.items() if r in family.conditioner.media_roles}
    cond = family.conditioner.encode_with_media(models.encoders, [request.prompt], [picked])
    engine = EmbeddedEngine(family, models.transformers, models.media)
    try:
        out = asyncio.run(engine.generate(EngineRequest(
            request, cond, None, ("video_latent", "audio_latent"), media, BASE_VERSION)))
    finally:
        asyncio.run(engine.shutdown())
    return cond, {k: v.data for k, v in out.latents.items()}


@pytest.mark.parametrize("task", ["l2va", "ref2va"])
def test_contract_task_rollouts_equal_the_modular_pipeline(setup, ref_family, task):
    """l2va (the last keyframe alone) and ref2va (two ordered references of different shapes)
    as contract requests through the encoder stage's conditioner and the embedded engine: the
    same initial latents and sigmas give the pipeline's video and audio latents (fp32 <= 1e-4)."""
    from PIL import Image
    from diffusers.modular_pipelines.minimax_h3.references import MiniMaxH3ImageReference

    from adapters.sample import LocalModels
    _, models, _, pipe = setup
    pil = lambda t: Image.fromarray(t.permute(1, 2, 0).contiguous().numpy())   # noqa: E731
    if task == "l2va":
        family, kwargs = setup[0], {"last_image": pil(LAST)}
        request = contract_request(family, Task.L2VA, [(MediaRole.LAST_FRAME, LAST)])
    else:
        family = ref_family
        models = LocalModels(dict(models.transformers, transformer_ref=family.load(
            "transformer_ref")), models.encoders, models.media, models.decoders)
        pipe.update_components(transformer_ref=models.transformers["transformer_ref"])
        pipe.register_to_config(reference_image_short_edge=32)
        kwargs = {"references": [MiniMaxH3ImageReference(image=pil(r)) for r in REFERENCES]}
        request = contract_request(family, Task.REF2VA,
                                   [(MediaRole.REFERENCE, r) for r in REFERENCES])
    cond, ours = engine_rollout(family, models, request)
    layout = family.codec.layout(sampling())
    video, audio = layout.tokens(initial_noise([SEED], family.codec.state_shape(sampling())))
    out = pipe(prompt=PROMPT, num_inference_steps=STEPS + 1, latents=layout.unpack_video(video),
               audio_latents=audio[0].reshape(2, layout.audio, -1).permute(0, 2, 1),
               generator=torch.Generator().manual_seed(SEED), output_type="pt",
               output=["latents", "audio_latents", "prompt_embeds"], **SIZE, **kwargs)
    assert torch.equal(cond["prompt_embeds"][:, :int(cond["text_length"][0])],
                       out["prompt_embeds"].float())
    video_diff = (ours["video_latent"] - out["latents"]).abs().max().item()
    audio_diff = (ours["audio_latent"] - pipeline_audio_rows(out["audio_latents"])).abs().max()
    print(f"{task}: video {video_diff:.3g} audio {float(audio_diff):.3g}")
    assert video_diff <= 1e-4 and float(audio_diff) <= 1e-4, (video_diff, float(audio_diff))
    assert (ours["video_latent"] - layout.unpack_video(video)).abs().max() > 0.1   # it moved


def test_the_encoder_stage_shows_ordered_references(setup, ref_family, minimax_root):
    """The TextEncoder stage given ref2va's references (a tuple, request order) returns the
    pipeline's ref2va presentation (the conditioner's, which the parity test compares); a bare
    tensor or an empty tuple for the ordered role is a typed error naming media[i]."""
    import asyncio

    from deployments.encoder import TextEncoderServer
    family, models, processor = setup[0], setup[1], setup[2]
    server = TextEncoderServer("minimax_h3", str(minimax_root), etp=1,
                               options={"ref2va": True, "reference_image_short_edge": 32})
    bundles = family.conditioner.tokenize([PROMPT])
    got = asyncio.run(server.encode(bundles, [{MediaRole.REFERENCE: tuple(REFERENCES)}]))
    want = family.conditioner.encode_presentation(models.encoders[QWEN3_VL], processor,
                                                  bundles[0], REFERENCES)
    assert torch.equal(got["prompt_embeds"], want["prompt_embeds"])
    assert torch.equal(got["text_tags"], want["text_tags"])
    swapped = asyncio.run(server.encode(bundles, [{MediaRole.REFERENCE: tuple(REFERENCES[::-1])}]))
    assert not torch.equal(swapped["prompt_embeds"], got["prompt_embeds"])
    for value in (REFERENCES[0], ()):
        with pytest.raises(InvalidRequestError) as err:
            asyncio.run(server.encode(bundles, [{MediaRole.REFERENCE: value}]))
        assert err.value.field == "media[0]"


def _b64_png(image: torch.Tensor) -> str:
    import base64
    import io

    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_keyframes_and_references_over_http_reach_the_request_in_order(ref_family):
    """POST /rollout's `media` (one object per prompt, by role) becomes the request's media:
    l2va's last keyframe, fl2va's two, ref2va's references in the body's order, decoded
    losslessly; a role the task does not take, a keyframe missing, `images` instead, or an
    undecodable reference is a typed error naming the field, before any stage."""
    from types import SimpleNamespace

    from contract import LimitExceededError, MediaFormatError as MFE
    from contract.http import parse_rollout_body
    from deployments.http import HTTPFront
    import json
    limits = RequestLimits(max_height=64, max_width=64, max_frames=124)
    front = SimpleNamespace(family=ref_family, config=SimpleNamespace(limits=limits))
    front._http_role_media = HTTPFront._http_role_media.__get__(front)
    front._http_media = HTTPFront._http_media.__get__(front)

    def requests(body):
        payload = parse_rollout_body(json.dumps({"prompts": [PROMPT], "num_steps": 3, **SIZE,
                                                 **body}).encode(), limits)
        return HTTPFront._from_http(front, payload)

    first, last = _b64_png(FIRST), _b64_png(LAST)
    refs = [_b64_png(r) for r in REFERENCES]
    [req] = requests({"task": "l2va", "media": [{"last_frame": last}]})
    assert [(m.role, torch.equal(m.data, LAST)) for m in req.media] == \
        [(MediaRole.LAST_FRAME, True)]
    [req] = requests({"task": "fl2va", "media": [{"first_frame": first, "last_frame": last}]})
    assert {m.role for m in req.media} == {MediaRole.FIRST_FRAME, MediaRole.LAST_FRAME}
    [req] = requests({"task": "ref2va", "media": [{"reference": refs[::-1]}]})
    assert [m.role for m in req.media] == [MediaRole.REFERENCE] * 2
    assert all(torch.equal(m.data, r) for m, r in zip(req.media, REFERENCES[::-1]))
    media = ref_family.validate_request(req, limits)[MediaRole.REFERENCE]
    assert torch.equal(media[0], REFERENCES[1]) and torch.equal(media[1], REFERENCES[0])
    for body, error, field in (
            ({"task": "fl2va", "media": [{"first_frame": first}]}, InvalidRequestError,
             "media[0]"),                                           # the last keyframe missing
            ({"task": "l2va", "media": [{"first_frame": first}]}, InvalidRequestError,
             "media[0]"),
            ({"task": "ref2va"}, InvalidRequestError, "media"),
            ({"task": "ref2va", "images": [refs[0]], "media": [{"reference": refs}]},
             InvalidRequestError, "images"),
            ({"task": "t2va", "media": [{"reference": refs}]}, InvalidRequestError, "media"),
            ({"task": "ref2va", "media": [{"reference": [refs[0], "not base64!"]}]}, MFE,
             "media[0].reference[1]"),
            ({"task": "ref2va", "media": [{"reference": [_b64_png(torch.zeros(
                3, 32, 96, dtype=torch.uint8))]}]}, LimitExceededError,
             "media[0].reference[0]")):                            # wider than max_width
        with pytest.raises(error) as err:
            requests(body)
        assert err.value.field == field, (body, err.value)
