"""CLIP directional similarity of an edit (InstructPix2Pix, Brooks et al. 2023, section 4.1;
Gal et al. 2022, StyleGAN-NADA): how the image moved, against how its caption moved.

    directional      = cos(E_img(edited) - E_img(source), E_txt(prompt) - E_txt(source caption))
    image_similarity = cos(E_img(edited), E_img(source))        (consistency with the source)

Declared inputs (`required_artifacts`, `roles`, `metadata_keys`): the decoded edit (`artifact`,
default "image"); the request's source image, condition media role "image", which the ingress
hands every scorer in each sample's metadata; the source image's caption, metadata key
`source_caption_key` (the prompt is the edited image's caption). A missing input is a typed
error naming it; a source image of another size than the edit is compared as CLIP sees both
(its own resize to the model's input), never by changing the request's images.
The model is built as rewards/clip.py builds it (open_clip; local weights, random only for tests).
"""
from __future__ import annotations

import torch
from pydantic import Field

from contract import InvalidRequestError, MediaFormatError, Modality, ScorerOutput
from rewards.base import ScoreRequest
from rewards.clip import ClipScorer, ClipScorerConfig
from rewards.embedding import cosine, map_cosine, ok_output
from rewards.media import require_decoded, require_prompt_per_sample

SOURCE_ROLE = "image"        # contract.MediaRole.IMAGE: an edit's source image


class ClipDirectionalConfig(ClipScorerConfig):
    name: str = "clip_directional"
    source_caption_key: str = Field("source_caption", min_length=1,
                                    description="metadata key of the source image's caption")


class ClipDirectionalScorer(ClipScorer):
    """Scorer protocol: decoded edits (B, 3, H, W) uint8, B target captions, per-sample source
    image and source caption in the metadata."""

    primary = "directional_score"
    roles = (SOURCE_ROLE,)

    def __init__(self, config: ClipDirectionalConfig):
        if config.modality != Modality.IMAGE:
            raise InvalidRequestError("directional similarity scores images",
                                      field=f"{config.name}.modality", expected="image",
                                      actual=config.modality.value)
        super().__init__(config)
        self.metadata_keys = (SOURCE_ROLE, config.source_caption_key)

    @torch.inference_mode()
    def score(self, request: ScoreRequest) -> ScorerOutput:
        cfg = self.config
        art = require_decoded(request.artifacts, cfg.artifact, Modality.IMAGE, self.name)
        batch = art.batch_size
        require_prompt_per_sample(request.prompts, batch, self.name)
        if len(request.metadata) != batch:
            raise InvalidRequestError(f"scorer {self.name!r} needs one metadata dict per sample",
                                      field=f"{self.name}.metadata", expected=batch,
                                      actual=len(request.metadata))
        sources, captions = [], []
        for i, meta in enumerate(request.metadata):
            missing = [k for k in self.metadata_keys if k not in meta]
            if missing:
                raise InvalidRequestError("an edit's directional similarity needs the source "
                                          "image and its caption", field=f"{self.name}."
                                          f"metadata[{i}].{missing[0]}",
                                          expected=list(self.metadata_keys),
                                          actual=sorted(meta))
            source = torch.as_tensor(meta[SOURCE_ROLE])
            if source.dtype != torch.uint8 or source.ndim != 3 or source.shape[0] != 3:
                raise MediaFormatError("the source image is uint8 (3, H, W)",
                                       field=f"{self.name}.metadata[{i}].{SOURCE_ROLE}",
                                       expected="uint8 (3, H, W)",
                                       actual=f"{source.dtype} {tuple(source.shape)}")
            caption = meta[cfg.source_caption_key]
            if not isinstance(caption, str) or not caption.strip():
                raise InvalidRequestError("the source caption is a non-empty string",
                                          field=f"{self.name}.metadata[{i}]."
                                          f"{cfg.source_caption_key}", expected="text",
                                          actual=caption)
            sources.append(source)
            captions.append(caption)
        edited = self._encode_images(art.data)                                  # (B, D)
        source_emb = torch.cat([self._encode_images(s[None]) for s in sources])  # (B, D)
        text = self._encode_text(list(request.prompts))
        source_text = self._encode_text(captions)
        directional = cosine(edited - source_emb, text - source_text)
        similarity = cosine(edited, source_emb)
        return ok_output(self.name, {"directional": directional,
                                     "directional_score": map_cosine(directional, cfg.score_map),
                                     "image_similarity": similarity})
