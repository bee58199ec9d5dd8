"""LTX-2's text side: Gemma 3 (every hidden state) -> LTX2TextConnectors -> video and audio
contexts, exactly as LTX2Pipeline encodes prompts (diffusers 0.42.1, pipeline_ltx2.py).

    ids      prompt.strip() tokenized by the checkpoint's Gemma tokenizer (BOS added), left-padded
             with the pad id to `max_sequence_length`, attention mask 1 on real tokens (:331-343)
    hidden   Gemma3ForConditionalGeneration(ids, mask, output_hidden_states=True): the embedding
             output and every layer's, stacked on a last axis and flattened: (P, L, D * (n + 1))
             (:345-355); only the hidden states are used, so logits are kept for one position
    contexts connectors(hidden, mask, padding_side="left") -> video context (P, L, Dv), audio
             context (P, L, Da), the connectors' binary mask (P, L) (:1251-1253)

The text encoder and the connectors run together in the TextEncoder stage, as one module
(`LTX2TextStack`), so the DiT stage receives the contexts it attends to and nothing else.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import nn

from adapters.diffusers_parts import TokenizingConditioner
from adapters.family import EncoderSpec, ETPPlan
from contract import Condition, ConfigError, LimitExceededError, PromptBundle

GEMMA = "gemma"                      # the encoder's name (keys its ids in a PromptBundle)
TEXT_ENCODER, CONNECTORS = "text_encoder", "connectors"

# Gemma 3's decoder layers, Megatron-split by heads: q / k / v and the gated MLP's gate / up
# column-parallel, o / down row-parallel, the (scaled) token embedding vocab-parallel. Gemma 3
# uses grouped-query attention: etp must divide the key/value heads (then it also divides the
# query heads). The connectors are small and replicated.
GEMMA3_ETP_PLAN = ETPPlan(
    layers=f"{TEXT_ENCODER}.model.language_model.layers",
    column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
            "mlp.up_proj"),
    row=("self_attn.o_proj", "mlp.down_proj"),
    vocab=f"{TEXT_ENCODER}.model.language_model.embed_tokens", heads="num_key_value_heads")


class LTX2TextStack(nn.Module):
    """Gemma 3 + LTX2TextConnectors as one encoder: (ids, mask) -> (video ctx, audio ctx, mask)."""

    def __init__(self, text_encoder: nn.Module, connectors: nn.Module):
        super().__init__()
        self.text_encoder, self.connectors = text_encoder, connectors

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask,
                                output_hidden_states=True, logits_to_keep=1)
        hidden = torch.stack(out.hidden_states, dim=-1).flatten(2, 3)       # (P, L, D (n+1))
        dtype = next(self.connectors.parameters()).dtype
        return self.connectors(hidden.to(dtype), attention_mask, padding_side="left")


class GemmaConditioner(TokenizingConditioner):
    """Prompts -> Gemma ids (stripped, as the pipeline strips them) -> LTX-2 contexts."""

    padding_side = "left"           # Gemma's, as the pipeline sets it

    def __init__(self, spec, root: Path, registers: int | None):
        super().__init__(spec, root)
        window = spec.encoder(GEMMA).max_length
        if registers and window % registers:        # connectors.py:290-294 would raise
            raise ConfigError("the text window must be a multiple of the connectors' learnable "
                              "registers", field="rollout.adapter_options.max_sequence_length",
                              expected=f"a multiple of {registers}", actual=window)

    def tokenize_one(self, encoder: EncoderSpec, text: str,
                     field: str) -> tuple[tuple[int, ...], bool]:
        return super().tokenize_one(encoder, text.strip(), field)

    def left_padded(self, prompts: Sequence[PromptBundle]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, mask) (P, window) long: each prompt's ids right-aligned behind pad ids."""
        encoder = self.spec.encoder(GEMMA)
        tok = self.tokenizer(encoder)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        window = encoder.max_length
        ids = torch.full((len(prompts), window), int(pad), dtype=torch.long)
        mask = torch.zeros((len(prompts), window), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            seq = prompt.ids_by_encoder(self.spec.encoder_names)[GEMMA]
            if len(seq) > window:
                raise LimitExceededError("prompt ids are longer than the encoder window",
                                         field=f"prompts[{i}].{GEMMA}",
                                         expected=f"<= {window}", actual=len(seq))
            if seq:
                ids[i, window - len(seq):] = torch.tensor(seq, dtype=torch.long)
                mask[i, window - len(seq):] = 1
        return ids, mask

    def encode(self, encoders: Mapping[str, nn.Module],
               prompts: Sequence[PromptBundle]) -> Condition:
        stack = encoders[GEMMA]
        device = next(stack.parameters()).device
        ids, mask = self.left_padded(prompts)
        with torch.no_grad():
            video, audio, context_mask = stack(ids.to(device), mask.to(device))
        return Condition({"video_context": video, "audio_context": audio,
                          "context_mask": context_mask})
