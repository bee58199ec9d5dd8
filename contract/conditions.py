"""The encoded condition of a batch of prompts: named per-row tensors, defined by the family.

Every model family encodes prompts into a few named tensors with a leading row axis (SD3:
`prompt_embeds` (B, L, D) + `pooled` (B, P); FLUX adds nothing but T5 + pooled CLIP; tiny_t2i:
`hidden`, `mask`, `pooled`). The engine, the learner and the step function only ever cat /
select / repeat rows and compare shapes, so one generic type serves every family: the family's
conditioner chooses the names, its denoiser reads them.

`token_ids` records, per prompt and per encoder, the ids the encoder saw (the trainer's token
check compares them with the ids it holds). Row operations keep it in step with the tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from contract.errors import InvalidRequestError

TokenIds = Mapping[str, tuple[int, ...]]     # encoder name -> the ids it saw for one prompt


@dataclass(frozen=True)
class Condition:
    """tensors: name -> (B, ...) tensor, all with the same B; token_ids: B entries or ()."""

    tensors: Mapping[str, torch.Tensor]
    token_ids: tuple[TokenIds, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.tensors:
            raise InvalidRequestError("a condition needs at least one tensor", field="tensors",
                                      expected="name -> (B, ...)", actual={})
        rows = {name: int(t.shape[0]) for name, t in self.tensors.items()}
        if len(set(rows.values())) != 1:
            raise InvalidRequestError("condition tensors disagree on the row count",
                                      field="tensors", expected="one B", actual=rows)
        if self.token_ids and len(self.token_ids) != self.rows:
            raise InvalidRequestError("token_ids must have one entry per row", field="token_ids",
                                      expected=self.rows, actual=len(self.token_ids))

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise InvalidRequestError("the condition has no tensor of this name",
                                      field=f"condition.{name}", expected=sorted(self.tensors),
                                      actual=name) from None

    def get(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)

    @property
    def rows(self) -> int:
        return int(next(iter(self.tensors.values())).shape[0])

    def batch_key(self) -> tuple:
        """What rows must share to run in one forward: names, per-row shapes and dtypes."""
        return tuple((name, tuple(t.shape[1:]), str(t.dtype))
                     for name, t in sorted(self.tensors.items()))

    def index_select(self, rows: torch.Tensor | Sequence[int]) -> "Condition":
        index = torch.as_tensor(rows, dtype=torch.long)
        ids = tuple(self.token_ids[i] for i in index.tolist()) if self.token_ids else ()
        return Condition({k: t[index.to(t.device)] for k, t in self.tensors.items()}, ids)

    def repeat_rows(self, repeats: Sequence[int]) -> "Condition":
        """Row i repeated repeats[i] times (prompt-level -> sample-level)."""
        if len(repeats) != self.rows:
            raise InvalidRequestError("one repeat count per condition row", field="repeats",
                                      expected=self.rows, actual=len(repeats))
        index = torch.repeat_interleave(torch.arange(self.rows), torch.tensor(list(repeats)))
        return self.index_select(index)

    def expand_rows(self, rows: int) -> "Condition":
        """A one-row condition (one prompt) -> `rows` identical rows (contiguous copies)."""
        if self.rows != 1:
            raise InvalidRequestError("expand_rows takes a one-prompt condition", field="rows",
                                      expected=1, actual=self.rows)
        return Condition({k: t.expand(rows, *t.shape[1:]).contiguous()
                          for k, t in self.tensors.items()}, self.token_ids * rows)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "Condition":
        """Move every tensor; `dtype` converts floating tensors only (masks and ids stay)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            if dtype is not None and t.is_floating_point():
                return t.to(device=device, dtype=dtype)
            return t.to(device)
        return Condition({k: move(t) for k, t in self.tensors.items()}, self.token_ids)

    @staticmethod
    def cat(conditions: Sequence["Condition"]) -> "Condition":
        """Rows of several conditions in order; they must share names and per-row shapes."""
        if not conditions:
            raise InvalidRequestError("nothing to concatenate", field="conditions",
                                      expected="at least one", actual=0)
        head = conditions[0]
        for i, c in enumerate(conditions[1:], 1):
            if c.batch_key() != head.batch_key():
                raise InvalidRequestError("conditions of one forward must share names and "
                                          "shapes", field=f"conditions[{i}]",
                                          expected=head.batch_key(), actual=c.batch_key())
        with_ids = all(c.token_ids for c in conditions)
        return Condition({k: torch.cat([c.tensors[k] for c in conditions]) for k in head.tensors},
                         tuple(i for c in conditions for i in c.token_ids) if with_ids else ())
