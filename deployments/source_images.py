"""Condition images from the HTTP body: an edit's source image (`images`, one per prompt) and a
video task's keyframes / ordered references (`media[i].first_frame`, `.last_frame`,
`.reference[j]`), each a base64 string (`images[i]` may be an ordered list of them for a
multi-image edit: `decode_source_images`) decoded with its bounds checked before the pixels
are: the string's length, the encoded bytes,
the format (PNG, JPEG or WebP by its magic bytes, as Pillow identifies it), 8-bit RGB mode, and
the width x height from the header against the graph's RequestLimits (max_width, max_height).
Nothing is converted, resized or cropped: a mode or size the family cannot take is a typed 4xx
naming the field (`images[i]`, `media[i].reference[j]`) and the value. The family then checks what it can take (e.g. FLUX's sides
in multiples of 16) before any stage runs.
"""
from __future__ import annotations

import base64
import binascii
import io
from typing import Sequence

import numpy as np
import torch

from contract import (LimitExceededError, MediaFormatError, MediaInput, MediaRole, Modality,
                      RequestLimits)

FORMATS = ("PNG", "JPEG", "WEBP")
MODE = "RGB"                        # 8-bit, 3 channels: what the families encode


def max_encoded_chars(limits: RequestLimits) -> int:
    """The longest base64 string a body can carry: the body bound itself."""
    return limits.max_body_bytes


def decode_source_image(text: str, field: str, limits: RequestLimits) -> torch.Tensor:
    """base64 of a PNG / JPEG / WebP file -> uint8 (3, H, W); typed errors naming `field`."""
    from PIL import Image

    if len(text) > max_encoded_chars(limits):
        raise LimitExceededError("the encoded image is longer than the body bound", field=field,
                                 expected=f"<= {max_encoded_chars(limits)} characters",
                                 actual=len(text))
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MediaFormatError("an image is a base64 string (RFC 4648, no line breaks)",
                               field=field, expected="base64", actual=text[:32]) from None
    try:
        image = Image.open(io.BytesIO(data), formats=list(FORMATS))   # reads the header only
    except Exception:               # noqa: BLE001 - Pillow raises several types for bad files
        raise MediaFormatError("the image is not a PNG, JPEG or WebP file", field=field,
                               expected=list(FORMATS), actual=data[:8].hex()) from None
    with image:
        width, height = image.size
        if height > limits.max_height or width > limits.max_width:
            raise LimitExceededError("the image is larger than the request bound (nothing is "
                                     "resized)", field=field,
                                     expected=f"<= {limits.max_width} x {limits.max_height}",
                                     actual=f"{width} x {height}")
        if image.mode != MODE:
            raise MediaFormatError("the image must be 8-bit RGB (nothing is converted)",
                                   field=field, expected=MODE, actual=image.mode)
        if getattr(image, "n_frames", 1) != 1:
            raise MediaFormatError("the image must have one frame", field=field, expected=1,
                                   actual=image.n_frames)
        try:
            pixels = np.asarray(image, dtype=np.uint8)
        except Exception:           # noqa: BLE001 - a truncated or corrupt file
            raise MediaFormatError("the image data cannot be decoded", field=field,
                                   expected=list(FORMATS), actual=image.format) from None
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1).contiguous()


def decode_source_images(entry: str | Sequence[str], field: str, limits: RequestLimits,
                         roles: Sequence[MediaRole]) -> tuple[MediaInput, ...]:
    """One prompt's `images` entry -> its source images as MediaInputs of `roles`, in order (one
    string: the first role; a list: one role each, a multi-image edit's image, image_2,
    image_3). More images than the roles the family's task takes is a LimitExceededError naming
    the entry, before any image is decoded."""
    texts = [(field, entry)] if isinstance(entry, str) else \
        [(f"{field}[{j}]", text) for j, text in enumerate(entry)]
    if len(texts) > len(roles):
        raise LimitExceededError("more source images than the family's task takes for one "
                                 "prompt", field=field, expected=f"<= {len(roles)}",
                                 actual=len(texts))
    return tuple(MediaInput(Modality.IMAGE, role, decode_source_image(text, where, limits))
                 for role, (where, text) in zip(roles, texts))
