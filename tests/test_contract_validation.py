"""One test per validation rule of contract/: the bad input, the error TYPE and the FIELD it names."""
import json
import pickle

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from contract import (ArtifactSpec, ConfigError, ConflictingInputError, DuplicateInputError,
                      InvalidRequestError, IOSpec, Layout, LimitExceededError, MediaArtifact,
                      MediaFormatError, MediaInput, MediaRole, MissingArtifactError, Modality,
                      NonFiniteError, PromptBundle, Representation, RequestLimits, RolloutError,
                      RolloutRequest, SamplingSpec, ScorerFailedError, Task,
                      UndeclaredArtifactError, UnexpectedArtifactError, check_limits,
                      check_requested_artifacts, collect_artifacts, normalize_media,
                      validate_artifact)

RID = "req-123"
H = W = 8


def _image(value=0, shape=(3, H, W)):
    return torch.full(shape, value, dtype=torch.uint8)


def _request(**kw):
    base = dict(prompt=PromptBundle(token_ids=(1, 2, 3)), sampling=SamplingSpec(seeds=(0, 1)),
                task=Task.T2I, request_id=RID)
    base.update(kw)
    return RolloutRequest(**base)


# ---- media inputs -------------------------------------------------------------------------
def test_duplicate_modality_and_role():
    media = (MediaInput(Modality.IMAGE, MediaRole.FIRST_FRAME, _image()),
             MediaInput(Modality.IMAGE, MediaRole.FIRST_FRAME, _image()))
    with pytest.raises(DuplicateInputError) as e:
        normalize_media(media, Task.FL2VA, RID)
    assert e.value.field == "media[1]" and e.value.request_id == RID


def test_alias_with_exactly_equal_data_is_accepted():
    media = (MediaInput(Modality.IMAGE, MediaRole.IMAGE, _image(7)),
             MediaInput(Modality.IMAGE, MediaRole.FIRST_FRAME, _image(7)))
    out = normalize_media(media, Task.FL2VA, RID)
    assert list(out) == [MediaRole.FIRST_FRAME]             # IMAGE is FIRST_FRAME's alias
    assert torch.equal(out[MediaRole.FIRST_FRAME].data, _image(7))


def test_alias_numpy_vs_torch_with_equal_values_is_accepted():
    media = (MediaInput(Modality.IMAGE, MediaRole.IMAGE, np.full((3, H, W), 9, dtype=np.uint8)),
             MediaInput(Modality.IMAGE, MediaRole.FIRST_FRAME, _image(9)))
    out = normalize_media(media, Task.FL2VA, RID)
    assert isinstance(out[MediaRole.FIRST_FRAME].data, torch.Tensor)
    assert torch.equal(out[MediaRole.FIRST_FRAME].data, _image(9))


def test_alias_with_different_values_is_rejected():
    other = _image(7)
    other[0, 0, 0] = 8
    media = (MediaInput(Modality.IMAGE, MediaRole.IMAGE, _image(7)),
             MediaInput(Modality.IMAGE, MediaRole.FIRST_FRAME, other))
    with pytest.raises(ConflictingInputError) as e:
        normalize_media(media, Task.FL2VA, RID)
    assert e.value.field == "media[1].data" and e.value.request_id == RID


def test_alias_with_broadcast_compatible_shapes_is_rejected():
    # (1, 3, H, W) as a one-frame video vs (3, H, W) as an image: equal after broadcasting only
    media = (MediaInput(Modality.IMAGE, MediaRole.IMAGE, _image(5)),
             MediaInput(Modality.VIDEO, MediaRole.FIRST_FRAME, _image(5, (1, 3, H, W))))
    with pytest.raises(ConflictingInputError) as e:
        normalize_media(media, Task.FL2VA, RID)
    assert e.value.field == "media[1].data"
    assert e.value.expected == (3, H, W) and e.value.actual == (1, 3, H, W)
    # same rank, broadcastable (3, 1, W) vs (3, H, W), equal values: still rejected
    media = (MediaInput(Modality.IMAGE, MediaRole.IMAGE, _image(5, (3, 1, W))),
             MediaInput(Modality.IMAGE, MediaRole.FIRST_FRAME, _image(5)))
    with pytest.raises(ConflictingInputError):
        normalize_media(media, Task.FL2VA, RID)


def test_image_role_is_not_an_alias_outside_fl2va():
    media = (MediaInput(Modality.IMAGE, MediaRole.IMAGE, _image(1)),
             MediaInput(Modality.IMAGE, MediaRole.FIRST_FRAME, _image(2)))
    out = normalize_media(media, Task.T2VA, RID)
    assert set(out) == {MediaRole.IMAGE, MediaRole.FIRST_FRAME}


def test_empty_media_tuple_is_distinct_from_none():
    empty, absent = _request(media=()), _request(media=None)
    assert empty.media == () and absent.media is None      # the request keeps the difference
    assert normalize_media(empty.media, Task.T2I, RID) == {}
    assert normalize_media(absent.media, Task.T2I, RID) == {}
    round_trip = pickle.loads(pickle.dumps(empty))
    assert round_trip.media == () and round_trip.media is not None


@pytest.mark.parametrize("item,error", [
    (MediaInput(Modality.IMAGE, MediaRole.REFERENCE, torch.zeros(3, H, W)), MediaFormatError),
    (MediaInput(Modality.IMAGE, MediaRole.REFERENCE, _image(0, (H, W))), MediaFormatError),
    (MediaInput(Modality.VIDEO, MediaRole.REFERENCE, _image(0, (3, H, W))), MediaFormatError),
    (MediaInput(Modality.AUDIO, MediaRole.REFERENCE, torch.zeros(1, 16, dtype=torch.int16)),
     MediaFormatError),
    (MediaInput(Modality.AUDIO, MediaRole.REFERENCE,
                torch.tensor([[0.0, float("nan")]])), NonFiniteError),
    (MediaInput(Modality.AUDIO, MediaRole.REFERENCE,
                torch.tensor([[0.0, float("inf")]])), NonFiniteError),
])
def test_bad_media_tensor(item, error):
    with pytest.raises(error) as e:
        normalize_media((MediaInput(Modality.IMAGE, MediaRole.IMAGE, _image()), item), Task.T2I,
                        RID)
    assert e.value.field == "media[1].data" and e.value.request_id == RID


def test_numpy_views_and_bad_numpy_dtypes():
    flipped = np.arange(3 * H * W, dtype=np.uint8).reshape(3, H, W)[:, ::-1]   # negative strides
    out = normalize_media((MediaInput(Modality.IMAGE, MediaRole.IMAGE, flipped),), Task.T2I, RID)
    assert torch.equal(out[MediaRole.IMAGE].data, torch.from_numpy(flipped.copy()))
    objects = np.array([[None, None]], dtype=object)
    with pytest.raises(MediaFormatError) as e:
        normalize_media((MediaInput(Modality.AUDIO, MediaRole.REFERENCE, objects),), Task.T2I, RID)
    assert e.value.field == "media[0].data" and e.value.request_id == RID


def test_media_entry_of_wrong_type():
    with pytest.raises(InvalidRequestError) as e:
        normalize_media(({"modality": "image"},), Task.T2I, RID)
    assert e.value.field == "media[0]"


# ---- requested artifacts ------------------------------------------------------------------
DECLARED = ("latent", "image")


def test_requested_none_uses_declared_and_empty_is_rejected():
    assert check_requested_artifacts(_request(requested_artifacts=None), DECLARED) == DECLARED
    with pytest.raises(InvalidRequestError) as e:
        check_requested_artifacts(_request(requested_artifacts=()), DECLARED)
    assert e.value.field == "requested_artifacts" and e.value.request_id == RID


def test_requested_but_undeclared():
    with pytest.raises(UndeclaredArtifactError) as e:
        check_requested_artifacts(_request(requested_artifacts=("image", "video")), DECLARED)
    assert e.value.field == "requested_artifacts" and e.value.actual == "video"
    assert e.value.request_id == RID


def test_requested_twice():
    with pytest.raises(DuplicateInputError) as e:
        check_requested_artifacts(_request(requested_artifacts=("image", "image")), DECLARED)
    assert e.value.field == "requested_artifacts"


# ---- artifact specs and collected artifacts ----------------------------------------------
LATENT = ArtifactSpec("latent", Modality.IMAGE, Representation.LATENT, Layout.LATENT_CHW)
IMAGE = ArtifactSpec("image", Modality.IMAGE, Representation.DECODED, Layout.CHW, source="latent")
VIDEO = ArtifactSpec("video", Modality.VIDEO, Representation.DECODED, Layout.TCHW,
                     source="video_latent")
AUDIO = ArtifactSpec("audio", Modality.AUDIO, Representation.DECODED, Layout.CT,
                     source="audio_latent")
IO = IOSpec(artifacts=(LATENT, IMAGE), defaults=("image",))


def _latent(batch=2):
    return MediaArtifact(LATENT, torch.randn(batch, 4, 4, 4))


def _decoded_image(batch=2):
    return MediaArtifact(IMAGE, torch.zeros(batch, 3, H, W, dtype=torch.uint8))


def test_collect_accepts_requested_artifacts():
    out = collect_artifacts(IO, ("latent", "image"), [_latent(), _decoded_image()], RID)
    assert set(out) == {"latent", "image"}


def test_declared_but_missing():
    with pytest.raises(MissingArtifactError) as e:
        collect_artifacts(IO, ("latent", "image"), [_latent()], RID)
    assert e.value.field == "artifacts.image" and e.value.request_id == RID


def test_returned_but_undeclared():
    stray = MediaArtifact(ArtifactSpec("depth", Modality.IMAGE, Representation.LATENT,
                                       Layout.LATENT_CHW), torch.randn(2, 1, 4, 4))
    with pytest.raises(UnexpectedArtifactError) as e:
        collect_artifacts(IO, ("image",), [_decoded_image(), stray], RID)
    assert e.value.field == "artifacts.depth" and e.value.request_id == RID


def test_returned_but_not_requested():
    with pytest.raises(UnexpectedArtifactError) as e:
        collect_artifacts(IO, ("image",), [_decoded_image(), _latent()], RID)
    assert e.value.field == "artifacts.latent"


def test_returned_twice_and_spec_mismatch():
    with pytest.raises(DuplicateInputError) as e:
        collect_artifacts(IO, ("image",), [_decoded_image(), _decoded_image()], RID)
    assert e.value.field == "artifacts.image"
    other = ArtifactSpec("image", Modality.IMAGE, Representation.DECODED, Layout.CHW,
                         source="latent", fps=3.0)
    with pytest.raises(UnexpectedArtifactError) as e:
        collect_artifacts(IO, ("image",), [MediaArtifact(other, _decoded_image().data)], RID)
    assert e.value.field == "artifacts.image"


@pytest.mark.parametrize("artifact,field", [
    (MediaArtifact(IMAGE, torch.zeros(2, 3, H, W)), "artifacts.image.dtype"),        # float pixels
    (MediaArtifact(VIDEO, torch.zeros(2, 2, 3, H, W), {"fps": 8.0}), "artifacts.video.dtype"),
    (MediaArtifact(AUDIO, torch.zeros(2, 1, 64, dtype=torch.int16), {"sample_rate": 16000}),
     "artifacts.audio.dtype"),                                                       # int audio
    (MediaArtifact(LATENT, torch.zeros(2, 4, 4, 4, dtype=torch.int32)),
     "artifacts.latent.dtype"),                                                      # int latent
    (MediaArtifact(IMAGE, torch.zeros(3, H, W, dtype=torch.uint8)), "artifacts.image.shape"),
    (MediaArtifact(IMAGE, [[0]]), "artifacts.image"),
])
def test_artifact_format(artifact, field):
    with pytest.raises(MediaFormatError) as e:
        validate_artifact(artifact, RID)
    assert e.value.field == field and e.value.request_id == RID


def test_missing_fps_and_sample_rate():
    with pytest.raises(MediaFormatError) as e:
        validate_artifact(MediaArtifact(VIDEO, torch.zeros(1, 2, 3, H, W, dtype=torch.uint8)))
    assert e.value.field == "artifacts.video.fps"
    with pytest.raises(MediaFormatError) as e:
        validate_artifact(MediaArtifact(AUDIO, torch.zeros(1, 1, 64)))
    assert e.value.field == "artifacts.audio.sample_rate"
    # the rate may come from the spec default or the artifact's metadata
    validate_artifact(MediaArtifact(VIDEO, torch.zeros(1, 2, 3, H, W, dtype=torch.uint8),
                                    {"fps": 12.0}))
    with_default = ArtifactSpec("audio", Modality.AUDIO, Representation.DECODED, Layout.CT,
                                sample_rate=16000, source="audio_latent")
    validate_artifact(MediaArtifact(with_default, torch.zeros(1, 1, 64)))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_artifact(bad):
    data = torch.randn(2, 4, 4, 4)
    data[1, 2, 3, 0] = bad
    with pytest.raises(NonFiniteError) as e:
        validate_artifact(MediaArtifact(LATENT, data), RID)
    assert e.value.field == "artifacts.latent" and e.value.request_id == RID


@pytest.mark.parametrize("kwargs,field", [
    (dict(modality="smell", representation="latent", layout="latent:CHW"), "modality"),
    (dict(modality="image", representation="latent", layout="HWC"), "layout"),
    (dict(modality="image", representation="compressed", layout="latent:CHW"), "representation"),
    (dict(modality="image", representation="decoded", layout="latent:CHW", source="x"), "layout"),
    (dict(modality="video", representation="decoded", layout="CHW", source="x"), "layout"),
    (dict(modality="image", representation="decoded", layout="CHW"), "source"),
    (dict(modality="image", representation="latent", layout="CHW"), "layout"),
])
def test_bad_artifact_spec(kwargs, field):
    with pytest.raises(ConfigError) as e:
        ArtifactSpec("a", **kwargs)
    assert e.value.field == field


def test_spec_strings_are_parsed_into_enums():
    spec = ArtifactSpec("a", "image", "latent", "latent:CHW")
    assert spec.modality is Modality.IMAGE and spec.layout is Layout.LATENT_CHW


def test_bad_io_spec():
    with pytest.raises(DuplicateInputError) as e:
        IOSpec(artifacts=(LATENT, LATENT), defaults=())
    assert e.value.field == "artifacts"
    with pytest.raises(ConfigError) as e:
        IOSpec(artifacts=(LATENT,), defaults=("image",))
    assert e.value.field == "defaults"
    with pytest.raises(ConfigError) as e:
        IOSpec(artifacts=(IMAGE,), defaults=())                # decodes from an undeclared latent
    assert e.value.field == "source"


# ---- request limits -----------------------------------------------------------------------
LIMITS = RequestLimits(max_samples_per_prompt=4, max_steps=20, max_height=64, max_width=64,
                       max_frames=9, max_tokens=8)


def _over(field):
    sampling = dict(seeds=(0,), num_steps=20, height=64, width=64, num_frames=9)
    tokens, negative, extra = (1,) * 8, (2,) * 8, {"t5": (3,) * 8}
    if field == "sampling.seeds":
        sampling["seeds"] = tuple(range(5))
    elif field == "prompt.token_ids":
        tokens = (1,) * 9
    elif field == "prompt.negative.token_ids":
        negative = (2,) * 9
    elif field == "prompt.encoder_token_ids.t5":
        extra = {"t5": (3,) * 9}
    elif field is not None:
        key = field.split(".")[1]
        sampling[key] += 1
    return _request(prompt=PromptBundle(token_ids=tokens, encoder_token_ids=extra,
                                        negative=PromptBundle(token_ids=negative,
                                                              encoder_token_ids=extra)),
                    sampling=SamplingSpec(**sampling))


def test_limits_at_the_bound_pass():
    check_limits(_over(None), LIMITS)


@pytest.mark.parametrize("field", ["sampling.seeds", "sampling.num_steps", "sampling.height",
                                   "sampling.width", "sampling.num_frames", "prompt.token_ids",
                                   "prompt.negative.token_ids", "prompt.encoder_token_ids.t5"])
def test_each_limit(field):
    with pytest.raises(LimitExceededError) as e:
        check_limits(_over(field), LIMITS)
    assert e.value.field == field and e.value.request_id == RID
    assert e.value.http_status == 413


# ---- pydantic models ----------------------------------------------------------------------
def _loc(err: ValidationError) -> tuple:
    return err.errors()[0]["loc"]


@pytest.mark.parametrize("model,kwargs,loc", [
    (PromptBundle, dict(token_ids=(1,), colour="red"), ("colour",)),
    (SamplingSpec, dict(seeds=(1,), temperature=1.0), ("temperature",)),
    (RequestLimits, dict(max_gpus=1), ("max_gpus",)),
    (PromptBundle, dict(token_ids=()), ("token_ids",)),
    (PromptBundle, dict(token_ids=(1, 2), attention_mask=(1,)), ("attention_mask",)),
    (SamplingSpec, dict(seeds=()), ("seeds",)),
    (SamplingSpec, dict(seeds=(1,), sde_window=(3, 2)), ("sde_window",)),
    (SamplingSpec, dict(seeds=(1,), num_steps=4, sde_window=(0, 5)), ("sde_window",)),
    (SamplingSpec, dict(seeds=(1,), sde_window=(-1, 2)), ("sde_window",)),
    (SamplingSpec, dict(seeds=(1,), num_steps=0), ("num_steps",)),
    (SamplingSpec, dict(seeds=(1,), noise_level=-0.1), ("noise_level",)),
    (SamplingSpec, dict(seeds=(1,), sampler="euler"), ("sampler",)),
])
def test_pydantic_errors_name_the_field(model, kwargs, loc):
    with pytest.raises(ValidationError) as e:
        model(**kwargs)
    assert _loc(e.value) == loc


def test_pydantic_models_are_frozen():
    spec = SamplingSpec(seeds=(1, 2))
    with pytest.raises(ValidationError):
        spec.num_steps = 3
    assert spec.window == (0, 9) and spec.samples_per_prompt == 2


# ---- errors cross processes ---------------------------------------------------------------
@pytest.mark.parametrize("cls", [InvalidRequestError, ConflictingInputError, LimitExceededError,
                                 ScorerFailedError, ConfigError])
def test_error_survives_pickling(cls):
    err = cls("bad value", field="sampling.seeds", expected="<= 4", actual=(1, 2),
              request_id=RID)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert (back.message, back.field, back.expected, back.actual, back.request_id) == \
        ("bad value", "sampling.seeds", "<= 4", (1, 2), RID)
    assert str(back) == str(err)
    assert back.http_status == cls.http_status


def test_to_dict_is_the_json_error_body():
    err = LimitExceededError("too many", field="sampling.seeds", expected="<= 4",
                             actual=(1, torch.tensor(2)), request_id=RID)
    body = err.to_dict()["error"]
    assert body["type"] == "LimitExceededError"
    assert body["field"] == "sampling.seeds" and body["message"] == "too many"
    assert body["request_id"] == RID
    json.dumps(err.to_dict())                                   # JSON-safe, tensors stringified
    assert isinstance(RolloutError("x").to_dict()["error"]["field"], type(None))


def test_stochastic_sampler_with_zero_noise_level_names_the_field():
    import pydantic
    from contract import SamplingSpec, SamplerKind
    with pytest.raises(pydantic.ValidationError) as err:
        SamplingSpec(sampler=SamplerKind.SDE, noise_level=0.0, seeds=(0,))
    assert err.value.errors()[0]["loc"] == ("noise_level",)
    assert SamplingSpec(sampler=SamplerKind.ODE, noise_level=0.0, seeds=(0,)).window == (0, 0)
