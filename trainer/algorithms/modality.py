"""Per-modality advantages for joint audio-video models (OmniNFT-style): each latent stream of
the sampler state (video, audio) gets its own advantage from the rewards that judge it, and its
entries are trained with that advantage only, so an audio reward does not move the video stream.

    R_s,i = sum_{k judges s} w_k R_k,i / sum_{k judges s, present} w_k     per stream s
    A_s   = group_advantages(R_s)                                          (the run's settings)

A reward may judge several streams (an audio-video alignment score judges both); a missing
optional reward (NaN) is left out of that sample's stream reward and the weights renormalised,
as in the combined reward. No public OmniNFT code was found (verl-omni a1139ba ships none): the
definition follows the description of separate advantages per stream and is tested on closed
forms. Shapes: B = samples, *S = sampler state.
"""
from __future__ import annotations

from typing import Hashable, Mapping, Sequence

import torch

from contract import ConfigError, InvalidRequestError, NonFiniteError
from trainer.algorithms.advantages import group_advantages


def stream_rewards(reward_values: Mapping[str, torch.Tensor], weights: Mapping[str, float],
                   streams: Mapping[str, Sequence[str]]) -> dict[str, torch.Tensor]:
    """stream -> (B,) float64 weighted mean of the rewards that judge it."""
    if not streams:
        raise ConfigError("per-modality advantages need at least one stream", field="streams",
                          actual={})
    out = {}
    for stream, scorers in streams.items():
        if not scorers:
            raise ConfigError(f"stream {stream!r} is judged by no reward", field=f"streams."
                              f"{stream}", expected="one or more scorer names", actual=[])
        unknown = sorted(set(scorers) - set(reward_values))
        if unknown:
            raise ConfigError(f"stream {stream!r} names rewards the report does not hold",
                              field=f"streams.{stream}", expected=sorted(reward_values),
                              actual=unknown)
        num, den = None, None
        for name in scorers:
            values = reward_values[name].double()
            w = float(weights.get(name, 0.0))
            if w <= 0:
                raise ConfigError("a stream's reward needs a weight > 0", field=f"weights.{name}",
                                  expected="> 0", actual=w)
            present = ~torch.isnan(values)
            term = torch.where(present, values * w, torch.zeros_like(values))
            num = term if num is None else num + term
            den = present.double() * w if den is None else den + present.double() * w
        if bool((den == 0).any()):
            row = int(torch.nonzero(den == 0)[0])
            raise NonFiniteError(f"row {row} has no reward judging stream {stream!r} (every "
                                 "one missing)", field=f"streams.{stream}")
        out[stream] = num / den
    return out


def stream_advantages(reward_values: Mapping[str, torch.Tensor], weights: Mapping[str, float],
                      streams: Mapping[str, Sequence[str]], group_ids: Sequence[Hashable], *,
                      global_std: bool = True, ddof: int = 0, eps: float = 1e-4,
                      adv_clip_max: float | None = None) -> dict[str, torch.Tensor]:
    """stream -> (B,) float32 group advantages of its own reward (`stream_rewards`)."""
    return {s: group_advantages(r, group_ids, global_std=global_std, ddof=ddof, eps=eps,
                                adv_clip_max=adv_clip_max)
            for s, r in stream_rewards(reward_values, weights, streams).items()}


def stream_masks(parts: Mapping[str, torch.Tensor], state_shape: Sequence[int],
                 streams: Sequence[str]) -> dict[str, torch.Tensor]:
    """stream -> (*S) bool: the state entries of each stream, from the codec's split of an
    index state (parts: name -> tensor of entry indices, as `Codec.split_state` returns for
    arange(numel) shaped (1, *S)). Streams must be disjoint; entries of no stream (condition
    tokens) are in no mask."""
    numel = 1
    for n in state_shape:
        numel *= int(n)
    out, taken = {}, torch.zeros(numel, dtype=torch.bool)
    for stream in streams:
        if stream not in parts:
            raise ConfigError("not a latent stream of this family", field=f"streams.{stream}",
                              expected=sorted(parts), actual=stream)
        index = parts[stream].reshape(-1).round().long()
        mask = torch.zeros(numel, dtype=torch.bool)
        mask[index] = True
        if bool((mask & taken).any()):
            raise InvalidRequestError("latent streams overlap in the state",
                                      field=f"streams.{stream}")
        taken |= mask
        out[stream] = mask.reshape(tuple(state_shape))
    return out
