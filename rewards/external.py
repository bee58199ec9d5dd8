"""A scorer class named by import path, built inside the scorer's replica.

    scorer: {kind: external, params: {target: "my_rewards.geneval:GenEvalScorer",
                                      params: {...}}}
The class is imported only when the scorer is built -- in its deployment's replica, whose Ray
runtime_env (deployments.config.ScorerRuntimeEnv) can install the packages it needs or ship its
module -- so a reward with dependencies that conflict with the graph's needs no change here.
It is called as `cls(**params)` and must satisfy rewards.base.Scorer.
"""
from __future__ import annotations

import importlib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from contract import ConfigError, ScorerOutput
from rewards.base import Scorer, ScoreRequest


class ExternalScorerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str = Field(description="'package.module:ClassName'")
    params: dict[str, Any] = Field(default_factory=dict, description="constructor kwargs")

    @field_validator("target")
    @classmethod
    def _check_target(cls, value: str) -> str:
        module, _, name = value.partition(":")
        if not module or not name.isidentifier():
            raise ValueError(f"target must be 'package.module:ClassName', got {value!r}")
        return value


class ExternalScorer:
    """Delegates to the imported scorer (same name, primary and artifacts)."""

    def __init__(self, config: ExternalScorerConfig):
        module_name, _, cls_name = config.target.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"cannot import scorer {config.target!r}: {type(e).__name__}: {e}",
                              field="external.target", actual=config.target) from e
        try:
            self.inner = cls(**config.params)
        except TypeError as e:
            raise ConfigError(f"bad parameters for {config.target}: {e}", field="external.params",
                              actual=sorted(config.params)) from e
        if not isinstance(self.inner, Scorer):
            raise ConfigError(f"{config.target} is not a Scorer (name, primary, "
                              "required_artifacts, score)", field="external.target",
                              actual=type(self.inner).__name__)
        self.name = self.inner.name
        self.primary = self.inner.primary
        self.required_artifacts = tuple(self.inner.required_artifacts)

    def score(self, request: ScoreRequest) -> ScorerOutput:
        return self.inner.score(request)
