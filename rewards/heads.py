"""The MLP score head shared by the LAION aesthetic predictor and ImageReward.

Both checkpoints store the same module (the improved-aesthetic-predictor layout, which ImageReward
reuses): `layers` = Linear(d, 1024), Dropout, Linear(1024, 128), Dropout, Linear(128, 64),
Dropout, Linear(64, 16), Linear(16, 1) -- no activations between the linear layers, so in
evaluation the head is one affine map of its input.
State-dict keys: layers.{0,2,4,6,7}.{weight,bias}.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from contract import ConfigError

HIDDEN = (1024, 128, 64, 16)


class LinearMLPHead(nn.Module):
    def __init__(self, input_size: int):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, HIDDEN[0]), nn.Dropout(0.2),
            nn.Linear(HIDDEN[0], HIDDEN[1]), nn.Dropout(0.2),
            nn.Linear(HIDDEN[1], HIDDEN[2]), nn.Dropout(0.1),
            nn.Linear(HIDDEN[2], HIDDEN[3]),
            nn.Linear(HIDDEN[3], 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, d) -> (N,)"""
        return self.layers(x).squeeze(-1)


def load_mlp_head(state: Mapping[str, torch.Tensor], input_size: int, field: str) -> LinearMLPHead:
    """A head from its state dict; typed errors for missing / extra keys or a wrong input size."""
    head = LinearMLPHead(input_size)
    want = set(head.state_dict())
    got = set(state)
    if got != want:
        raise ConfigError("not an MLP score head state dict (layers.{0,2,4,6,7}.weight/bias)",
                          field=field, expected=sorted(want - got) or None,
                          actual=sorted(got - want)[:8] or sorted(got)[:8])
    first = state["layers.0.weight"]
    if tuple(first.shape) != (HIDDEN[0], input_size):
        raise ConfigError("MLP head input size does not match the image embedding",
                          field=field, expected=(HIDDEN[0], input_size), actual=tuple(first.shape))
    try:
        head.load_state_dict(dict(state), strict=True)
    except RuntimeError as e:
        raise ConfigError(f"MLP head weights do not fit: {e}", field=field) from e
    return head.eval().requires_grad_(False)
