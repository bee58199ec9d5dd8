"""ImageReward (Xu et al. 2023) from its own checkpoint, on transformers' BLIP modules.

    h = BLIP text encoder(prompt tokens, cross-attending to ViT(image))[:, 0]   ([CLS] state)
    image_reward = (head(h) - 0.16717362830052426) / 1.0333394966054072
with the head of rewards/heads.py and the normalisation constants of the reference model.

Why not the `image-reward` package: its 1.5 release pins timm==0.6.13 (and fairscale, datasets),
which would replace the timm>=1.0 that open_clip needs here. The architecture it loads is BLIP's
ViT (`visual_encoder`) and BLIP's BERT with cross-attention (`text_encoder`, mode "multimodal",
bidirectional); transformers ships the same modules as BlipVisionModel and BlipTextModel
(called with is_decoder=False). This module reads the real files -- `ImageReward.pt` (a flat
state dict with BLIP's key names), `med_config.json` (the text encoder's BERT config) and a
bert-base-uncased tokenizer dir, to which BLIP adds "[DEC]" (bos) and "[ENC]" -- and renames
BLIP's vision keys to transformers' (text keys already match). Prompts are tokenized as the
reference does: padding to 35 tokens, truncation at 35.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field

from contract import ConfigError, ScorerOutput
from rewards.aesthetic import load_torch_file
from rewards.base import ScoreRequest
from rewards.embedding import CLIP_MEAN, CLIP_STD, ok_output, pixels_to_model
from rewards.heads import load_mlp_head
from rewards.media import image_prompt_chunks

REWARD_MEAN = 0.16717362830052426
REWARD_STD = 1.0333394966054072

# BLIP ViT key -> transformers BlipVisionModel key (regex, replacement)
_VISION_KEYS = [
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"^blocks\.(\d+)\.mlp\.(fc\d)\.", r"encoder.layers.\1.mlp.\2."),
    (r"^norm\.", "post_layernorm."),
]
_UNUSED = ("blip.vision_proj.", "blip.text_proj.", "blip.text_encoder.embeddings.position_ids")


class BlipDims(BaseModel):
    """ImageReward's ViT: BLIP 'large' at 224 (ViT-L/16)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    image_size: int = 224
    patch_size: int = 16
    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    intermediate_size: int = 4096


class ImageRewardScorerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "image_reward"
    checkpoint: str = Field(description="ImageReward.pt")
    med_config: str = Field(description="med_config.json (BERT config of the text encoder)")
    tokenizer_dir: str = Field(description="local bert-base-uncased tokenizer dir")
    vision: BlipDims = Field(default_factory=BlipDims)
    max_text_tokens: int = Field(35, ge=2)
    artifact: str = "image"
    max_batch: int = Field(16, ge=1)
    device: str = "cpu"


def tokenizer_with_specials(path: str):
    """BLIP's init_tokenizer on a local dir: bert-base-uncased + bos "[DEC]" + "[ENC]"."""
    from transformers import BertTokenizer
    tok = BertTokenizer.from_pretrained(str(path), local_files_only=True)
    tok.add_special_tokens({"bos_token": "[DEC]"})
    tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tok


def build_blip(dims: BlipDims, med: Mapping[str, Any]):
    """(BlipVisionModel, BlipTextModel with cross-attention) for these dims and med config."""
    from transformers import BlipTextConfig, BlipVisionConfig
    from transformers.models.blip.modeling_blip import BlipVisionModel
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    vision = BlipVisionModel(BlipVisionConfig(**dims.model_dump(), layer_norm_eps=1e-6,
                                              hidden_act="gelu"))
    text_cfg = BlipTextConfig(
        vocab_size=med["vocab_size"], hidden_size=med["hidden_size"],
        encoder_hidden_size=dims.hidden_size, intermediate_size=med["intermediate_size"],
        num_hidden_layers=med["num_hidden_layers"], num_attention_heads=med["num_attention_heads"],
        max_position_embeddings=med["max_position_embeddings"], hidden_act=med["hidden_act"],
        layer_norm_eps=med["layer_norm_eps"], pad_token_id=med.get("pad_token_id", 0),
        bos_token_id=None, sep_token_id=None, eos_token_id=None,
        hidden_dropout_prob=med.get("hidden_dropout_prob", 0.0),
        attention_probs_dropout_prob=med.get("attention_probs_dropout_prob", 0.0))
    return vision.eval(), BlipTextModel(text_cfg, add_pooling_layer=False).eval()


def _rename_vision(key: str) -> str | None:
    for pattern, repl in _VISION_KEYS:
        if re.match(pattern, key):
            return re.sub(pattern, repl, key)
    return None


def to_blip_state_dict(vision, text) -> dict[str, torch.Tensor]:
    """transformers modules -> ImageReward.pt key names (inverse of the loader's renaming)."""
    inverse = {}
    for key in vision.state_dict():
        for blip_key in _blip_vision_keys(vision):
            if _rename_vision(blip_key) == key:
                inverse[key] = blip_key
    out = {f"blip.visual_encoder.{inverse[k]}": v.contiguous()
           for k, v in vision.state_dict().items()}
    out.update({f"blip.text_encoder.{k}": v.contiguous() for k, v in text.state_dict().items()})
    return out


def _blip_vision_keys(vision) -> list[str]:
    n = vision.config.num_hidden_layers
    keys = ["cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias",
            "norm.weight", "norm.bias"]
    for i in range(n):
        for part in ("attn.qkv", "attn.proj", "norm1", "norm2", "mlp.fc1", "mlp.fc2"):
            keys += [f"blocks.{i}.{part}.weight", f"blocks.{i}.{part}.bias"]
    return keys


class ImageRewardScorer:
    primary = "image_reward"

    def __init__(self, config: ImageRewardScorerConfig):
        self.config = config
        self.name = config.name
        self.required_artifacts = (config.artifact,)
        med_path = Path(config.med_config)
        try:
            med = json.loads(med_path.read_text())
            med["vocab_size"], med["hidden_size"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"not a BLIP med_config.json: {e}", field=f"{self.name}.med_config",
                              actual=str(med_path)) from e
        try:
            self._tokenizer = tokenizer_with_specials(config.tokenizer_dir)
        except (OSError, ValueError) as e:
            raise ConfigError(f"could not load the BERT tokenizer: {e}",
                              field=f"{self.name}.tokenizer_dir",
                              actual=config.tokenizer_dir) from e
        if len(self._tokenizer) != med["vocab_size"]:
            raise ConfigError("tokenizer (+ [DEC], [ENC]) and med_config vocab_size differ",
                              field=f"{self.name}.tokenizer_dir", expected=med["vocab_size"],
                              actual=len(self._tokenizer))
        state = load_torch_file(config.checkpoint, f"{self.name}.checkpoint")
        if not isinstance(state, dict) or not any(k.startswith("blip.") for k in state):
            raise ConfigError("not an ImageReward checkpoint (blip.* / mlp.* keys)",
                              field=f"{self.name}.checkpoint",
                              actual=sorted(state)[:8] if isinstance(state, dict)
                              else type(state).__name__)
        self._vision, self._text = build_blip(config.vision, med)
        self._load(state)
        self._vision.to(config.device).requires_grad_(False)
        self._text.to(config.device).requires_grad_(False)

    def _load(self, state: Mapping[str, torch.Tensor]) -> None:
        field = f"{self.name}.checkpoint"
        vision, text, head, unknown = {}, {}, {}, []
        for key, value in state.items():
            if key.startswith("blip.visual_encoder."):
                new = _rename_vision(key[len("blip.visual_encoder."):])
                (vision.__setitem__(new, value) if new else unknown.append(key))
            elif key.startswith("blip.text_encoder."):
                if not key.startswith(_UNUSED):
                    text[key[len("blip.text_encoder."):]] = value
            elif key.startswith("mlp."):
                head[key[len("mlp."):]] = value
            elif not key.startswith(_UNUSED):
                unknown.append(key)
        if unknown:
            raise ConfigError("unexpected keys in the ImageReward checkpoint", field=field,
                              actual=unknown[:8])
        for module, part, name in ((self._vision, vision, "visual_encoder"),
                                   (self._text, text, "text_encoder")):
            try:
                module.load_state_dict(part, strict=True)
            except RuntimeError as e:
                raise ConfigError(f"blip.{name} weights do not fit the configured architecture: "
                                  f"{str(e)[:400]}", field=field) from e
        self._head = load_mlp_head(head, self._text.config.hidden_size, f"{field}.mlp").to(
            self.config.device)

    @torch.inference_mode()
    def score(self, request: ScoreRequest) -> ScorerOutput:
        cfg = self.config
        out = []
        for images, prompts in image_prompt_chunks(request.artifacts, request.prompts,
                                                   cfg.artifact, self.name, cfg.max_batch):
            x = pixels_to_model(images, cfg.vision.image_size, CLIP_MEAN, CLIP_STD).to(cfg.device)
            image_embeds = self._vision(pixel_values=x).last_hidden_state
            tok = self._tokenizer(list(prompts), padding="max_length", truncation=True,
                                  max_length=cfg.max_text_tokens,
                                  return_tensors="pt").to(cfg.device)
            atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=cfg.device)
            hidden = self._text(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"],
                                encoder_hidden_states=image_embeds, encoder_attention_mask=atts,
                                is_decoder=False).last_hidden_state[:, 0].float()
            out.append(self._head(hidden))
        raw = torch.cat(out)
        return ok_output(self.name, {"image_reward": (raw - REWARD_MEAN) / REWARD_STD,
                                     "head_output": raw})
