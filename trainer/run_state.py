"""What a run carries besides the weights, so a resumed run continues exactly.

    feed = PromptFeed(cfg, tokenize)          # prompts per step: files (seeded epochs) or synthetic
    ema = PolicyEMA(cfg.ema)                  # EMA of the trained adapter (evaluation policy)
    config_diff(saved_cfg, cfg)               # fields that differ from the checkpoint's config

A checkpoint holds, beside the adapters and the optimizer: the step, the trainer's generator
state (NFT / DPO noise and timesteps), the prompt feed's position as of the in-flight batch, the
in-flight batch's sampling version (its tensors), the EMA tensors and the config. Everything else
a step draws is a pure function of (seed, step): rollout seeds, Flow-GRPO-Fast windows, synthetic
prompts.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from contract import ConfigError, DatasetError, MediaInput, PromptBundle
from trainer.config import REPO_ROOT, EMAConfig, TrainerConfig
from trainer.datasets import PromptDataset, PromptRecord, check_task_media, load_prompt_file
from trainer.prompts import captions

# fields a resumed run may change: how long it runs and what it writes, never what it computes
RESUMABLE_FIELDS = ("steps", "resume", "checkpoint_every", "gallery", "run_dir", "wandb",
                    "eval.every")


def _resolve(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() or p.exists() else REPO_ROOT / p


@dataclass
class StepPrompts:
    """One step's prompts: token ids, per-prompt scorer metadata and condition media."""

    bundles: list[PromptBundle]
    metadata: list[dict[str, Any]]
    media: list[tuple[MediaInput, ...] | None] | None
    data_state: dict[str, int] | None        # the feed's position before this batch


class PromptFeed:
    """Training prompts per step and the held-out prompts, from files or the synthetic source.

    Files: every record is tokenized at start-up (a prompt too long for the encoder fails here,
    naming its file:line, not at step 500); batches follow PromptDataset's seeded epochs.
    Synthetic: captions seeded by (seed, step), as before.
    """

    def __init__(self, cfg: TrainerConfig, tokenize: Callable[..., list]):
        self.cfg, self.tokenize = cfg, tokenize
        self.data: PromptDataset | None = None
        self._bundles: list[PromptBundle] = []
        files = cfg.data
        if files is None:
            self.eval_records: list[PromptRecord] = []
            self.eval_bundles = tokenize(captions(cfg.prompts, cfg.eval.num_prompts,
                                                  cfg.eval.seed, held_out=True))
            return
        train = load_prompt_file(_resolve(files.train), files.format)
        self.data = PromptDataset(train, seed=cfg.seed, shuffle=files.shuffle)
        self._bundles = self._tokenize_records(train)
        test = load_prompt_file(_resolve(files.test), files.format) if files.test else train
        if len(test) < cfg.eval.num_prompts:
            raise ConfigError("the evaluation file has fewer prompts than eval.num_prompts",
                              field="eval.num_prompts", expected=f"<= {len(test)}",
                              actual=cfg.eval.num_prompts)
        self.eval_records = test[:cfg.eval.num_prompts]
        self.eval_bundles = self._tokenize_records(self.eval_records)

    def _tokenize_records(self, records: Sequence[PromptRecord]) -> list[PromptBundle]:
        out = []
        for r in records:
            try:
                # the negative prompt tokenized by the same tokenizers, into the bundle
                bundle = self.tokenize([r.text], [r.negative])[0]
            except ConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 - the tokenizer's limit errors, typed here
                raise DatasetError(f"prompt does not tokenize: {exc}", field=r.source,
                                   actual=r.text[:80]) from None
            out.append(bundle)
        return out

    @property
    def epoch(self) -> float | None:
        return None if self.data is None else self.data.progress

    def batch(self, step: int, n: int) -> StepPrompts:
        if self.data is None:
            texts = captions(self.cfg.prompts, n, self.cfg.seed * 100_003 + step)
            return StepPrompts(self.tokenize(texts), [{} for _ in texts], None, None)
        before = self.data.state()
        taken = self.data.take(n)
        media = [r.media_inputs() for _, r in taken]
        return StepPrompts([self._bundles[i] for i, _ in taken],
                           [dict(r.metadata) for _, r in taken],
                           media if any(m is not None for m in media) else None, before)

    def check_task_media(self, task, roles: Sequence, optional: Sequence = ()) -> None:
        """Every training and held-out record carries exactly the condition media `roles` of
        the run's `task`, then a prefix of `optional` (datasets.check_task_media; an edit's
        source images); a task with media needs prompt files (the synthetic sources have
        none)."""
        if self.data is None:
            if roles:
                raise ConfigError(f"task {task.value} reads its condition media from prompt "
                                  "files", field="data", expected="prompt files with "
                                  f"{sorted(r.value for r in roles)}", actual=None)
            return
        for records in (self.data.records, self.eval_records):
            check_task_media(records, roles, task.value, optional)

    def eval_extras(self) -> tuple[list[dict[str, Any]], list | None]:
        media = [r.media_inputs() for r in self.eval_records]
        return ([dict(r.metadata) for r in self.eval_records] or None,
                media if any(m is not None for m in media) else None)

    def restore(self, state: Mapping[str, int] | None) -> None:
        if self.data is not None:
            if state is None:
                raise ConfigError("the checkpoint has no prompt-file position",
                                  field="data", actual=None)
            self.data.load_state(state)


class PolicyEMA:
    """The evaluation policy, flow_grpo's / DiffusionNFT's EMAModuleWrapper.step called after
    optimizer step s (1 = the first): when (s + 1) % every == 0,
    theta_ema <- theta_ema + (1 - d_s) (theta - theta_ema), d_s = min(decay, (1 + s) / (10 + s))
    with warmup, else decay. Initialised from the weights before the first step (step 0).
    Called once per optimizer step, as DiffusionNFT's trainer calls it (flow_grpo's scripts call
    it after every micro-batch, repeating an update under gradient accumulation)."""

    def __init__(self, cfg: EMAConfig):
        self.cfg = cfg
        self.tensors: dict[str, torch.Tensor] | None = None
        self.updates = 0         # updates applied (a count; the decay depends on the step)

    def update(self, step: int, current: Mapping[str, torch.Tensor]) -> None:
        if self.tensors is None:
            self.tensors = {k: v.detach().clone().float() for k, v in current.items()}
            return
        if (step + 1) % self.cfg.every != 0:
            return
        d = self.cfg.decay
        if self.cfg.warmup:
            d = min(d, (1 + step) / (10 + step))
        for k, v in current.items():
            self.tensors[k].add_(v.detach().float() - self.tensors[k], alpha=1 - d)
        self.updates += 1

    def state(self) -> dict[str, Any]:
        return {"updates": self.updates}


def generator_state(gen: torch.Generator) -> str:
    return base64.b64encode(gen.get_state().numpy().tobytes()).decode()


def set_generator_state(gen: torch.Generator, encoded: str) -> None:
    raw = base64.b64decode(encoded)
    gen.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def config_diff(saved: Mapping[str, Any], current: Mapping[str, Any], prefix: str = ""
                ) -> list[tuple[str, Any, Any]]:
    """(dotted field, saved value, current value) for every leaf that differs, except the
    fields a resumed run may change (RESUMABLE_FIELDS)."""
    out = []
    for key in sorted(set(saved) | set(current)):
        name = f"{prefix}{key}"
        if name in RESUMABLE_FIELDS:
            continue
        a, b = saved.get(key), current.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out.extend(config_diff(a, b, f"{name}."))
        elif a != b:
            out.append((name, a, b))
    return out


def check_resume_config(saved: Mapping[str, Any], cfg: TrainerConfig) -> None:
    """Resuming under another config would not continue the same run: name what differs."""
    diff = config_diff(saved, cfg.model_dump(mode="json"))
    if diff:
        raise ConfigError("resuming with a config that differs from the checkpoint's in "
                          + ", ".join(d[0] for d in diff), field=diff[0][0],
                          expected={d[0]: d[1] for d in diff},
                          actual={d[0]: d[2] for d in diff})
