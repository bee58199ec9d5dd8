"""Wan 2.1 / 2.2 from a local diffusers checkpoint (WanPipeline, WanImageToVideoPipeline layouts).

Components: transformer (WanTransformer3DModel) and, for Wan 2.2 A14B, transformer_2 (the
low-noise expert), vae (AutoencoderKLWan), text_encoder (UMT5EncoderModel), tokenizer, scheduler;
I2V adds image_encoder (CLIPVisionModel) + image_processor (CLIPImageProcessor) where the
transformer has `image_dim` (Wan 2.1 I2V; Wan 2.2 I2V A14B has none).

As the pipelines do (diffusers 0.42.1; pieces in adapters/wan_parts.py):
  state        latents (B, z, (F-1)/4 + 1, H/8, W/8) in the normalised space (the model-native
               layout `output_type="latent"` returns); F must be 4n+1 and H, W multiples of
               VAE x patch (16): the pipeline rounds them down with a warning, we refuse
  sigmas       scheduler.set_timesteps(n) (no sigmas, no mu)
  model time   timestep = 1000 sigma (NOISE_LEVEL), the model predicts v = eps - x0
  guidance     true CFG, negative prompt or "" as the unconditional branch; the pipeline runs
               cond and uncond as two forwards, the project batches [uncond; cond] rows; CFG
               only at guidance_scale > 1 (`do_classifier_free_guidance`, pipeline_wan.py:364,
               pipeline_wan_i2v.py:492): at or below 1 the conditional branch alone
  experts      Wan 2.2: timestep >= boundary_ratio * num_train_timesteps runs `transformer`,
               below it `transformer_2`, chosen per row (rows of one forward may straddle the
               boundary); the low-noise expert's guidance_scale_2 is the pipeline's default
               (= guidance_scale)
  I2V          model input cat([latents, mask (4) + condition latents (z)]) and the CLIP image
               features, per request (MediaCondition.inputs "condition", "image_embeds")
UMT5 rejects prompts longer than `max_sequence_length` (the pipeline truncates silently).
Not served: Wan 2.2 TI2V-5B (`expand_timesteps`, per-token timesteps), first-last-frame (FLF2V).
The task is the components': a transformer taking the latents alone (in_channels = z) serves
T2V, one taking mask + condition latents too (2 z + 4) serves I2V, whichever pipeline class
(adapters/families.py) saved the folder.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from adapters.checkpoint import load_component, read_json
from adapters.diffusers_parts import UMT5_ETP_PLAN, FlowSchedule, encoder_vocab_size
from adapters.family import (CheckpointFamily, EncoderSpec, FamilySpec, MediaCondition,
                             OneLatentCodec, Overflow, check_condition_frame)
from adapters.wan_parts import (UMT5Conditioner, UniPCHandling, WanVAE, clip_image_embeds,
                                schedule_config, unipc_spacing)
from contract import (ArtifactSpec, Condition, ConfigError, GuidanceKind, InvalidRequestError,
                      IOSpec, Layout, MediaRole, Modality, Representation, SamplingSpec, Task,
                      TimeConvention)
from diffusion.guidance import CFGRule, GuidanceRule

WAN_LORA_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
                    "ffn.net.0.proj", "ffn.net.2")
IMAGE_KV_TARGETS = ("attn2.add_k_proj", "attn2.add_v_proj")      # I2V image cross-attention
WAN_GUIDANCE = GuidanceRule(GuidanceKind.CFG, CFGRule.ABOVE_ONE, source="pipeline_wan.py:364")
EXPERTS = ("transformer", "transformer_2")                       # high-noise, low-noise
I2V_TEXT_TOKENS = 512     # WanAttnProcessor splits image tokens off at this text length


class WanOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_sequence_length: int = Field(512, ge=1, le=512, description="UMT5 window (the "
                                     "pipeline's max_sequence_length).")
    fps: float = Field(16.0, gt=0, description="Frame rate of the decoded video (Wan 2.1 and "
                       "2.2 A14B generate 16 fps).")
    unipc: UniPCHandling = Field(UniPCHandling.REFUSE, description="What a UniPC scheduler "
                                 "config means (adapters/wan_parts.py UniPCHandling).")


class WanDenoiser:
    """Raw v of the expert each row's timestep selects; I2V rows get their condition channels
    and image features (media inputs)."""

    time_convention = TimeConvention.NOISE_LEVEL
    model_time_scale = 1000.0

    def __init__(self, boundary: float | None, conditioned: bool):
        self.boundary, self.conditioned = boundary, conditioned

    def forward(self, models, state, sigma, model_time, cond: Condition, media, guidance):
        media = dict(media or {})
        if self.conditioned and "condition" not in media:
            raise InvalidRequestError("Wan image-to-video rows need their condition input",
                                      field="media.condition", expected="(B, 4 + z, T', h, w)",
                                      actual=sorted(media))
        hidden = torch.cat([state, media.pop("condition")], dim=1) if self.conditioned \
            else state
        image = media.pop("image_embeds", None)
        if media:
            raise InvalidRequestError("Wan takes no such media inputs", field="media",
                                      expected=["condition", "image_embeds"],
                                      actual=sorted(media))
        embeds = cond["prompt_embeds"]
        if self.boundary is None:
            return _run(models["transformer"], hidden, model_time, embeds, image)
        high = model_time >= self.boundary                 # the pipeline's t >= boundary
        if bool(high.all()) or not bool(high.any()):
            return _run(models[EXPERTS[0] if bool(high.all()) else EXPERTS[1]], hidden,
                        model_time, embeds, image)
        parts = []
        for expert, rows in ((EXPERTS[0], high.nonzero().flatten()),
                             (EXPERTS[1], (~high).nonzero().flatten())):
            pick = lambda t: None if t is None else t[rows]     # noqa: E731
            parts.append((rows, _run(models[expert], hidden[rows], model_time[rows],
                                     embeds[rows], pick(image))))
        order = torch.cat([rows for rows, _ in parts])
        return torch.cat([out for _, out in parts])[torch.argsort(order)]


def _run(model: nn.Module, hidden, timestep, embeds, image) -> torch.Tensor:
    return model(hidden_states=hidden, timestep=timestep, encoder_hidden_states=embeds,
                 encoder_hidden_states_image=image, return_dict=False)[0]


class WanCodec(OneLatentCodec):
    latent_name, label = 'video_latent', 'Wan'

    def __init__(self, root: Path, vae: WanVAE, patch: tuple[int, int, int], task: Task,
                 image_features: bool):
        self.root, self.vae, self.patch, self.task = root, vae, patch, task
        self.image_features = image_features
        self._processor = None

    @property
    def image_processor(self):
        """The checkpoint's CLIPImageProcessor (a config, no weights), loaded on first use."""
        if self._processor is None:
            self._processor = load_component(self.root, "image_processor")
        return self._processor

    def state_shape(self, sampling: SamplingSpec) -> tuple[int, ...]:
        frames, temporal = sampling.num_frames, self.vae.temporal
        if (frames - 1) % temporal:
            raise InvalidRequestError(f"Wan's VAE decodes {temporal}n+1 frames (nothing is "
                                      "rounded)", field="sampling.num_frames",
                                      expected=f"{temporal}n+1", actual=frames)
        if self.vae.latent_frames(frames) % self.patch[0]:
            raise InvalidRequestError("latent frames must divide by the temporal patch",
                                      field="sampling.num_frames",
                                      expected=f"(F-1)/{temporal}+1 divisible by "
                                               f"{self.patch[0]}", actual=frames)
        for name, patch in (("height", self.patch[1]), ("width", self.patch[2])):
            value, multiple = getattr(sampling, name), self.vae.spatial * patch
            if value % multiple:
                raise InvalidRequestError(f"Wan generates sizes divisible by {multiple} (VAE x "
                                          "patch); nothing is resized", field=f"sampling.{name}",
                                          expected=f"a multiple of {multiple}", actual=value)
        return (self.vae.z_dim, self.vae.latent_frames(frames),
                sampling.height // self.vae.spatial, sampling.width // self.vae.spatial)

    def decode(self, latent_name: str, modules: Mapping[str, nn.Module], latent: torch.Tensor,
               sampling: SamplingSpec):
        self.check_latent(latent_name, latent, sampling)
        return self.vae.decode(modules["vae"], latent)

    def encode_media(self, modules, sampling, media) -> MediaCondition:
        if self.task is Task.T2V:
            return super().encode_media(modules, sampling, media)
        if set(media) != {MediaRole.FIRST_FRAME}:
            raise InvalidRequestError("Wan image-to-video takes exactly one condition image",
                                      field="media", expected=[MediaRole.FIRST_FRAME.value],
                                      actual=sorted(r.value for r in media))
        image = media[MediaRole.FIRST_FRAME]
        check_condition_frame(image, sampling.height, sampling.width, "media.first_frame")
        self.state_shape(sampling)
        inputs = {"condition": self.vae.encode_first_frame(modules["vae"], image,
                                                           sampling.num_frames)}
        if self.image_features:
            inputs["image_embeds"] = clip_image_embeds(self.image_processor,
                                                       modules["image_encoder"], image)
        return MediaCondition(inputs=inputs)


def video_io_spec(fps: float) -> IOSpec:
    return IOSpec(artifacts=(
        ArtifactSpec("video_latent", Modality.VIDEO, Representation.LATENT, Layout.LATENT_CTHW),
        ArtifactSpec("video", Modality.VIDEO, Representation.DECODED, Layout.TCHW, fps=fps,
                     source="video_latent")), defaults=("video_latent", "video"))


def _declared(index: Mapping, component: str) -> bool:
    entry = index.get(component)
    return isinstance(entry, list) and len(entry) == 2 and entry[0] is not None


class WanFamily(CheckpointFamily):
    """WanPipeline (Wan 2.1 T2V, Wan 2.2 T2V A14B) and WanImageToVideoPipeline (Wan 2.1 I2V,
    Wan 2.2 I2V A14B) checkpoints."""

    entry_name = "wan"

    def __init__(self, root: str | Path, options: Mapping | WanOptions | None = None):
        super().__init__(root, options)
        index = self.index
        if index.get("expand_timesteps"):
            raise ConfigError("Wan 2.2 TI2V (expand_timesteps: per-token timesteps) is not "
                              "served", field="weights_path.expand_timesteps", expected=False,
                              actual=True)
        self.boundary_ratio = index.get("boundary_ratio")
        experts = EXPERTS if self.boundary_ratio is not None else EXPERTS[:1]
        missing = [c for c in experts if not _declared(index, c)]
        if missing:
            raise ConfigError("the checkpoint lacks a transformer its pipeline runs",
                              field=f"weights_path.{missing[0]}",
                              expected=f"{missing[0]} (boundary_ratio "
                                       f"{self.boundary_ratio})", actual=None)
        transformer = read_json(self.root, "transformer", "config.json")
        self._check_experts(experts, transformer)
        self.vae = WanVAE(self.root)
        task = self._task(transformer)
        image_features = task is Task.I2V and transformer.get("image_dim") is not None
        self._check_channels(task, transformer, index, image_features)
        config, self.unipc_spacing = schedule_config(self.root, self.options.unipc)
        if config.get("use_dynamic_shifting"):
            raise ConfigError("the Wan pipelines pass no mu: a dynamic-shift scheduler config "
                              "cannot be sampled as they sample it",
                              field="scheduler.use_dynamic_shifting", expected=False, actual=True)
        self.schedule = FlowSchedule(self.root, config)
        self.boundary = None if self.boundary_ratio is None else \
            float(self.boundary_ratio) * int(config["num_train_timesteps"])
        window = self.options.max_sequence_length
        if transformer.get("added_kv_proj_dim") is not None and window != I2V_TEXT_TOKENS:
            raise ConfigError("this transformer splits image tokens off at 512 text tokens",
                              field="rollout.adapter_options.max_sequence_length",
                              expected=I2V_TEXT_TOKENS, actual=window)
        targets = WAN_LORA_TARGETS + (IMAGE_KV_TARGETS if transformer.get("added_kv_proj_dim")
                                      else ())
        media_encoders = () if task is Task.T2V else \
            ("vae",) + (("image_encoder",) if image_features else ())
        self.spec = FamilySpec(
            name="wan", io_spec=video_io_spec(self.options.fps),
            tasks={task: () if task is Task.T2V else (MediaRole.FIRST_FRAME,)},
            time_convention=TimeConvention.NOISE_LEVEL, model_time_scale=1000.0,
            guidance=WAN_GUIDANCE, transformers=experts,
            lora_targets={e: targets for e in experts},
            encoders=(EncoderSpec("umt5", "text_encoder", "tokenizer", window, Overflow.REJECT,
                                  UMT5_ETP_PLAN,
                                  encoder_vocab_size(self.root, "text_encoder")),),
            decoders={"video_latent": ("vae",)}, media_encoders=media_encoders,
            sampling_defaults={"height": 480, "width": 832, "num_frames": 81})
        self.conditioner = UMT5Conditioner(self.spec, self.root)
        self.denoiser = WanDenoiser(self.boundary, conditioned=task is Task.I2V)
        self.codec = WanCodec(self.root, self.vae,
                              tuple(transformer.get("patch_size", (1, 2, 2))), task,
                              image_features)

    def _check_experts(self, experts, transformer: Mapping) -> None:
        for expert in experts[1:]:
            other = read_json(self.root, expert, "config.json")
            for key in ("in_channels", "out_channels", "patch_size", "text_dim", "image_dim"):
                if other.get(key) != transformer.get(key):
                    raise ConfigError("the two experts disagree on their inputs",
                                      field=f"weights_path.{expert}.{key}",
                                      expected=transformer.get(key), actual=other.get(key))

    def _task(self, transformer: Mapping) -> Task:
        """T2V or I2V, by what the transformer takes in (the latents alone, or with the
        mask and condition latents)."""
        z = self.vae.z_dim
        tasks = {z: Task.T2V, 2 * z + self.vae.temporal: Task.I2V}
        channels = transformer.get("in_channels")
        if channels not in tasks:
            raise ConfigError("the transformer's input channels are neither text-to-video's "
                              "nor image-to-video's (another Wan task: not served)",
                              field="weights_path.transformer.in_channels",
                              expected=sorted(tasks), actual=channels)
        return tasks[channels]

    def _check_channels(self, task: Task, transformer: Mapping, index: Mapping,
                        image_features: bool) -> None:
        z = self.vae.z_dim
        want = z if task is Task.T2V else 2 * z + self.vae.temporal     # + mask + condition
        for key, value in (("in_channels", want), ("out_channels", z)):
            if transformer.get(key) != value:
                raise ConfigError("the transformer's channels do not fit the VAE and task",
                                  field=f"weights_path.transformer.{key}", expected=value,
                                  actual=transformer.get(key))
        for component in ("image_encoder", "image_processor") if image_features else ():
            if not _declared(index, component):
                raise ConfigError("the transformer takes image features: the checkpoint needs "
                                  "its image encoder", field=f"weights_path.{component}",
                                  expected=component, actual=None)

    # ---- declarations -------------------------------------------------------------------------
    def sigmas(self, sampling: SamplingSpec) -> torch.Tensor:
        self.codec.state_shape(sampling)
        n = sampling.num_steps
        custom = unipc_spacing(n, int(self.schedule.config["num_train_timesteps"])) \
            if self.unipc_spacing else None
        return self.schedule.sigmas(n, 0, custom)

    def schedule_shift(self, sampling: SamplingSpec) -> float:
        return self.schedule.static_shift(0)

    def expert_of(self, sigma: float) -> str:
        """The transformer the pipeline runs at noise level `sigma`."""
        if self.boundary is None:
            return EXPERTS[0]
        time = torch.tensor([sigma], dtype=torch.float32) * self.denoiser.model_time_scale
        return EXPERTS[0] if bool(time[0] >= self.boundary) else EXPERTS[1]
