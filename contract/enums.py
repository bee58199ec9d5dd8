"""Enumerations shared by every stage. Values are the JSON spelling."""
from __future__ import annotations

from enum import Enum


class Modality(str, Enum):
    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


class Representation(str, Enum):
    LATENT = "latent"
    DECODED = "decoded"


class Layout(str, Enum):
    """Per-sample axis order of an artifact's data (a leading batch axis B is always added).

    Decoded layouts are the normalised vocabulary; latent layouts name the model-native form.
    """

    CHW = "CHW"              # decoded image, uint8
    TCHW = "TCHW"            # decoded video, uint8
    CT = "CT"                # decoded audio, float waveform (channels, samples)
    LATENT_CHW = "latent:CHW"     # image latent
    LATENT_CTHW = "latent:CTHW"   # video latent (channels, frames, h, w)
    LATENT_CL = "latent:CL"       # audio latent (channels, length)
    LATENT_CLM = "latent:CLM"     # audio latent (channels, length, latent mel bins)
    TOKENS = "tokens:ND"          # packed model-native token latent (tokens, dim)

    @property
    def ndim(self) -> int:
        return _LAYOUT_NDIM[self]

    @property
    def is_latent(self) -> bool:
        return self.value.startswith(("latent:", "tokens:"))


_LAYOUT_NDIM = {
    Layout.CHW: 3, Layout.TCHW: 4, Layout.CT: 2,
    Layout.LATENT_CHW: 3, Layout.LATENT_CTHW: 4, Layout.LATENT_CL: 2, Layout.LATENT_CLM: 3,
    Layout.TOKENS: 2,
}

# Decoded layout each modality must use (normalised once, RFC 4.5).
DECODED_LAYOUT = {Modality.IMAGE: Layout.CHW, Modality.VIDEO: Layout.TCHW, Modality.AUDIO: Layout.CT}


class MediaRole(str, Enum):
    """What a conditioning media input is for."""

    IMAGE = "image"              # generic condition image; alias of FIRST_FRAME for video tasks
    FIRST_FRAME = "first_frame"
    LAST_FRAME = "last_frame"
    REFERENCE = "reference"
    IMAGE_2 = "image_2"          # a multi-image edit's second source image ("Picture 2")
    IMAGE_3 = "image_3"          # ... and its third


# An edit's ordered source images: `image` first, then image_2, image_3 (a multi-image edit
# takes a prefix of these; more than three is not a request a family can take).
SOURCE_IMAGE_ROLES = (MediaRole.IMAGE, MediaRole.IMAGE_2, MediaRole.IMAGE_3)


class SamplerKind(str, Enum):
    SDE = "sde"              # FlowGRPO Euler-Maruyama SDE with Gaussian log-prob
    ODE = "ode"              # deterministic Euler
    CPS = "cps"              # coefficients-preserving sampling
    DANCE_SDE = "dance_sde"  # DanceGRPO constant-eta SDE
    DPM2 = "dpm2"            # deterministic multistep DPM-Solver++(2M) (DiffusionNFT's solver)


class GuidanceKind(str, Enum):
    """How a family applies `guidance_scale` (decided once, in diffusion/step.py)."""

    NONE = "none"            # no guidance input: guidance_scale must be 1
    CFG = "cfg"              # true classifier-free guidance: rows doubled with the negative
    EMBEDDED = "embedded"    # guidance-distilled: the scale is a model input, one forward


class TimeConvention(str, Enum):
    """How a model reads time. Inside the project sigma=1 is noise, sigma=0 is data."""

    NOISE_LEVEL = "noise_level"      # model time = sigma (scaled), velocity points to noise
    DATA_PROGRESS = "data_progress"  # model time = 1 - sigma, velocity points to data (negated)


class Task(str, Enum):
    T2I = "t2i"
    T2VA = "t2va"     # text -> video + audio
    FL2VA = "fl2va"   # first/last frame + text -> video + audio
    T2V = "t2v"       # text -> video (no audio)
    I2V = "i2v"       # first frame + text -> video (no audio)
    I2VA = "i2va"     # first frame + text -> video + audio
    EDIT = "edit"     # source image (media role `image`) + instruction -> image
    L2VA = "l2va"     # last frame + text -> video + audio
    REF2VA = "ref2va"  # ordered image references (role `reference`, in order) + text -> video + audio


class StopReason(str, Enum):
    FINISHED = "finished"
    CANCELLED = "cancelled"
    ERROR = "error"


class ScoreStatus(str, Enum):
    OK = "ok"
    MISSING = "missing"      # optional scorer failed or timed out; excluded and renormalised
    FAILED = "failed"        # required scorer failed; the request fails with ScorerFailedError


class Algorithm(str, Enum):
    """The trainer's RL objective (trainer/algorithms)."""

    NFT = "nft"              # DiffusionNFT (forward-process, old-policy rollouts)
    FLOW_GRPO = "flow_grpo"  # clipped surrogate on SDE transition log-probs
    DPO = "dpo"              # Diffusion-DPO on (best, worst) pairs per prompt
    AWM = "awm"              # advantage-weighted matching (flow-matching loss in the clip)


class PolicyKind(str, Enum):
    """What a published policy version holds (the trainer's `learner.fine_tune`)."""

    LORA = "lora"            # LoRA A/B tensors + one scale, applied on the base weights
    FULL = "full"            # every transformer weight: replaces the base weights while active
