"""LTX-2 from the tiny real-layout checkpoint against LTX2Pipeline (tests/family_conformance.py:
sigmas, ODE latents of both streams, decoded frames and audio, token ids, per-stage components,
typed bad input), then what is particular to LTX-2: the image-to-video+audio and first/last-frame
paths against LTX2ImageToVideoPipeline / LTX2ConditionPipeline, the guidance settings the project
refuses, the audio sample rate declared and checked, the time-convention check.

Pipeline calls use the plain guidance path (stg_scale = audio_stg_scale = 0, modality_scale =
audio_modality_scale = 1: the pipeline's defaults run STG and modality-isolation forwards, which
the project does not support) and image_crf = 0 (the project re-compresses condition frames only
when configured to; CRF 0 keeps the comparison exact). Layout conversions for the pipeline use
its own static methods, so the packed / 5-D / normalised forms are diffusers'."""
from __future__ import annotations

import asyncio
import copy
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from adapters.registry import get_family
from contract import (ConfigError, InvalidRequestError, MediaFormatError, MediaInput, MediaRole,
                      Modality, OutputContractError, RequestLimits, RolloutRequest,
                      SamplingSpec, Task)
from diffusion.noise import initial_noise
from diffusion.step import doubles_rows
from rollout.engine_api import EngineRequest
from tests.family_conformance import (NEGATIVE, PROMPTS, FamilyConformance,
                                      check_time_convention_flip)

torch.set_num_threads(1)

SIZE = {"height": 64, "width": 96, "num_frames": 9}
OPTIONS = {"max_sequence_length": 16, "frame_rate": 25.0, "image_crf": 0}
PLAIN = dict(stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0)
_gen = torch.Generator().manual_seed(5)
FIRST = torch.randint(0, 256, (3, 64, 96), generator=_gen, dtype=torch.uint8)
LAST = torch.randint(0, 256, (3, 64, 96), generator=_gen, dtype=torch.uint8)


def pil(image: torch.Tensor):
    from PIL import Image
    return Image.fromarray(image.permute(1, 2, 0).contiguous().numpy())


def frames(*roles: tuple[MediaRole, torch.Tensor]) -> tuple[MediaInput, ...]:
    return tuple(MediaInput(Modality.IMAGE, role, data) for role, data in roles)


def to_pipeline(pipe, layout, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our flat state -> the pipeline's `latents` (5-D) / `audio_latents` (4-D), denormalised,
    with the pipeline's own unpack / denormalise (keyframe tokens dropped)."""
    video, audio = layout.tokens(state)
    d = layout.dims
    v = pipe._unpack_latents(video[:, :layout.video_tokens], layout.frames, layout.rows,
                             layout.cols, d.patch, d.patch_t)
    v = pipe._denormalize_latents(v, pipe.vae.latents_mean, pipe.vae.latents_std,
                                  pipe.vae.config.scaling_factor)
    a = pipe._denormalize_audio_latents(audio, pipe.audio_vae.latents_mean,
                                        pipe.audio_vae.latents_std)
    return v, pipe._unpack_audio_latents(a, layout.audio_length, d.latent_mel_bins)


def from_pipeline(pipe, result) -> dict[str, torch.Tensor]:
    """The pipeline's denormalised latent output -> our normalised artifacts."""
    v = pipe._normalize_latents(result.frames, pipe.vae.latents_mean, pipe.vae.latents_std,
                                pipe.vae.config.scaling_factor)
    a = pipe._normalize_audio_latents(pipe._pack_audio_latents(result.audio),
                                      pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)
    return {"video_latent": v, "audio_latent": pipe._unpack_audio_latents(
        a, result.audio.shape[2], result.audio.shape[3])}


class TestLTX2(FamilyConformance):
    family, checkpoint = "ltx2", "ltx2"
    options = OPTIONS
    size = SIZE
    other_sizes = ({"height": 128, "width": 128, "num_frames": 17},
                   {"height": 32, "width": 256, "num_frames": 1})
    bad_size = {"height": 64, "width": 80, "num_frames": 9}       # 80: not a multiple of 32
    guidance_scale = 3.0
    negative = True
    sigma_steps = (2, 4, 10)        # shift_terminal makes the 1-step table 0/0 (refused below)

    def pipeline(self, root):
        from diffusers import LTX2Pipeline
        return LTX2Pipeline.from_pretrained(root, local_files_only=True)

    def pipeline_sigmas(self, fam, scheduler, sampling):
        import numpy as np
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift
        n, c = sampling.num_steps, scheduler.config
        tokens = fam.codec.layout(sampling).video_tokens
        mu = calculate_shift(tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift,
                             c.max_shift)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=mu)
        return scheduler.sigmas.float()

    @pytest.fixture(autouse=True)
    def _family(self, fam):
        type(self).ltx2 = fam                       # the pipeline calls convert with its codec

    def call(self, pipe, x0, output_type, layout=None, **kwargs):
        """The pipeline from our initial state x0 (our layout), plain guidance path."""
        layout = layout or self.ltx2.codec.layout(self.sampling())
        video, audio = to_pipeline(pipe, layout, x0)
        rows = x0.shape[0]
        return pipe(prompt=[PROMPTS[0]] * rows, negative_prompt=[NEGATIVE] * rows,
                    latents=video, audio_latents=audio, num_inference_steps=self.steps,
                    guidance_scale=self.guidance_scale, output_type=output_type,
                    max_sequence_length=16, frame_rate=25.0, **PLAIN, **self.size, **kwargs)

    def pipeline_call(self, pipe, x0, output_type):
        result = self.call(pipe, x0, output_type)
        if output_type == "latent":
            return SimpleNamespace(latents=from_pipeline(pipe, result))
        return result

    def latents_of(self, result):
        return result.latents

    def decode_all(self, fam, latents, sampling):
        return fam.codec.decode("video_latent", fam.load_decoder("video_latent"),
                                latents["video_latent"], sampling)

    def decoded_from_pipeline(self, result):
        pixels = torch.from_numpy((result.frames * 255).round().astype("uint8"))
        return pixels.permute(0, 1, 4, 2, 3)                       # (B, F, 3, H, W)

    def audio_all(self, fam, latents, sampling):
        return fam.codec.decode("audio_latent", fam.load_decoder("audio_latent"),
                                latents["audio_latent"], sampling)

    def audio_from_pipeline(self, result):
        return result.audio.float()

    # ---- LTX-2 in particular --------------------------------------------------------------
    def run(self, fam, engine, encoders, task: Task, media, sampling=None):
        sampling = sampling or self.sampling()
        bundle = fam.conditioner.tokenize([PROMPTS[0]], [NEGATIVE])[0]
        request = RolloutRequest(prompt=bundle, sampling=sampling, task=task, media=media)
        canonical = fam.validate_request(request, RequestLimits())
        cond = fam.conditioner.encode(encoders, [bundle])
        negative = fam.conditioner.encode(encoders, [fam.conditioner.unconditional(bundle)])
        result = engine.submit(EngineRequest(request, cond, negative,
                                             ("video_latent", "audio_latent"), canonical,
                                             "base")).result(timeout=300)
        condition = fam.codec.encode_media(fam.load_media_encoders(), sampling, canonical)
        return {n: a.data for n, a in result.latents.items()}, condition, result.trajectory

    @staticmethod
    def initial_state(fam, sampling, condition) -> torch.Tensor:
        """The engine's initial state: seeded noise with the condition entries held."""
        shape = condition.state_shape or fam.codec.state_shape(sampling)
        x0 = initial_noise(sampling.seeds, shape)
        return torch.where(condition.frozen.mask, condition.frozen.values, x0)

    @staticmethod
    def report(name, ours, theirs):
        for key in ("video_latent", "audio_latent"):
            diff = float((ours[key] - theirs[key]).abs().max())
            print(f"ltx2 {name} {key}: max |ours - pipeline| = {diff:.3g}")
            assert diff <= 1e-4 and float(theirs[key].abs().mean()) > 0.1, (name, key, diff)

    def test_image_to_video_audio_equals_the_i2v_pipeline(self, fam, root, engine, encoders):
        from diffusers import LTX2ImageToVideoPipeline
        sampling = self.sampling()
        ours, condition, trajectory = self.run(
            fam, engine, encoders, Task.I2VA, frames((MediaRole.IMAGE, FIRST)), sampling)
        pipe = LTX2ImageToVideoPipeline.from_pretrained(root, local_files_only=True)
        layout = fam.codec.layout_of(condition.inputs)
        x0 = self.initial_state(fam, sampling, condition)
        theirs = from_pipeline(pipe, self.call(pipe, x0, "latent", layout, image=pil(FIRST),
                                               image_crf=0))
        self.report("i2va", ours, theirs)
        # the condition frame path itself: the pipeline encoding the image (no latents given)
        # holds our condition latent as its first latent frame
        own = pipe(prompt=PROMPTS[0], image=pil(FIRST), image_crf=0, num_inference_steps=2,
                   output_type="latent", max_sequence_length=16, frame_rate=25.0, **PLAIN,
                   **self.size, generator=torch.Generator().manual_seed(0))
        held = from_pipeline(pipe, own)["video_latent"][:, :, :1]
        assert float((held - ours["video_latent"][:1, :, :1]).abs().max()) <= 1e-5
        # condition entries: frozen in the state, left out of the trajectory's log-probs
        assert trajectory.frozen_mask is not None and \
            int(trajectory.frozen_mask.sum()) == layout.grid_tokens * fam.codec.dims.video_features

    def test_first_last_frame_equals_the_condition_pipeline(self, fam, root, engine, encoders):
        from diffusers import LTX2ConditionPipeline
        from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition
        pipe = LTX2ConditionPipeline.from_pretrained(root, local_files_only=True)
        for num_frames in (9, 17):          # the keyframe at pixel frame 1, then 9
            sampling = self.sampling(**(SIZE | {"num_frames": num_frames}))
            ours, condition, _ = self.run(
                fam, engine, encoders, Task.FL2VA,
                frames((MediaRole.FIRST_FRAME, FIRST), (MediaRole.LAST_FRAME, LAST)), sampling)
            layout = fam.codec.layout_of(condition.inputs)
            assert layout.keyframes == ((layout.frames - 2) * 8 + 1,)
            assert condition.state_shape == (layout.size,)
            x0 = self.initial_state(fam, sampling, condition)
            theirs = pipe(
                prompt=[PROMPTS[0]] * 2, negative_prompt=[NEGATIVE] * 2,
                conditions=[LTX2VideoCondition(frames=pil(FIRST), index=0, crf=0),
                            LTX2VideoCondition(frames=pil(LAST), index=-1, crf=0)],
                latents=to_pipeline(pipe, layout, x0)[0],
                audio_latents=to_pipeline(pipe, layout, x0)[1], noise_scale=0.0,
                num_inference_steps=self.steps, guidance_scale=self.guidance_scale,
                output_type="latent", max_sequence_length=16, frame_rate=25.0, **PLAIN,
                **sampling.model_dump(include={"height", "width", "num_frames"}))
            # the keyframe tokens count in the shift, as latents.shape[1] counts them there
            assert torch.equal(fam.request_sigmas(sampling, condition), pipe.scheduler.sigmas)
            assert not torch.equal(fam.sigmas(sampling), pipe.scheduler.sigmas)
            self.report(f"fl2va F={num_frames}", ours, from_pipeline(pipe, theirs))

    def test_condition_frames_missing_or_of_another_size_are_typed_errors(self, fam):
        sampling = self.sampling()
        bundle = fam.conditioner.tokenize(["a cat"], [NEGATIVE])[0]

        def check(task, media, error, field, sampling=sampling):
            request = RolloutRequest(prompt=bundle, sampling=sampling, task=task, media=media)
            with pytest.raises(error) as err:
                fam.validate_request(request, RequestLimits())
            assert err.value.field == field, err.value
        check(Task.FL2VA, frames((MediaRole.FIRST_FRAME, FIRST)), InvalidRequestError, "media")
        check(Task.I2VA, None, InvalidRequestError, "media")
        check(Task.T2VA, frames((MediaRole.IMAGE, FIRST)), InvalidRequestError, "media")
        small = FIRST[:, :32]
        check(Task.I2VA, frames((MediaRole.IMAGE, small)), MediaFormatError, "media.first_frame")
        check(Task.FL2VA, frames((MediaRole.FIRST_FRAME, FIRST), (MediaRole.LAST_FRAME, small)),
              MediaFormatError, "media.last_frame")
        one = self.sampling(**(SIZE | {"num_frames": 1}))
        check(Task.FL2VA, frames((MediaRole.FIRST_FRAME, FIRST), (MediaRole.LAST_FRAME, LAST)),
              InvalidRequestError, "sampling.num_frames", one)
        with pytest.raises(MediaFormatError) as err:          # the codec refuses it as well
            fam.codec.encode_media(fam.load_media_encoders(), sampling,
                                   {MediaRole.FIRST_FRAME: FIRST.float()})
        assert err.value.field == "media.first_frame"
        for frames_count in (8, 10, 16):
            with pytest.raises(InvalidRequestError) as err:
                fam.codec.state_shape(SamplingSpec(seeds=(0,), **(SIZE | {"num_frames":
                                                                          frames_count})))
            assert (err.value.field, err.value.expected) == ("sampling.num_frames", "8n + 1")
        with pytest.raises(InvalidRequestError) as err:
            fam.validate_request(RolloutRequest(prompt=bundle, task=Task.T2VA,
                                                sampling=self.sampling().model_copy(
                                                    update={"num_steps": 1})), RequestLimits())
        assert err.value.field == "sampling.num_steps"

    def test_guidance_the_project_does_not_run_is_refused(self, fam, root):
        for option, value in (("stg_scale", 1.0), ("modality_scale", 3.0)):
            with pytest.raises(ConfigError) as err:
                get_family("ltx2", root, OPTIONS | {option: value})
            assert err.value.field == f"rollout.adapter_options.{option}"
        bundle = fam.conditioner.tokenize(["a cat"])[0]
        at_one = RolloutRequest(prompt=bundle, task=Task.T2VA,
                                sampling=self.sampling().model_copy(
                                    update={"guidance_scale": 1.0}))
        fam.validate_request(at_one, RequestLimits())
        # the pipeline guides audio at 7 with the video at 1 (the conformance probe at 1.0)
        assert doubles_rows(fam.spec.guidance, 1.0) and doubles_rows(fam.spec.guidance, 0.5)
        same = get_family("ltx2", root, OPTIONS | {"audio_guidance_scale": None})
        assert not doubles_rows(same.spec.guidance, 1.0)      # audio follows the video scale
        assert not doubles_rows(same.spec.guidance, 0.5) and doubles_rows(same.spec.guidance, 2)
        streams = fam.denoiser.guidance_form.streams
        assert [(s.name, s.scale, s.rescale) for s in streams] == \
            [("video", None, 0.7), ("audio", 7.0, 0.7)]

    def test_no_cfg_below_one_when_audio_follows_the_video_scale(self, root, encoders, pipe):
        """audio_guidance_scale null: at 0.5 neither stream guides, in the pipeline (its
        `do_classifier_free_guidance` false) as here; latents equal, recorded at scale 1."""
        from rollout.engine import EmbeddedEngine
        fam = get_family("ltx2", root, OPTIONS | {"audio_guidance_scale": None})
        case = copy.copy(self)
        case.guidance_scale = 0.5
        sampling = case.sampling(seeds=(0,))
        assert not doubles_rows(fam.spec.guidance, 0.5)
        assert fam.sampling_as_run(sampling).guidance_scale == 1.0
        engine = EmbeddedEngine(fam, fam.load_transformers(), fam.load_media_encoders())
        try:
            ours = case.engine_latents(fam, engine, encoders, PROMPTS[0], sampling)
        finally:
            asyncio.run(engine.shutdown())
        x0 = initial_noise(sampling.seeds, fam.codec.state_shape(sampling))
        theirs = from_pipeline(pipe, case.call(pipe, x0.clone(), "latent",
                                               audio_guidance_scale=None))
        assert pipe.do_classifier_free_guidance is False
        for name, value in theirs.items():
            diff = float((ours[name] - value).abs().max())
            print(f"ltx2 audio-follows 0.5 {name}: max |ours - pipeline| = {diff:.3g}")
            assert diff <= 1e-4 and float(value.abs().mean()) > 0.1, (name, diff)

    def test_audio_rate_is_declared_and_checked_on_every_decode(self, fam, root, tmp_path):
        vocoder = json.loads((root / "vocoder" / "config.json").read_text())
        assert fam.io_spec["audio"].sample_rate == vocoder["output_sampling_rate"] == 24000
        assert fam.io_spec["video"].fps == 25.0
        latent = torch.randn(1, 2, 9, 4)
        wave = fam.codec.decode("audio_latent", fam.load_decoder("audio_latent"), latent,
                                self.sampling(seeds=(0,)))
        assert wave.shape == (1, 2, (4 * 9 - 3) * 240)                  # 33 mel frames x 240
        lying = tmp_path / "lying"             # a vocoder config that misstates its rate
        shutil.copytree(root, lying)
        (lying / "vocoder" / "config.json").write_text(
            json.dumps(vocoder | {"output_sampling_rate": 16000}))
        other = get_family("ltx2", lying, OPTIONS)
        assert other.io_spec["audio"].sample_rate == 16000
        with pytest.raises(OutputContractError) as err:
            other.codec.decode("audio_latent", other.load_decoder("audio_latent"), latent,
                               self.sampling(seeds=(0,)))
        assert err.value.field == "artifacts.audio.sample_rate"
        assert err.value.actual["produced"] == 24000

    def test_the_default_image_crf_is_the_pipelines(self, root):
        from diffusers.pipelines.ltx2.utils import resolve_default_image_crf
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(root / "text_encoder")
        default = get_family("ltx2", root, {"max_sequence_length": 16})
        assert default.codec.image_crf == resolve_default_image_crf(
            SimpleNamespace(config=config)) == 33


def test_time_convention_check_against_the_checkpoint_scheduler(tiny_checkpoint, monkeypatch):
    check_time_convention_flip("ltx2", tiny_checkpoint("ltx2"), OPTIONS, SIZE, monkeypatch)


def test_gemma_etp_plan_names_the_real_modules(tiny_checkpoint):
    """The Gemma 3 plan resolves on the real module tree (every layer's q/k/v/o, gated MLP,
    the embedding); the tiny Gemma has one key/value head, so etp 2 is refused by name."""
    from deployments.etp import check_family_etp, tp_plan
    family = get_family("ltx2", tiny_checkpoint("ltx2"), OPTIONS)
    plan = family.spec.encoder("gemma").etp
    stack = family.load_encoders()["gemma"]
    styles = tp_plan(stack, plan)
    layers = stack.get_submodule(plan.layers)
    assert len(styles) == 1 + len(layers) * (len(plan.column) + len(plan.row))
    for name in styles:
        assert isinstance(stack.get_submodule(name), (torch.nn.Linear, torch.nn.Embedding))
    assert check_family_etp(family, 1) == 1
    with pytest.raises(ConfigError) as err:
        check_family_etp(family, 2)
    assert err.value.field == "etp" and err.value.expected == [1]


def test_mp4_preview_muxes_the_declared_rates_and_refuses_what_it_cannot_encode():
    import base64
    import io

    import av

    from contract import ArtifactSpec, Layout, MediaArtifact, Representation
    from deployments.previews import av_preview_urls
    video_spec = ArtifactSpec("video", Modality.VIDEO, Representation.DECODED, Layout.TCHW,
                              fps=25.0, source="video_latent")
    audio_spec = ArtifactSpec("audio", Modality.AUDIO, Representation.DECODED, Layout.CT,
                              sample_rate=24000, source="audio_latent")
    gen = torch.Generator().manual_seed(0)
    video = MediaArtifact(video_spec, torch.randint(0, 256, (1, 9, 3, 64, 96), generator=gen,
                                                    dtype=torch.uint8), {"fps": 25.0})
    audio = MediaArtifact(audio_spec, torch.rand(1, 2, 7920, generator=gen) - 0.5,
                          {"sample_rate": 24000})
    [url] = av_preview_urls(video, audio, 10**6)
    with av.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as container:
        assert [s.type for s in container.streams] == ["video", "audio"]
        assert float(container.streams.video[0].average_rate) == 25.0
        assert container.streams.audio[0].codec_context.sample_rate == 24000
        assert sum(1 for _ in container.decode(video=0)) == 9
    odd = MediaArtifact(video_spec, video.data[..., :63, :], {"fps": 25.0})
    with pytest.raises(MediaFormatError) as err:                 # never padded or resized
        av_preview_urls(odd, audio, 10**6)
    assert err.value.field == "artifacts.video.shape"
    with pytest.raises(MediaFormatError) as err:
        av_preview_urls(video, audio, 1000)
    assert err.value.field == "artifacts.video"
    with pytest.raises(MediaFormatError) as err:
        av_preview_urls(audio, video, 10**6)
