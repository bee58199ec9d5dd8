"""Image scorers on video: score `num_frames` uniformly sampled frames of each clip, average them.

For a decoded video (B, T, 3, H, W) the frame indices are the centres of `num_frames` equal bins
of [0, T) (`rewards.embedding.frame_indices`); the B*n frames go to the wrapped image scorer in
one call (prompts and metadata repeated per frame) and each named score is the mean over a clip's
frames. The indices used are recorded in the output's metadata (`frame_indices`, `num_frames`),
so the reward report says which frames produced each reward. A clip with fewer frames than asked
is an error, not a shorter average; a frame the image scorer did not score fails its clip (with
the frame's reason), never averaged over the rest.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from contract import (ArtifactSpec, MediaArtifact, MediaFormatError, Modality, ScorerOutput,
                      ScoreStatus)
from rewards.base import Scorer, ScoreRequest
from rewards.embedding import frame_indices
from rewards.media import require_decoded


class VideoFrames(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    artifact: str = Field("video", description="decoded video artifact to sample")
    num_frames: int = Field(4, ge=1, description="frames scored per clip (uniform bins)")


class FrameSampledScorer:
    """Scorer protocol over video for a wrapped image scorer (same name and primary)."""

    def __init__(self, image_scorer: Scorer, frames: VideoFrames):
        if len(image_scorer.required_artifacts) != 1:
            raise MediaFormatError("only a scorer reading one image artifact can score frames",
                                   field=f"{image_scorer.name}.video",
                                   actual=list(image_scorer.required_artifacts))
        self.inner = image_scorer
        self.frames = frames
        self.name = image_scorer.name
        self.primary = image_scorer.primary
        self.required_artifacts = (frames.artifact,)
        self._image_name = image_scorer.required_artifacts[0]

    def score(self, request: ScoreRequest) -> ScorerOutput:
        art = require_decoded(request.artifacts, self.frames.artifact, Modality.VIDEO, self.name)
        batch, total = art.batch_size, int(art.data.shape[1])
        n = self.frames.num_frames
        if total < n:
            raise MediaFormatError(f"scorer {self.name!r} samples {n} frames per clip",
                                   field=f"{self.name}.artifacts.{self.frames.artifact}.frames",
                                   expected=f">= {n}", actual=total)
        idx = frame_indices(total, n)                                       # (n,)
        frames = art.data[:, idx].flatten(0, 1)                             # (B*n, 3, H, W)
        spec = ArtifactSpec(self._image_name, Modality.IMAGE, "decoded", "CHW",
                            source=art.spec.source)
        meta = request.metadata
        inner = self.inner.score(ScoreRequest(
            artifacts={self._image_name: MediaArtifact(spec, frames)},
            prompts=tuple(p for p in request.prompts for _ in range(n)),
            metadata=tuple(m for m in meta for _ in range(n)) if meta else ()))
        if inner.batch_size != batch * n:
            raise MediaFormatError(f"scorer {self.name!r} returned {inner.batch_size} frame "
                                   f"scores for {batch * n} frames", field=f"{self.name}.frames",
                                   expected=batch * n, actual=inner.batch_size)
        status, reasons = [], []
        scores: dict[str, list[float | None]] = {k: [] for k in inner.scores}
        for i in range(batch):
            rows = range(i * n, (i + 1) * n)
            bad = [r for r in rows if inner.status[r] != ScoreStatus.OK]
            status.append(ScoreStatus.FAILED if bad else ScoreStatus.OK)
            reasons.append(f"frame {int(idx[bad[0] - i * n])}: {inner.reasons[bad[0]]}"
                           if bad else None)
            for key, vals in inner.scores.items():
                scores[key].append(None if bad else sum(vals[r] for r in rows) / n)
        return ScorerOutput(scorer=self.name, scores={k: tuple(v) for k, v in scores.items()},
                            status=tuple(status), reasons=tuple(reasons),
                            metadata=dict(inner.metadata, frame_indices=[int(j) for j in idx],
                                          num_frames=total))
