"""Small decoded media as data URLs for HTTP callers (PNG for images / video frame strips, WAV
for audio, MP4 with H.264 video and AAC audio for a video whose audio was decoded with it). Only
decoded artifacts are previewed: a latent is never passed off as a preview."""
from __future__ import annotations

import base64
import io

import numpy as np
import soundfile
import torch
from PIL import Image

from contract import MediaArtifact, MediaFormatError, Modality, Representation


def _png(pixels_hwc: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(pixels_hwc).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _wav(waveform_ct: np.ndarray, sample_rate: int) -> str:
    buf = io.BytesIO()
    soundfile.write(buf, waveform_ct.T, sample_rate, format="WAV", subtype="PCM_16")
    return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()


def preview_urls(artifact: MediaArtifact, max_pixels: int) -> tuple[str, ...]:
    """One data URL per sample. Refuses latents and media larger than `max_pixels`."""
    spec = artifact.spec
    if spec.representation != Representation.DECODED:
        raise MediaFormatError("only decoded artifacts have previews",
                               field=f"artifacts.{spec.name}.representation",
                               expected="decoded", actual=spec.representation.value)
    data = artifact.data
    if spec.modality == Modality.AUDIO:
        wave = data.to(torch.float32).clamp(-1, 1).numpy()
        return tuple(_wav(w, int(artifact.sample_rate)) for w in wave)
    per_sample = int(np.prod(data.shape[1:])) // 3
    if per_sample > max_pixels:
        raise MediaFormatError("media too large for an inline preview",
                               field=f"artifacts.{spec.name}", expected=f"<= {max_pixels} pixels",
                               actual=per_sample)
    if spec.modality == Modality.IMAGE:                       # (B, C, H, W)
        return tuple(_png(x.permute(1, 2, 0).numpy()) for x in data)
    # video (B, T, C, H, W) -> one strip of frames per sample, (H, T*W, C)
    return tuple(_png(x.permute(2, 0, 3, 1).reshape(x.shape[2], -1, x.shape[1]).numpy())
                 for x in data)


def av_preview_urls(video: MediaArtifact, audio: MediaArtifact,
                    max_pixels: int) -> tuple[str, ...]:
    """One MP4 (H.264 at the video's fps + AAC at the audio's sample rate) data URL per sample:
    video (B, T, 3, H, W) uint8 with even H, W; audio (B, C, N) float of the same B."""
    from adapters.sample_clip import write_mp4
    for artifact, modality in ((video, Modality.VIDEO), (audio, Modality.AUDIO)):
        if artifact.spec.representation != Representation.DECODED or \
                artifact.spec.modality != modality:
            raise MediaFormatError(f"an MP4 preview muxes decoded {modality.value}",
                                   field=f"artifacts.{artifact.name}",
                                   expected=f"decoded {modality.value}",
                                   actual=f"{artifact.spec.representation.value} "
                                          f"{artifact.spec.modality.value}")
    frames, wave = video.data, audio.data
    b, t, _, h, w = frames.shape
    if t * h * w > max_pixels:
        raise MediaFormatError("media too large for an inline preview",
                               field=f"artifacts.{video.name}", expected=f"<= {max_pixels} pixels",
                               actual=t * h * w)
    if h % 2 or w % 2:               # 4:2:0 chroma; never padded or resized
        raise MediaFormatError("an H.264 preview needs an even frame size",
                               field=f"artifacts.{video.name}.shape", expected="even H and W",
                               actual=(h, w))
    if wave.shape[0] != b or wave.shape[1] not in (1, 2):
        raise MediaFormatError("the audio must have the video's rows and 1 or 2 channels",
                               field=f"artifacts.{audio.name}.shape", expected=(b, "1|2", "N"),
                               actual=tuple(wave.shape))
    out = []
    for i in range(b):
        buf = io.BytesIO()
        write_mp4(buf, frames[i].numpy(), float(video.fps),
                  wave[i].to(torch.float32).clamp(-1, 1).numpy(), int(audio.sample_rate))
        out.append("data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode())
    return tuple(out)
