"""CLAP text-audio score (Wu et al. 2023, LAION-CLAP) with transformers' ClapModel / ClapProcessor.

score per sample = cos(E_audio(wave), E_text(prompt)); named scores "cosine" ([-1, 1]) and
"clap_score" = map_cosine(cos) ((cos+1)/2 by default).

Weights and processor come from one local snapshot directory (the HF repo layout: config.json,
model.safetensors, preprocessor/tokenizer files), loaded with local_files_only=True. Audio is
mixed to mono, resampled to the feature extractor's rate with a polyphase filter
(scipy.signal.resample_poly) and centre-cropped to the extractor's window; its padding applies
(unfused checkpoints need truncation="rand_trunc", which their preprocessor_config.json says).
"""
from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from contract import ConfigError, Modality, ScorerOutput
from rewards.base import ScoreRequest
from rewards.embedding import (ScoreMap, cosine, map_cosine, ok_output, pooled_features, resample,
                               to_mono)
from rewards.media import require_decoded, require_prompt_per_sample


class ClapScorerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "clap"
    model_dir: str = Field(description="local snapshot dir with ClapModel weights + processor")
    artifact: str = Field("audio", description="decoded audio artifact to score")
    score_map: ScoreMap = ScoreMap.UNIT
    max_batch: int = Field(16, ge=1, description="clips per forward pass")
    device: str = "cpu"


class ClapScorer:
    """Scorer protocol: decoded audio (B, C, N) float + sample rate, and B prompts."""

    primary = "clap_score"

    def __init__(self, config: ClapScorerConfig):
        from transformers import ClapModel, ClapProcessor

        self.config = config
        self.name = config.name
        self.required_artifacts = (config.artifact,)
        path = Path(config.model_dir)
        if not (path / "config.json").is_file():
            raise ConfigError("CLAP model_dir has no config.json", field=f"{config.name}.model_dir",
                              actual=str(path))
        try:
            self._processor = ClapProcessor.from_pretrained(str(path), local_files_only=True)
            model = ClapModel.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError(f"could not load CLAP from {path}: {e}",
                              field=f"{config.name}.model_dir", actual=str(path)) from e
        self._model = model.to(config.device).eval().requires_grad_(False)
        self.sample_rate = int(self._processor.feature_extractor.sampling_rate)
        fusion_model = bool(model.config.audio_config.enable_fusion)
        fusion_features = self._processor.feature_extractor.truncation == "fusion"
        if fusion_model != fusion_features:
            raise ConfigError("feature extractor truncation does not match the model's fusion",
                              field=f"{config.name}.model_dir.preprocessor.truncation",
                              expected="fusion" if fusion_model else "rand_trunc",
                              actual=self._processor.feature_extractor.truncation)

    @torch.inference_mode()
    def score(self, request: ScoreRequest) -> ScorerOutput:
        cfg = self.config
        art = require_decoded(request.artifacts, cfg.artifact, Modality.AUDIO, self.name)
        batch = art.batch_size
        require_prompt_per_sample(request.prompts, batch, self.name)
        waves = resample(to_mono(art.data).cpu().numpy(), int(art.sample_rate),
                         self.sample_rate)                                  # (B, N')
        cos = []
        for start in range(0, batch, cfg.max_batch):
            stop = min(start + cfg.max_batch, batch)
            audio = self._encode_audio(list(waves[start:stop]))             # (b, D)
            text = self._encode_text(list(request.prompts[start:stop]))     # (b, D)
            cos.append(cosine(audio, text))
        cos_t = torch.cat(cos)                                              # (B,)
        return ok_output(self.name, {"cosine": cos_t,
                                     "clap_score": map_cosine(cos_t, cfg.score_map)})

    def _encode_audio(self, waves: list) -> torch.Tensor:
        # Clips longer than the extractor's window are centre-cropped here, so its random crop
        # never fires and a sample's score does not depend on its batch neighbours.
        window = int(self._processor.feature_extractor.nb_max_samples)
        waves = [w[(len(w) - window) // 2:(len(w) - window) // 2 + window] if len(w) > window
                 else w for w in waves]
        feats = self._processor.feature_extractor(waves, sampling_rate=self.sample_rate,
                                                  return_tensors="pt")
        out = self._model.get_audio_features(
            input_features=feats["input_features"].to(self.config.device),
            is_longer=feats["is_longer"].to(self.config.device))
        return pooled_features(out)

    def _encode_text(self, prompts: list[str]) -> torch.Tensor:
        tok = self._processor.tokenizer(prompts, padding=True, return_tensors="pt")
        out = self._model.get_text_features(input_ids=tok["input_ids"].to(self.config.device),
                                            attention_mask=tok["attention_mask"].to(self.config.device))
        return pooled_features(out)
