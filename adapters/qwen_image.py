"""Qwen-Image from a local diffusers checkpoint (QwenImagePipeline layout).

Components: transformer (QwenImageTransformer2DModel), vae (AutoencoderKLQwenImage, a 3-D causal
VAE run on one frame), text_encoder (Qwen2_5_VLForConditionalGeneration: its language model's
last hidden state), tokenizer (Qwen2Tokenizer), scheduler (FlowMatchEulerDiscreteScheduler,
exponential dynamic shift).

As QwenImagePipeline (diffusers 0.42.1, pipeline_qwenimage.py):
  ids          the prompt inside the pipeline's chat template (:175) tokenized by the
               checkpoint's tokenizer; the encoder runs on the ids with their attention mask
  embeds       hidden_states[-1] of the valid tokens with the template's first 34 tokens dropped
               (`prompt_template_encode_start_idx`, :176; checked at load: the template up
               to the prompt is exactly that many tokens), zero-padded to the window with a mask
               (the transformer masks the padding: pipeline and project agree)
  state        packed latents (B, (H/16)(W/16), 4 z): 2x2 latent patches as tokens
  sigmas       linspace(1, 1/N, N) through the scheduler with mu = calculate_shift(seq length)
               (:598-612), the scheduler's shift_terminal applied by the scheduler
  model time   timestep = 1000 sigma, the transformer gets timestep / 1000 (NOISE_LEVEL)
  guidance     true CFG with norm rescaling: `do_true_cfg = true_cfg_scale > 1 and
               has_neg_prompt` (:564); comb = v_u + g (v_c - v_u), v = comb |v_c| / |comb| over
               each token's channels (:668-672): diffusion/guidance.py NORM_RESCALED_CFG. The
               request's guidance_scale is the pipeline's true_cfg_scale. The pipeline guides
               only with a negative prompt, so a request guided above 1 without one is refused
               (naming prompt.negative), never guided with an invented unconditional prompt.
  decode       unpack, z * std + mean per channel, vae.decode(...)[:, :, 0] (:705-714)
The text encoder's window rejects prompts longer than `max_sequence_length` embedding tokens
(the pipeline cuts the embeddings silently, :255).

Edit (Qwen-Image-Edit, QwenImageEditPipeline, pipeline_qwenimage_edit.py): a folder with a
`processor` (Qwen2VLProcessor) serves the edit task only (its transformer is trained on the edit
presentation; the ids are made once per prompt in the edit template):
  source size  the pipeline resizes the source image to about 1024 x 1024 pixels at its aspect
               ratio, sides multiples of 32 (calculate_dimensions :155-162, :624, :662). Nothing
               is resized here: the source image must already be at that size
               (`edit_source_size`), any other is a MediaFormatError naming media.image and the
               size it must have.
  ids          the prompt in the edit template (:212) with one <|image_pad|>, expanded to the
               source's vision tokens (image_grid_thw / merge^2) as the processor expands it
               (:241); the vision tower reads the processor's pixel values of the source image
               (the processor's own patching, part of the encoder, as in the pipeline)
  embeds       hidden_states[-1] with the template's first 64 tokens dropped
               (`prompt_template_encode_start_idx`, :213; checked at load), so the vision block
               stays in the condition; zero-padded to `max_sequence_length` with a mask (the
               pipeline does not bound them: a longer presentation is refused by name)
  negative     encoded with the same source image (:689-697)
  source       VAE posterior mode, (z - mean) / std, packed, appended after the noise tokens;
               img_shapes [(1, h/16, w/16), (1, sh/16, sw/16)] (:712-717); the velocity is the
               first h w / 256 tokens of the output (:782); guidance as text-to-image (:797-801)

Edit Plus (Qwen-Image-Edit-2509, QwenImageEditPlusPipeline, pipeline_qwenimage_edit_plus.py): a
folder of the same components whose model_index names that class (the class is all that tells
the presentations apart) serves the edit task with 1 to 3 ordered source images, media roles
image, image_2, image_3 (contract SOURCE_IMAGE_ROLES; a request takes a prefix of them):
  sources      each at the size the pipeline resizes it to for its VAE (VAE_IMAGE_SIZE, about
               1024 x 1024 at its aspect ratio, :702): required as for Edit, any other size a
               MediaFormatError naming media.<role> and its size
  ids          the template without a vision block (:215, 64 tokens dropped, :216); before the
               prompt one "Picture i: <|vision_start|><|image_pad|><|vision_end|>" per source
               (:239-252). The prompt's ids are made once without the blocks; a request's
               blocks are spliced in after the 64 template tokens (that this is the pipeline's
               tokenization is checked for the template at load and for each prompt where it is
               tokenized: a prompt whose first characters would merge with the header is
               refused naming it)
  vision       each source resized to its condition size (CONDITION_IMAGE_SIZE, about 384 x 384
               at its aspect ratio, PIL lanczos as the pipeline's VaeImageProcessor.resize,
               :699-705): the view the pipeline gives the VL, part of its presentation; the
               processor patches the list of them (:254)
  source       each source VAE-encoded and packed on its own, the tokens concatenated in order
               (:469-491); img_shapes one entry per source (:753-761); guidance as text-to-image
               (do_true_cfg :719, norm-rescaled combination :841-845)
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from adapters.checkpoint import read_json
from adapters.diffusers_parts import (QWEN_VL_ETP_PLAN, FlowSchedule, TokenizingConditioner,
                                      encoder_vocab_size)
from adapters.family import (CheckpointFamily, EncoderSpec, FamilySpec,
                             MediaCondition, OneLatentCodec, Overflow, check_latent_shape,
                             check_source_image, image_io_spec, request_errors, unit_to_uint8)
from contract import (Condition, ConfigError, GuidanceKind, InvalidRequestError, Layout,
                      LimitExceededError, MediaFormatError, MediaRole, PromptBundle,
                      RequestLimits, RolloutRequest, SamplingSpec, Task, TimeConvention)
from contract.enums import SOURCE_IMAGE_ROLES
from diffusion.guidance import NORM_RESCALED_CFG, CFGRule, GuidanceRule

QWEN = "qwen"                         # the encoder's name (keys its ids in a PromptBundle)
QWEN_IMAGE_GUIDANCE = GuidanceRule(GuidanceKind.CFG, CFGRule.ABOVE_ONE,
                                   source="pipeline_qwenimage.py:564")
T2I_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, "
                "texture, quantity, text, spatial relationships of the objects and background:"
                "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
T2I_DROP = 34                          # pipeline_qwenimage.py:176
EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, "
                 "size, texture, objects, background), then explain how the user's text "
                 "instruction should alter or modify the image. Generate a new image that meets "
                 "the user's requirements while maintaining consistency with the original input "
                 "where appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|>"
                 "<|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n")
EDIT_DROP = 64                         # pipeline_qwenimage_edit.py:213
EDIT_SOURCE_AREA = 1024 * 1024         # pipeline_qwenimage_edit.py:624
IMAGE_PAD = "<|image_pad|>"
SOURCE_LATENTS = "source_latents"      # media input of an edit row: the packed source image(s)
# Qwen-Image-Edit-Plus (pipeline_qwenimage_edit_plus.py): the edit system prompt without a
# vision block (:215); each source image is a "Picture i: " block before the prompt (:239-252)
EDIT_PLUS_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, "
                      "shape, size, texture, objects, background), then explain how the user's "
                      "text instruction should alter or modify the image. Generate a new image "
                      "that meets the user's requirements while maintaining consistency with the "
                      "original input where appropriate.<|im_end|>\n<|im_start|>user\n{}"
                      "<|im_end|>\n<|im_start|>assistant\n")
EDIT_PLUS_DROP = 64                    # pipeline_qwenimage_edit_plus.py:216
PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"   # :239
CONDITION_AREA = 384 * 384             # pipeline_qwenimage_edit_plus.py:66 (the VL's view)
EDIT_PLUS_PIPELINE = "QwenImageEditPlusPipeline"


def calculate_dimensions(area: int, height: int, width: int) -> tuple[int, int]:
    """(height, width) of about `area` pixels at width / height, sides multiples of 32 (the
    pipelines' calculate_dimensions, pipeline_qwenimage_edit.py:155-162)."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    return round(w / ratio / 32) * 32, round(w / 32) * 32


def edit_source_size(height: int, width: int) -> tuple[int, int]:
    """(height, width) QwenImageEditPipeline (:624) and QwenImageEditPlusPipeline (the VAE
    image, VAE_IMAGE_SIZE, pipeline_qwenimage_edit_plus.py:67, :702) resize a source image of
    this size to."""
    return calculate_dimensions(EDIT_SOURCE_AREA, height, width)

QWEN_IMAGE_LORA_TARGETS = (
    # dual-stream blocks: image stream, text stream (names as the QwenImage LoRA loader saves)
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")

# Qwen2.5-VL's language model split as every Qwen-VL's (q / k / v with their biases). The
# vision tower is replicated: text-to-image prompts never run it, and it is ~8% of the 7B encoder.
QWEN2_5_VL_ETP_PLAN = QWEN_VL_ETP_PLAN


class QwenImageOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_sequence_length: int = Field(512, ge=1, le=1024, description="Embedding tokens after "
                                     "the template's system part (the pipeline's "
                                     "max_sequence_length).")


class QwenImageVAE:
    """AutoencoderKLQwenImage on single frames: DiT-space z = (z_vae - mean) / std per channel."""

    def __init__(self, root: Path, subfolder: str = "vae"):
        config = read_json(root, subfolder, "config.json")
        self.scale_factor = 2 ** len(config.get("temperal_downsample", (False, True, True)))
        self.z_dim = int(config.get("z_dim", 16))
        self.mean = torch.tensor(config["latents_mean"], dtype=torch.float32).view(1, -1, 1, 1, 1)
        self.std = torch.tensor(config["latents_std"], dtype=torch.float32).view(1, -1, 1, 1, 1)

    @torch.no_grad()
    def decode(self, vae: nn.Module, latent: torch.Tensor) -> torch.Tensor:
        """DiT-space (B, z, h, w) -> uint8 (B, 3, H, W) as the pipeline postprocesses."""
        param = next(vae.parameters())
        z = latent.float()[:, :, None] * self.std + self.mean
        image = vae.decode(z.to(param.device, param.dtype), return_dict=False)[0][:, :, 0]
        return unit_to_uint8(image).cpu()

    @torch.no_grad()
    def encode(self, vae: nn.Module, images: torch.Tensor) -> torch.Tensor:
        """uint8 (B, 3, H, W) -> DiT-space (B, z, h, w) (the posterior mode, `argmax`)."""
        param = next(vae.parameters())
        x = (images.float() / 127.5 - 1.0)[:, :, None]
        z = vae.encode(x.to(param.device, param.dtype)).latent_dist.mode().float().cpu()
        return ((z - self.mean) / self.std)[:, :, 0]


class QwenConditioner(TokenizingConditioner):
    """Prompts in the pipeline's template -> ids (once) -> masked last hidden states."""

    def __init__(self, spec: FamilySpec, root: Path, template: str, drop: int):
        super().__init__(spec, root)
        self.template, self.drop = template, drop

    def tokenizer(self, encoder: EncoderSpec):
        """The checkpoint's tokenizer, its split of the template checked when first loaded."""
        if encoder.name not in self._tokenizers:
            tok = super().tokenizer(encoder)
            try:
                self.check_template(tok)
            except ConfigError:
                del self._tokenizers[encoder.name]
                raise
        return self._tokenizers[encoder.name]

    def check_template(self, tok) -> None:
        """The template before the prompt (system turn + user header; before the vision block
        of the edit template) must be exactly the `drop` tokens the pipeline drops."""
        prefix = self.template.split("{}")[0].split("<|vision_start|>")[0]
        count = len(tok(prefix)["input_ids"])
        if count != self.drop:
            raise ConfigError("the tokenizer does not make the template's system part the "
                              "tokens the pipeline drops", field="weights_path.tokenizer",
                              expected=self.drop, actual=count)

    def tokenize_one(self, encoder: EncoderSpec, text: str,
                     field: str) -> tuple[tuple[int, ...], bool]:
        return super().tokenize_one(encoder, self.template.format(text), field)

    def encode(self, encoders: Mapping[str, nn.Module],
               prompts: list[PromptBundle]) -> Condition:
        encoder = encoders[QWEN]
        ids = self.padded(QWEN, prompts)
        lengths = [len(p.ids_by_encoder(self.spec.encoder_names)[QWEN]) for p in prompts]
        mask = (torch.arange(ids.shape[1])[None] < torch.tensor(lengths)[:, None]).long()
        device = next(encoder.parameters()).device
        with torch.no_grad():
            hidden = encoder(input_ids=ids.to(device), attention_mask=mask.to(device),
                             output_hidden_states=True, logits_to_keep=1).hidden_states[-1]
        window = ids.shape[1] - self.drop
        embeds = hidden.new_zeros(len(prompts), window, hidden.shape[-1])
        keep = torch.zeros(len(prompts), window, dtype=torch.long, device=hidden.device)
        for i, n in enumerate(lengths):
            if n <= self.drop:
                raise InvalidRequestError("the prompt's ids end inside the template's system "
                                          "part", field=f"prompts[{i}].{QWEN}",
                                          expected=f"> {self.drop} ids", actual=n)
            embeds[i, :n - self.drop] = hidden[i, self.drop:n]
            keep[i, :n - self.drop] = 1
        return Condition({"prompt_embeds": embeds, "prompt_mask": keep})


class QwenEditConditioner(QwenConditioner):
    """QwenImageEditPipeline's prompt encoding: each prompt shown with its source image (media
    role `image`) to Qwen2.5-VL; a prompt without its image is refused (naming media)."""

    media_roles = (MediaRole.IMAGE,)

    def processor(self):
        """The checkpoint's Qwen2VLProcessor (its image processor makes the vision inputs)."""
        if "processor" not in self._tokenizers:
            from adapters.checkpoint import load_component
            self._tokenizers["processor"] = load_component(self.root, "processor")
        return self._tokenizers["processor"]

    def encode(self, encoders, prompts):
        raise InvalidRequestError("a Qwen-Image-Edit prompt is encoded with its source image",
                                  field="media", expected=[MediaRole.IMAGE.value], actual=[])

    def sources(self, item: Mapping[MediaRole, torch.Tensor], i: int) -> list[torch.Tensor]:
        """A prompt's source image(s) the VL reads, in order; a prompt without: refused."""
        if MediaRole.IMAGE not in item:
            raise InvalidRequestError("a Qwen-Image-Edit prompt is encoded with its source "
                                      "image", field=f"media[{i}]",
                                      expected=[MediaRole.IMAGE.value],
                                      actual=sorted(r.value for r in item))
        return [item[MediaRole.IMAGE]]

    def shown(self, image: torch.Tensor):
        """The PIL image the pipeline hands its processor for a uint8 (3, H, W) source (Edit:
        the source itself, :662-665)."""
        from PIL import Image
        return Image.fromarray(np.ascontiguousarray(image.permute(1, 2, 0).cpu().numpy()))

    def vision_inputs(self, images: torch.Tensor | Sequence[torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
        """pixel_values / image_grid_thw (one row per image) of uint8 (3, H, W) sources as the
        pipeline's processor makes them from the PIL images it holds (:241)."""
        images = [images] if isinstance(images, torch.Tensor) else list(images)
        vision = self.processor().image_processor(images=[self.shown(im) for im in images],
                                                  return_tensors="pt")
        return {"pixel_values": vision["pixel_values"], "image_grid_thw": vision["image_grid_thw"]}

    def vision_tokens(self, grid: torch.Tensor) -> list[int]:
        """<|image_pad|> tokens per image of image_grid_thw (n, 3), as the processor expands."""
        merge = self.processor().image_processor.merge_size ** 2
        return [int(g.prod()) // merge for g in grid.reshape(-1, 3)]

    def presentation_ids(self, prompt: PromptBundle, grid: torch.Tensor) -> list[int]:
        """The prompt's ids with its one <|image_pad|> expanded to the source's vision tokens."""
        tok = self.tokenizer(self.spec.encoder(QWEN))
        pad = tok.convert_tokens_to_ids(IMAGE_PAD)
        ids = list(prompt.ids_by_encoder(self.spec.encoder_names)[QWEN])
        [count] = self.vision_tokens(grid)
        at = ids.index(pad)
        return ids[:at] + [pad] * count + ids[at + 1:]

    def encode_with_media(self, encoders, prompts: Sequence[PromptBundle],
                          media: Sequence[Mapping[MediaRole, torch.Tensor]]) -> Condition:
        encoder = encoders[QWEN]
        param = next(encoder.parameters())
        window = self.spec.encoder(QWEN).max_length - self.drop
        rows = []
        for i, (prompt, item) in enumerate(zip(prompts, media)):
            vision = self.vision_inputs(self.sources(item, i))
            ids = torch.tensor([self.presentation_ids(prompt, vision["image_grid_thw"])])
            if ids.shape[1] - self.drop > window:
                raise LimitExceededError("the prompt with its source images' vision tokens is "
                                         "longer than the encoder window",
                                         field=f"prompts[{i}].{QWEN}", expected=f"<= {window}",
                                         actual=ids.shape[1] - self.drop)
            with torch.no_grad():
                hidden = encoder(input_ids=ids.to(param.device),
                                 attention_mask=torch.ones_like(ids).to(param.device),
                                 pixel_values=vision["pixel_values"].to(param.device, param.dtype),
                                 image_grid_thw=vision["image_grid_thw"].to(param.device),
                                 output_hidden_states=True, logits_to_keep=1).hidden_states[-1]
            rows.append(hidden[0, self.drop:])
        embeds = rows[0].new_zeros(len(rows), window, rows[0].shape[-1])
        keep = torch.zeros(len(rows), window, dtype=torch.long, device=rows[0].device)
        for i, row in enumerate(rows):
            embeds[i, :row.shape[0]] = row
            keep[i, :row.shape[0]] = 1
        return Condition({"prompt_embeds": embeds, "prompt_mask": keep})


class QwenEditPlusConditioner(QwenEditConditioner):
    """QwenImageEditPlusPipeline's prompt encoding: each prompt shown with its ordered source
    images (roles image, image_2, image_3: SOURCE_IMAGE_ROLES), each as a "Picture i: " vision
    block before the prompt (:239-252), the VL reading each source at the pipeline's condition
    size (CONDITION_AREA at its aspect ratio, :699-705). The ids are made once per prompt in the
    template without blocks; the blocks of a request's images are spliced in after the `drop`
    template tokens, which is the pipeline's tokenization: checked for the template at load and
    for each prompt where it is tokenized."""

    media_roles = SOURCE_IMAGE_ROLES

    def check_template(self, tok) -> None:
        super().check_template(tok)
        prefix = self.template.split("{}")[0]
        joined = tok(prefix + PICTURE.format(1))["input_ids"]
        if joined != tok(prefix)["input_ids"] + tok(PICTURE.format(1))["input_ids"]:
            raise ConfigError("the tokenizer merges the template's user header with a picture "
                              "block", field="weights_path.tokenizer",
                              expected=tok(prefix)["input_ids"] + tok(PICTURE.format(1))[
                                  "input_ids"], actual=joined)

    def tokenize_one(self, encoder: EncoderSpec, text: str,
                     field: str) -> tuple[tuple[int, ...], bool]:
        ids, cut = super().tokenize_one(encoder, text, field)
        tok = self.tokenizer(encoder)
        block = tok(PICTURE.format(1))["input_ids"]
        shown = tok(self.template.format(PICTURE.format(1) + text))["input_ids"]
        if shown != list(ids[:self.drop]) + block + list(ids[self.drop:]):
            raise InvalidRequestError("the prompt's first characters tokenize together with "
                                      "the template's user header, so its ids would not be "
                                      "the pipeline's after the picture blocks (e.g. a leading "
                                      "line break)", field=field, expected="a prompt that "
                                      "starts a new token", actual=text[:32])
        return ids, cut

    def sources(self, item: Mapping[MediaRole, torch.Tensor], i: int) -> list[torch.Tensor]:
        present = [r for r in SOURCE_IMAGE_ROLES if r in item]
        if not present or present != list(SOURCE_IMAGE_ROLES[:len(present)]) or \
                set(item) - set(present):
            raise InvalidRequestError("a Qwen-Image-Edit-Plus prompt is encoded with its "
                                      "ordered source images (image, then image_2, image_3)",
                                      field=f"media[{i}]",
                                      expected=[r.value for r in SOURCE_IMAGE_ROLES],
                                      actual=sorted(r.value for r in item))
        return [item[r] for r in present]

    def shown(self, image: torch.Tensor):
        """The source resized to its condition size as the pipeline resizes it for the VL
        (VaeImageProcessor.resize: PIL, lanczos, :705); the VAE reads the source as given."""
        from diffusers.image_processor import VaeImageProcessor
        height, width = calculate_dimensions(CONDITION_AREA, int(image.shape[1]),
                                             int(image.shape[2]))
        return VaeImageProcessor(vae_scale_factor=16).resize(super().shown(image), height, width)

    def presentation_ids(self, prompt: PromptBundle, grid: torch.Tensor) -> list[int]:
        """The prompt's ids with one "Picture i: " block per image of image_grid_thw (n, 3)
        after the template's user header, each <|image_pad|> expanded to its vision tokens."""
        tok = self.tokenizer(self.spec.encoder(QWEN))
        pad = tok.convert_tokens_to_ids(IMAGE_PAD)
        ids = list(prompt.ids_by_encoder(self.spec.encoder_names)[QWEN])
        blocks = []
        for i, count in enumerate(self.vision_tokens(grid)):
            block = tok(PICTURE.format(i + 1))["input_ids"]
            at = block.index(pad)
            blocks += block[:at] + [pad] * count + block[at + 1:]
        return ids[:self.drop] + blocks + ids[self.drop:]


class QwenImageDenoiser:
    time_convention = TimeConvention.NOISE_LEVEL
    model_time_scale = 1000.0       # the pipeline's timestep; the transformer gets it / 1000
    guidance_form = NORM_RESCALED_CFG

    def forward(self, models, state, sigma, model_time, cond: Condition, media, guidance):
        shapes = [tuple(int(v) for v in s) for s in media["img_shapes"][0].tolist()]
        source = media.get(SOURCE_LATENTS)        # edit: the source image's tokens follow
        hidden = state if source is None else torch.cat(
            [state, source.to(state.dtype).expand(state.shape[0], -1, -1)], dim=1)
        return models["transformer"](
            hidden_states=hidden, timestep=model_time.to(state.dtype) / 1000, guidance=None,
            encoder_hidden_states=cond["prompt_embeds"],
            encoder_hidden_states_mask=cond["prompt_mask"],
            img_shapes=[shapes] * state.shape[0], return_dict=False)[0][:, :state.shape[1]]


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, z, h, w) -> (B, (h/2)(w/2), 4 z): 2x2 patches as tokens (the pipeline's packing)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """(B, rows*cols, 4 z) -> (B, z, 2 rows, 2 cols)."""
    b, _, channels = tokens.shape
    x = tokens.view(b, rows, cols, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels // 4, 2 * rows, 2 * cols)


class QwenImageCodec(OneLatentCodec):
    latent_name, label = "image_latent", "Qwen-Image"     # packed tokens (B, L, 4 z)

    def __init__(self, vae: QwenImageVAE, in_channels: int,
                 source_roles: tuple[MediaRole, ...] = (MediaRole.IMAGE,)):
        self.vae, self.in_channels = vae, in_channels
        self.source_roles = source_roles      # an edit's source images, in order

    def grid(self, sampling: SamplingSpec) -> tuple[int, int]:
        multiple = 2 * self.vae.scale_factor
        for name in ("height", "width"):
            value = getattr(sampling, name)
            if value % multiple:
                raise InvalidRequestError(f"{self.label} generates sizes divisible by "
                                          f"{multiple} (VAE x 2x2 packing); nothing is resized",
                                          field=f"sampling.{name}",
                                          expected=f"a multiple of {multiple}", actual=value)
        if sampling.num_frames != 1:
            raise InvalidRequestError(f"{self.label} generates single images",
                                      field="sampling.num_frames", expected=1,
                                      actual=sampling.num_frames)
        return sampling.height // multiple, sampling.width // multiple

    def state_shape(self, sampling: SamplingSpec) -> tuple[int, ...]:
        rows, cols = self.grid(sampling)
        return (rows * cols, self.in_channels)

    def source_grid(self, image: torch.Tensor, field: str = "media.image") -> tuple[int, int]:
        """The packed grid of an edit's source image: uint8 (3, H, W) at the size the pipeline
        would resize it to (`edit_source_size`); any other size is refused, never resized."""
        if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] != 3:
            raise MediaFormatError("an edit's source image is uint8 (3, H, W) RGB",
                                   field=field, expected="uint8 (3, H, W)",
                                   actual=f"{image.dtype} {tuple(image.shape)}")
        height, width = int(image.shape[1]), int(image.shape[2])
        expected = edit_source_size(height, width)
        if (height, width) != expected:
            raise MediaFormatError("Qwen-Image-Edit takes the source image at the size its "
                                   "pipeline resizes it to (about 1024 x 1024 pixels at its "
                                   "aspect ratio, sides multiples of 32); nothing is resized",
                                   field=field, expected=f"(3, {expected[0]}, "
                                   f"{expected[1]})", actual=f"{tuple(image.shape)}")
        multiple = 2 * self.vae.scale_factor
        return height // multiple, width // multiple

    def encode_media(self, modules, sampling, media) -> MediaCondition:
        taken = [r for r in self.source_roles if r in media]
        if set(media) - set(taken) or taken != list(self.source_roles[:len(taken)]):
            raise InvalidRequestError("Qwen-Image takes its source image(s) in order (edit) or "
                                      "no media", field="media",
                                      expected=[r.value for r in self.source_roles],
                                      actual=sorted(r.value for r in media))
        rows, cols = self.grid(sampling)
        if not taken:
            return MediaCondition(inputs={"img_shapes": torch.tensor([[[1, rows, cols]]])},
                                  key=(rows, cols))
        # each source VAE-encoded and packed on its own, the tokens concatenated in order, one
        # img_shapes entry each (pipeline_qwenimage_edit_plus.py:469-491, :753-761)
        grids = [self.source_grid(media[r], f"media.{r.value}") for r in taken]
        packed = torch.cat([pack(self.vae.encode(modules["vae"], media[r][None]))
                            for r in taken], dim=1)
        shapes = torch.tensor([[[1, rows, cols], *[[1, r, c] for r, c in grids]]])
        return MediaCondition(inputs={"img_shapes": shapes, SOURCE_LATENTS: packed},
                              key=(rows, cols, *grids))

    def decode(self, latent_name: str, modules: Mapping[str, nn.Module], latent: torch.Tensor,
               sampling: SamplingSpec):
        self.check_latent_name(latent_name)
        rows, cols = self.grid(sampling)
        check_latent_shape(latent, (rows * cols, self.in_channels), latent_name)
        return self.vae.decode(modules["vae"], unpack(latent.float(), rows, cols))


class QwenImageFamily(CheckpointFamily):
    """QwenImagePipeline checkpoints (Qwen-Image, Qwen-Image-2512), QwenImageEditPipeline ones
    (Qwen-Image-Edit: a `processor` component, the edit task only) and QwenImageEditPlusPipeline
    ones (Qwen-Image-Edit-2509: the same components, presented as its pipeline presents 1 to 3
    ordered source images; the class is all that tells the two edit presentations apart)."""

    entry_name = "qwen_image"
    template, drop = T2I_TEMPLATE, T2I_DROP
    edit_template, edit_drop = EDIT_TEMPLATE, EDIT_DROP
    edit_plus_template, edit_plus_drop = EDIT_PLUS_TEMPLATE, EDIT_PLUS_DROP

    def __init__(self, root: str | Path, options: Mapping | None = None):
        super().__init__(root, options)
        self.edits = "processor" in self.index        # the vision input of the source image
        self.edit_plus = self.edits and self.pipeline_class == EDIT_PLUS_PIPELINE
        if self.edit_plus:
            self.template, self.drop = self.edit_plus_template, self.edit_plus_drop
        elif self.edits:
            self.template, self.drop = self.edit_template, self.edit_drop
        sources = SOURCE_IMAGE_ROLES if self.edit_plus else (MediaRole.IMAGE,)
        transformer = read_json(self.root, "transformer", "config.json")
        self.schedule = FlowSchedule(self.root)
        vae = QwenImageVAE(self.root)
        packed = 4 * vae.z_dim
        if transformer.get("in_channels") != packed:
            raise ConfigError("the transformer's channels are not the VAE's packed latents",
                              field="weights_path.transformer.in_channels", expected=packed,
                              actual=transformer.get("in_channels"))
        if transformer.get("guidance_embeds") or transformer.get("zero_cond_t") or \
                transformer.get("use_additional_t_cond") or transformer.get("use_layer3d_rope"):
            raise ConfigError("a guidance-distilled, zero-cond-t or layered Qwen-Image "
                              "transformer is not served", field="weights_path.transformer",
                              expected="QwenImagePipeline's transformer", actual=transformer)
        encoders = (EncoderSpec(QWEN, "text_encoder", "tokenizer",
                                self.drop + self.options.max_sequence_length, Overflow.REJECT,
                                QWEN2_5_VL_ETP_PLAN,
                                encoder_vocab_size(self.root, "text_encoder")),)
        side = 128 * vae.scale_factor       # the pipeline's default_sample_size x VAE: 1024 px
        self.spec = FamilySpec(
            name="qwen_image", io_spec=image_io_spec(Layout.TOKENS),
            tasks={Task.EDIT: (MediaRole.IMAGE,)} if self.edits else {Task.T2I: ()},
            media_encoders=("vae",) if self.edits else (),
            optional_media={Task.EDIT: sources[1:]} if self.edit_plus else {},
            time_convention=TimeConvention.NOISE_LEVEL, model_time_scale=1000.0,
            guidance=QWEN_IMAGE_GUIDANCE, transformers=("transformer",),
            lora_targets={"transformer": QWEN_IMAGE_LORA_TARGETS}, encoders=encoders,
            decoders={"image_latent": ("vae",)},
            sampling_defaults={"height": side, "width": side, "num_frames": 1})
        conditioner = QwenEditPlusConditioner if self.edit_plus else \
            QwenEditConditioner if self.edits else QwenConditioner
        self.conditioner = conditioner(self.spec, self.root, self.template, self.drop)
        # the template check needs the tokenizer: at load where the folder ships one; an
        # architecture description (no tokenizers) is checked where its tokenizer is first loaded
        if (self.root / encoders[0].tokenizer).is_dir():
            self.conditioner.tokenizer(encoders[0])
        self.denoiser = QwenImageDenoiser()
        self.codec = QwenImageCodec(vae, packed, sources)

    def sigmas(self, sampling: SamplingSpec) -> torch.Tensor:
        n = sampling.num_steps
        custom = None if self.schedule.config.get("use_flow_sigmas") else \
            np.linspace(1.0, 1 / n, n)
        sigmas = self.schedule.sigmas(n, self.codec.state_shape(sampling)[0], custom)
        if not bool(torch.isfinite(sigmas).all()):     # shift_terminal stretches 1 step to 0/0
            raise InvalidRequestError("the checkpoint's schedule is not finite at this step "
                                      "count (its shift_terminal needs at least 2 steps)",
                                      field="sampling.num_steps", expected=">= 2", actual=n)
        return sigmas

    def schedule_shift(self, sampling: SamplingSpec) -> float:
        return self.schedule.static_shift(self.codec.state_shape(sampling)[0])

    def validate_request(self, request: RolloutRequest, limits: RequestLimits):
        if self.spec.guidance.guides(request.sampling.guidance_scale) and \
                request.prompt.negative is None:
            raise InvalidRequestError("Qwen-Image runs true CFG only with a negative prompt "
                                      "(do_true_cfg, pipeline_qwenimage.py:564): give one (\" \" "
                                      "is the pipeline's usual) or a guidance_scale <= 1",
                                      field="prompt.negative", expected="a negative prompt",
                                      actual=None, request_id=request.request_id)
        media = super().validate_request(request, limits)
        with request_errors(request.request_id):
            self.sigmas(request.sampling)
            for role in self.codec.source_roles:     # an edit's source images, before any work
                if role in media:
                    check_source_image(media[role], limits, f"media.{role.value}")
                    self.codec.source_grid(media[role], f"media.{role.value}")
        return media
