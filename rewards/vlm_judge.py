"""A VLM judge behind an OpenAI-compatible chat-completions server (what vLLM / sglang serve).

Per sample one POST {base_url}/chat/completions:
    {"model": model, "temperature": 0, "max_tokens": n,
     "messages": [{"role": "system", "content": system}?,
                  {"role": "user", "content": [
                      {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}} * F,
                      {"type": "text", "text": template.format(prompt=<prompt>)}]}],
     <choice_field>: ...}      # only with `choices`: constrained decoding (see ChoiceField)
For video, F frames are sampled uniformly (their indices go to the output metadata). The answer
`choices[0].message.content` is searched with `score_pattern` (its first group is the number);
  judge = (number - score_min) / (score_max - score_min)   in [0, 1]; "raw" keeps the number.
An answer that does not parse, or parses outside [score_min, score_max], fails its sample with
the answer quoted (FAILED -> a required scorer's ScorerFailedError, an optional one's MISSING);
a server that times out or errors raises RemoteScorerError (rewards/http_client.py retries).
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from contract import ConfigError, Modality, ScorerOutput, ScoreStatus
from contract.errors import RemoteScorerError
from rewards.base import ScoreRequest
from rewards.embedding import frame_indices
from rewards.http_client import JsonClient, RetryPolicy
from rewards.media import require_decoded
from rewards.remote_protocol import png_base64

DEFAULT_TEMPLATE = ("You are judging an AI-generated image for the prompt: \"{prompt}\". "
                    "Rate how well the image matches the prompt and how good it looks, from 0 "
                    "(worst) to 10 (best). Answer with the number only.")


class ChoiceField(str, Enum):
    """How the server is told to answer with one of `choices` (vLLM's parameter names)."""

    STRUCTURED_OUTPUTS = "structured_outputs"   # {"structured_outputs": {"choice": [...]}}
    GUIDED_CHOICE = "guided_choice"             # {"guided_choice": [...]}  (older vLLM)


class VLMJudgeScorerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    name: str = "vlm_judge"
    base_url: str = Field(description="OpenAI-compatible API root, e.g. http://127.0.0.1:8000/v1")
    model: str = Field(description="the served model name")
    api_key_env: str | None = Field(None, description="env var holding a bearer token")
    artifact: str = "image"
    modality: Modality = Modality.IMAGE
    num_frames: int = Field(4, ge=1, description="video frames sent per sample")
    system_prompt: str | None = None
    template: str = Field(DEFAULT_TEMPLATE, description="user text; {prompt} is the prompt")
    score_pattern: str = Field(r"(-?\d+(?:\.\d+)?)", description="regex; group 1 is the score")
    score_min: float = 0.0
    score_max: float = 10.0
    choices: tuple[str, ...] | None = Field(None, description="constrain the answer to these")
    choice_field: ChoiceField = ChoiceField.STRUCTURED_OUTPUTS
    max_tokens: int = Field(16, ge=1, le=4096)
    retry: RetryPolicy = Field(default_factory=lambda: RetryPolicy(timeout_s=120.0))

    @field_validator("score_pattern")
    @classmethod
    def _check_pattern(cls, value: str) -> str:
        if re.compile(value).groups < 1:
            raise ValueError("score_pattern needs a capturing group for the number")
        return value

    @model_validator(mode="after")
    def _check(self) -> "VLMJudgeScorerConfig":
        if not self.score_max > self.score_min:
            raise ValueError(f"score_max {self.score_max} must exceed score_min {self.score_min}")
        if self.modality == Modality.AUDIO:
            raise ValueError("the VLM judge reads images or video frames, not audio")
        if "{prompt}" not in self.template:
            raise ValueError("template must contain {prompt}")
        return self


def chat_client(config: Any, thread_prefix: str) -> tuple[JsonClient, ThreadPoolExecutor]:
    """The chat-completions client of a judge config (`base_url`, `api_key_env`, `retry`,
    `name`) and its call pool; an unset API key variable is a ConfigError naming it."""
    headers = {}
    if config.api_key_env:
        key = os.environ.get(config.api_key_env)
        if not key:
            raise ConfigError("the judge's API key variable is not set",
                              field=f"{config.name}.api_key_env", actual=config.api_key_env)
        headers["Authorization"] = f"Bearer {key}"
    client = JsonClient(config.base_url.rstrip("/") + "/chat/completions", config.retry,
                        config.name, headers)
    pool = ThreadPoolExecutor(max_workers=config.retry.max_concurrency,
                              thread_name_prefix=f"{thread_prefix}-{config.name}")
    return client, pool


def chat_body(config: Any, images_chw: Sequence, text: str,
              choices: Sequence[str] | None) -> dict[str, Any]:
    """One chat completion of a judge config (`model`, `system_prompt`, `max_tokens`,
    `choice_field`): the images as PNG data URLs then `text`, greedy (temperature 0), the answer
    constrained to `choices` when given."""
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_base64(x)}"}}
        for x in images_chw]
    content.append({"type": "text", "text": text})
    messages = ([{"role": "system", "content": config.system_prompt}] if config.system_prompt
                else []) + [{"role": "user", "content": content}]
    body: dict[str, Any] = {"model": config.model, "messages": messages, "temperature": 0.0,
                            "max_tokens": config.max_tokens}
    if choices:
        structured = config.choice_field == ChoiceField.STRUCTURED_OUTPUTS
        body[config.choice_field.value] = {"choice": list(choices)} if structured \
            else list(choices)
    return body


def answer_text(reply: Any, name: str) -> str:
    """The answer of a chat completion reply; RemoteScorerError naming `<name>.response` when the
    reply holds none."""
    try:
        text = reply["choices"][0]["message"]["content"]
        if not isinstance(text, str):
            raise TypeError(type(text).__name__)
    except (KeyError, IndexError, TypeError) as e:
        raise RemoteScorerError(f"judge {name!r} answered no chat completion "
                                f"({type(e).__name__}: {e})", field=f"{name}.response") from None
    return text


class VLMJudgeScorer:
    primary = "judge"

    def __init__(self, config: VLMJudgeScorerConfig):
        self.config = config
        self.name = config.name
        self.required_artifacts = (config.artifact,)
        self._client, self._pool = chat_client(config, "judge")
        self._pattern = re.compile(config.score_pattern)

    def body(self, prompt: str, images_chw: list) -> dict[str, Any]:
        cfg = self.config
        return chat_body(cfg, images_chw, cfg.template.format(prompt=prompt), cfg.choices)

    def parse(self, answer: str) -> tuple[float | None, str | None]:
        """(raw score, None) or (None, reason)."""
        cfg = self.config
        match = self._pattern.search(answer)
        if match is None:
            return None, (f"judge answer has no score matching {cfg.score_pattern!r}: "
                          f"{answer[:200]!r}")
        try:
            value = float(match.group(1))
        except ValueError:
            return None, f"judge answer's score is not a number: {match.group(1)!r}"
        if not cfg.score_min <= value <= cfg.score_max:
            return None, (f"judge score {value:g} outside [{cfg.score_min:g}, {cfg.score_max:g}]: "
                          f"{answer[:200]!r}")
        return value, None

    def score(self, request: ScoreRequest) -> ScorerOutput:
        cfg = self.config
        art = require_decoded(request.artifacts, cfg.artifact, cfg.modality, self.name)
        data = art.data.cpu().numpy()
        meta: dict[str, Any] = {}
        if cfg.modality == Modality.VIDEO:
            idx = frame_indices(data.shape[1], cfg.num_frames).tolist()
            samples = [list(clip[idx]) for clip in data]
            meta = {"frame_indices": idx, "num_frames": int(data.shape[1])}
        else:
            samples = [[x] for x in data]
        bodies = [self.body(p, imgs) for p, imgs in zip(request.prompts, samples)]
        answers = list(self._pool.map(self._client.post, bodies))
        raw, reasons = [], []
        for ans in answers:
            value, reason = self.parse(answer_text(ans, self.name))
            raw.append(value)
            reasons.append(reason)
        span = cfg.score_max - cfg.score_min
        return ScorerOutput(
            scorer=self.name,
            scores={"judge": tuple(None if v is None else (v - cfg.score_min) / span for v in raw),
                    "raw": tuple(raw)},
            status=tuple(ScoreStatus.OK if v is not None else ScoreStatus.FAILED for v in raw),
            reasons=tuple(reasons), metadata=meta)
