"""OCR reward with Jaro-Winkler similarity (the `textdistance` package) instead of Flow-GRPO's
normalised edit distance: reads the image with the project's OCR scorer, compares with the
prompt metadata's target text. `textdistance` exists only in the replica's runtime_env."""
from __future__ import annotations

import os

from contract import ScorerOutput, ScoreStatus
from rewards.ocr import OcrScorer, OcrScorerConfig, normalise_text


class JaroOcrScorer:
    primary = "jaro_winkler"

    def __init__(self, name: str = "ocr_jaro"):
        from importlib.metadata import version

        import textdistance          # the package the main environment does not have

        self._similarity = textdistance.jaro_winkler.normalized_similarity
        self._version = version("textdistance")
        self._ocr = OcrScorer(OcrScorerConfig(name=name))
        self.name = name
        self.required_artifacts = ("image",)

    def score(self, request) -> ScorerOutput:
        art = request.artifacts["image"]
        targets = self._ocr.targets(request.metadata, art.batch_size)
        sims = tuple(float(self._similarity(normalise_text(self._ocr.recognise(img)),
                                            normalise_text(t)))
                     for img, t in zip(art.data.numpy(), targets))
        return ScorerOutput(self.name, {"jaro_winkler": sims}, (ScoreStatus.OK,) * len(sims),
                            (None,) * len(sims), {"textdistance": self._version,
                                                  "env": os.environ.get("OMNI_SCORER_ENV")})
