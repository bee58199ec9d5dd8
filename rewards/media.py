"""Media checks at the scorer boundary: a scorer states what it reads, these refuse anything else."""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from contract import (DECODED_LAYOUT, InvalidRequestError, MediaArtifact, MediaFormatError,
                      Modality, Representation, validate_artifact)
from contract.errors import MissingArtifactError


def require_decoded(artifacts: Mapping[str, MediaArtifact], name: str, modality: Modality,
                    scorer: str) -> MediaArtifact:
    """Return artifact `name` if it is decoded `modality` media in the normalised layout.

    Raises a typed error naming the scorer and field for a latent, the wrong modality or layout,
    a video without fps, or audio without a sample rate. Never converts or substitutes.
    """
    field = f"{scorer}.artifacts.{name}"
    if name not in artifacts:
        raise MissingArtifactError(f"scorer {scorer!r} needs artifact {name!r}", field=field,
                                   expected=name, actual=sorted(artifacts))
    artifact = artifacts[name]
    spec = artifact.spec
    if spec.representation != Representation.DECODED:
        raise MediaFormatError(f"scorer {scorer!r} needs decoded media, got a latent",
                               field=f"{field}.representation", expected="decoded",
                               actual=spec.representation.value)
    if spec.modality != modality:
        raise MediaFormatError(f"scorer {scorer!r} needs {modality.value}", field=f"{field}.modality",
                               expected=modality.value, actual=spec.modality.value)
    if spec.layout != DECODED_LAYOUT[modality]:
        raise MediaFormatError(f"scorer {scorer!r} needs layout {DECODED_LAYOUT[modality].value}",
                               field=f"{field}.layout", expected=DECODED_LAYOUT[modality].value,
                               actual=spec.layout.value)
    validate_artifact(artifact)   # dtype, rank, finiteness, fps / sample rate
    if modality in (Modality.IMAGE, Modality.VIDEO) and artifact.data.shape[-3] != 3:
        raise MediaFormatError(f"scorer {scorer!r} needs RGB pixels with channels at axis "
                               f"{artifact.data.ndim - 3} ({spec.layout.value})",
                               field=f"{field}.shape", expected=3,
                               actual=tuple(artifact.data.shape))
    return artifact


def require_prompt_per_sample(prompts: Sequence[str], batch: int, scorer: str) -> None:
    """Refuse a request whose prompt count is not its sample count."""
    if len(prompts) != batch:
        raise InvalidRequestError(f"scorer {scorer!r} needs one prompt per sample",
                                  field=f"{scorer}.prompts", expected=batch, actual=len(prompts))


def image_prompt_chunks(artifacts: Mapping[str, MediaArtifact], prompts: Sequence[str],
                        name: str, scorer: str,
                        max_batch: int) -> list[tuple[torch.Tensor, tuple[str, ...]]]:
    """Decoded image artifact `name` (B, 3, H, W) and one prompt per sample, in forward-sized
    chunks: [(images (b, 3, H, W) uint8, their b prompts)], b <= max_batch."""
    art = require_decoded(artifacts, name, Modality.IMAGE, scorer)
    require_prompt_per_sample(prompts, art.batch_size, scorer)
    return [(art.data[start:start + max_batch], tuple(prompts[start:start + max_batch]))
            for start in range(0, art.batch_size, max_batch)]
