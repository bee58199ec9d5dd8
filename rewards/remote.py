"""A scorer that calls an HTTP reward server (rewards/remote_protocol.py; never pickle).

Scorers whose dependencies conflict with the graph's (GenEval's mmdet / mmcv 1.x, a VLM) run in
their own process or machine behind `python -m rewards.reward_server` or any server speaking the
protocol. The batch is split into requests of `max_batch` samples sent concurrently (at most
`retry.max_concurrency` in flight); each request follows the retry policy of
rewards/http_client.py. A server that times out, answers 5xx or malformed JSON after its retries
raises RemoteScorerError, so the reward policy makes an optional scorer MISSING with that reason
and fails a required one; samples the server marks "failed" come back FAILED with its reason.
A groupwise server scorer (`groupwise: true`, e.g. PickScore_Rank behind the reward server):
the batch's prompt groups (ScoreRequest.groups, checked whole and >= 2 as in process) are packed
whole into requests of up to `max_batch` samples (a larger group goes alone, never split), each
request carrying its groups' sizes, so the server's scorer sees every group whole.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from pydantic import BaseModel, ConfigDict, Field, field_validator

from contract import MediaArtifact, Modality, ScorerOutput, ScoreStatus
from contract.errors import RemoteScorerError
from rewards.base import ScoreRequest
from rewards.groupwise import group_slices
from rewards.http_client import JsonClient, RetryPolicy
from rewards.media import require_decoded
from rewards.remote_protocol import encode_artifact, json_metadata, parse_answer


class RemoteScorerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "remote"
    url: str = Field(description="POST endpoint, e.g. http://127.0.0.1:8100/score")
    artifacts: dict[str, Modality] = Field(default_factory=lambda: {"image": Modality.IMAGE},
                                           description="decoded artifacts sent, by modality")
    primary: str = Field(description="the named score of the answer used as the reward")
    metadata_keys: tuple[str, ...] | None = Field(
        None, description="metadata entries sent; None = every JSON-typed entry")
    max_batch: int = Field(16, ge=1, description="samples per HTTP request (groupwise: whole "
                           "groups up to this many samples; a larger group goes alone)")
    groupwise: bool = Field(False, description="the server's scorer compares the samples of a "
                            "prompt group (rewards/groupwise.py): requests carry whole groups "
                            "and their sizes")
    retry: RetryPolicy = Field(default_factory=RetryPolicy)

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"url must be http(s)://..., got {value!r}")
        return value


class RemoteScorer:
    def __init__(self, config: RemoteScorerConfig):
        self.config = config
        self.name = config.name
        self.primary = config.primary
        self.required_artifacts = tuple(config.artifacts)
        self.groupwise = config.groupwise
        self._client = JsonClient(config.url, config.retry, config.name)
        self._pool = ThreadPoolExecutor(max_workers=config.retry.max_concurrency,
                                        thread_name_prefix=f"remote-{config.name}")

    @property
    def attempts(self) -> int:
        return self._client.attempts

    def score(self, request: ScoreRequest) -> ScorerOutput:
        cfg = self.config
        arts = {n: require_decoded(request.artifacts, n, m, self.name)
                for n, m in cfg.artifacts.items()}
        batch = len(request.prompts)
        meta = request.metadata or ({},) * batch
        bodies = []                                  # encode everything before any call
        for sl, groups in self._chunks(request, batch):
            body = {
                "prompts": list(request.prompts[sl]),
                "metadata": [json_metadata(m, cfg.metadata_keys) for m in meta[sl]],
                "media": {n: encode_artifact(MediaArtifact(a.spec, a.data[sl], a.metadata))
                          for n, a in arts.items()}}
            if groups:
                body["groups"] = groups
            bodies.append(body)
        answers = list(self._pool.map(self._client.post, bodies))
        parts = []
        for body, answer in zip(bodies, answers):
            try:
                parts.append(parse_answer(answer, self.name, len(body["prompts"])))
            except ValueError as e:
                raise RemoteScorerError(f"remote scorer {self.name!r}: {e}",
                                        field=f"{self.name}.response") from None
        if any(cfg.primary not in p.scores for p in parts if ScoreStatus.OK in p.status):
            raise RemoteScorerError(f"remote scorer {self.name!r} did not return its primary "
                                    f"score {cfg.primary!r}", field=f"{self.name}.response",
                                    expected=cfg.primary, actual=sorted(parts[0].scores))
        keys = sorted(set.intersection(*(set(p.scores) for p in parts)))
        metadata = dict(parts[0].metadata)
        if self.groupwise:      # the facts every request shares, and the group sizes sent
            metadata = {k: v for k, v in metadata.items()
                        if all(p.metadata.get(k) == v for p in parts)}
            metadata["group_sizes"] = [n for body in bodies for n in body["groups"]]
        return ScorerOutput(
            scorer=self.name,
            scores={k: tuple(v for p in parts for v in p.scores[k]) for k in keys},
            status=tuple(s for p in parts for s in p.status),
            reasons=tuple(r for p in parts for r in p.reasons),
            metadata=dict(metadata, http_requests=len(parts)))

    def _chunks(self, request: ScoreRequest, batch: int) -> list[tuple[slice, list[int]]]:
        """(rows, group sizes sent with them) of each HTTP request: `max_batch` rows at a time,
        or for a groupwise server whole groups packed up to `max_batch` rows."""
        size = self.config.max_batch
        if not self.groupwise:
            return [(slice(s, s + size), []) for s in range(0, batch, size)]
        out: list[tuple[slice, list[int]]] = []
        for sl in group_slices(request, batch, self.name):
            n = sl.stop - sl.start
            if out and out[-1][0].stop - out[-1][0].start + n <= size:
                last, groups = out[-1]
                out[-1] = (slice(last.start, sl.stop), groups + [n])
            else:
                out.append((sl, [n]))
        return out
