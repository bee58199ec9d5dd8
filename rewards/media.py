"""Media checks at the scorer boundary: a scorer states what it reads, these refuse anything else."""
from __future__ import annotations

from typing import Mapping

from contract import (DECODED_LAYOUT, MediaArtifact, MediaFormatError, Modality, Representation,
                      validate_artifact)
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
