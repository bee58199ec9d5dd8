"""Input checks shared by the sampler math. Inputs that break the contract raise typed errors."""
from __future__ import annotations

import torch

from contract.errors import InvalidRequestError


def check_float_tensor(value: object, field: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidRequestError("expected a torch.Tensor", field=field, expected="torch.Tensor",
                                  actual=type(value).__name__)
    if not value.is_floating_point():
        raise InvalidRequestError("expected a floating tensor", field=field, expected="floating",
                                  actual=str(value.dtype))
    return value


def check_row_sigma(sigma: object, batch: int, field: str) -> torch.Tensor:
    """A per-row noise level: shape (B,), values in [0, 1]."""
    sigma = check_float_tensor(sigma, field)
    if tuple(sigma.shape) != (batch,):
        raise InvalidRequestError("a per-row sigma must have shape (B,)", field=field,
                                  expected=(batch,), actual=tuple(sigma.shape))
    if not bool(((sigma >= 0) & (sigma <= 1)).all()):
        raise InvalidRequestError("sigma must lie in [0, 1]", field=field, expected="[0, 1]",
                                  actual=sigma.tolist())
    return sigma


def check_per_row(value: object, batch: int, field: str) -> torch.Tensor:
    """A (B,) floating tensor (no range rule)."""
    value = check_float_tensor(value, field)
    if tuple(value.shape) != (batch,):
        raise InvalidRequestError("expected one value per row", field=field, expected=(batch,),
                                  actual=tuple(value.shape))
    return value


def check_same_shape(value: object, like: torch.Tensor, field: str) -> torch.Tensor:
    value = check_float_tensor(value, field)
    if value.shape != like.shape:
        raise InvalidRequestError("shape does not match the sample", field=field,
                                  expected=tuple(like.shape), actual=tuple(value.shape))
    return value


def rows(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """(B,) -> (B, 1, ..., 1) so a per-row value broadcasts over a sample of rank `ndim`."""
    return t.reshape(t.shape[0], *([1] * (ndim - 1)))
