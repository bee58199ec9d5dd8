"""Files and config entries a user hands the project, each checked before it is used: runtime_env
pip entries one requirement each; LoRA tensors of exact shapes, known names and finite values
where they are loaded (a diffusers file, the learner's adapters, a replica's version) and
published; dataset condition media of declared formats and depths, bounded and under the prompt
file's folder; a checkpoint marker naming a checkpoint of its own run only."""
from __future__ import annotations

import json
import os
import types

import numpy as np
import pytest
import torch
from PIL import Image

from contract import (ConfigError, DatasetError, LoRAMapError, NonFiniteError, PolicyKind,
                      PolicyVersionError)

torch.set_num_threads(1)


# ---- runtime_env pip entries ----------------------------------------------------------------
@pytest.mark.parametrize("spec", [
    "numpy\n--index-url http://x", "numpy --index-url http://x", "numpy\r\n-i http://x",
    "numpy==1.0 -i x", "numpy\t", " numpy", "numpy\x00", "-e .", "--index-url=http://x", "",
    "numpy;--index-url=x", "git+https://example.com/x", "numpy==", "numpy>=1 ; x",
])
def test_a_pip_entry_that_is_not_one_requirement_is_refused(spec):
    from deployments.config import load_graph_config
    base = {"name": "x", "scorer": {"kind": "ocr"}, "inputs": ["image"]}
    with pytest.raises(ConfigError) as refused:
        load_graph_config({"scorers": [dict(base, stage={"runtime_env": {"pip": [spec]}})]})
    assert "pip[0]" in str(refused.value)


@pytest.mark.parametrize("spec", ["textdistance==4.6.3", "numpy>=1.24,<3", "pkg[extra]~=1.2",
                                  "pkg@https://example.com/pkg-1.0-py3-none-any.whl",
                                  "/wheels/pkg-1.0-py3-none-any.whl",
                                  'pkg;python_version>="3.11"'])
def test_one_requirement_or_wheel_is_taken(spec):
    from deployments.config import ScorerRuntimeEnv
    assert ScorerRuntimeEnv(pip=(spec,)).to_ray()["pip"]["packages"] == [spec]


# ---- LoRA tensors ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from adapters.registry import get_family
    return get_family("tiny_t2i")


@pytest.fixture(scope="module")
def lora_weights(tiny):
    from trainer.lora import LoRATrainConfig
    from trainer.policy_weights import LoRAWeights
    return LoRAWeights({"transformer": tiny.load("transformer")}, tiny.spec.lora_targets,
                       LoRATrainConfig(rank=4, alpha=4.0))


def _exported(weights) -> dict[str, torch.Tensor]:
    from trainer.lora import TRAIN_ADAPTER, export_lora
    return {k: v.clone() for k, v in export_lora(weights.models["transformer"],
                                                 TRAIN_ADAPTER).items()}


@pytest.mark.parametrize("bad", ["column", "vector", "scalar", "transposed"])
def test_the_learner_refuses_a_tensor_copy_would_broadcast(lora_weights, bad):
    """(r, 1), (in,) and scalar tensors broadcast through copy_ into (r, in): refused, naming the
    tensor; the adapter keeps its values."""
    tensors = _exported(lora_weights)
    key = next(k for k in tensors if k.endswith("lora_A.weight"))
    r, width = tensors[key].shape
    tensors[key] = {"column": torch.ones(r, 1), "vector": torch.ones(width),
                    "scalar": torch.tensor(1.0), "transposed": torch.ones(width, r)}[bad]
    before = _exported(lora_weights)
    with pytest.raises(LoRAMapError) as refused:
        lora_weights.load("default", tensors)
    assert refused.value.field == f"lora[{key}]" and refused.value.expected == (r, width)
    assert all(torch.equal(before[k], v) for k, v in _exported(lora_weights).items())


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_the_learner_refuses_non_finite_lora_weights(lora_weights, value):
    tensors = _exported(lora_weights)
    key = next(k for k in tensors if k.endswith("lora_B.weight"))
    tensors[key][0, 0] = value
    with pytest.raises(NonFiniteError) as refused:
        lora_weights.load("default", tensors)
    assert refused.value.field == f"lora[{key}]"


def test_check_lora_tensors_names_what_is_wrong():
    from adapters.lora_files import check_lora_tensors
    a, b = torch.zeros(4, 8), torch.zeros(16, 4)
    good = {"m.lora_A.weight": a, "m.lora_B.weight": b}
    assert check_lora_tensors(good, "lora") == 4
    cases = {
        "unknown name": (good | {"m.alpha": torch.tensor(1.0)}, LoRAMapError, "lora[m.alpha]"),
        "vector": ({"m.lora_A.weight": torch.zeros(8), "m.lora_B.weight": b}, LoRAMapError,
                   "lora[m.lora_A.weight]"),
        "half pair": ({"m.lora_A.weight": a}, LoRAMapError, "lora[m]"),
        "ranks": ({"m.lora_A.weight": a, "m.lora_B.weight": torch.zeros(16, 1)}, LoRAMapError,
                  "lora[m.lora_B.weight]"),
        "nan": ({"m.lora_A.weight": a, "m.lora_B.weight": torch.full((16, 4), float("nan"))},
                NonFiniteError, "lora[m.lora_B.weight]"),
    }
    for name, (tensors, error, field) in cases.items():
        with pytest.raises(error) as refused:
            check_lora_tensors(tensors, "lora")
        assert refused.value.field == field, name


def test_a_lora_file_with_nan_weights_is_refused_at_load(tmp_path, tiny_checkpoint):
    from safetensors.torch import save_file

    from adapters.lora_files import load_diffusers_lora
    from adapters.registry import get_family
    from tests.lora_utils import random_lora
    family = get_family("sd3", tiny_checkpoint("sd3"), {"max_sequence_length": 32})
    tensors, _ = random_lora(family, rank=2, seed=1)
    key = sorted(tensors)[0]
    tensors[key][0, 0] = float("nan")
    save_file({f"transformer.{k}": v.contiguous() for k, v in tensors.items()},
              str(tmp_path / "pytorch_lora_weights.safetensors"))
    with pytest.raises(NonFiniteError) as refused:
        load_diffusers_lora(family, tmp_path)
    assert refused.value.field == f"lora.init_from[{key}]"


def test_a_non_finite_policy_is_neither_published_nor_served(tiny):
    from rollout.lora import map_lora_tensors
    from adapters.lora_targets import LoRATargetMap
    from tests.lora_utils import random_lora
    from trainer.sync import PolicyPublisher
    tensors, _ = random_lora(tiny, rank=2)
    key = sorted(tensors)[1]
    tensors[key][0, 0] = float("inf")
    # publish refuses before anything reaches the object store or the policy store
    publisher = types.SimpleNamespace(version=lambda name: f"run/{name}", kind=PolicyKind.LORA)
    with pytest.raises(NonFiniteError) as refused:
        PolicyPublisher.publish(publisher, "v1", 1, tensors, 1.0)
    assert refused.value.field == f"policy[{key}]" and refused.value.request_id == "run/v1"
    transformer = tiny.load("transformer")
    lora_map = LoRATargetMap.identity(tiny.spec.lora_targets["transformer"])
    with pytest.raises(PolicyVersionError) as refused:
        map_lora_tensors(transformer, lora_map, tensors, 1.0)
    assert refused.value.field == f"lora[{key}]"


# ---- dataset condition media -----------------------------------------------------------------
def _records(tmp_path, record: dict, name: str = "train.jsonl"):
    from trainer.datasets import load_prompt_file
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"prompt": "the ball bounces"} | record) + "\n")
    return load_prompt_file(path)


def _mp4(path, frames: int = 4, pix_fmt: str = "yuv420p") -> None:
    import fractions

    import av
    with av.open(str(path), mode="w",
                 format="matroska" if path.suffix == ".mkv" else "mp4") as container:
        stream = container.add_stream("libx264" if pix_fmt == "yuv420p" else "ffv1",
                                      rate=fractions.Fraction(8))
        stream.width, stream.height, stream.pix_fmt = 16, 16, pix_fmt
        for i in range(frames):
            image = np.full((16, 16, 3), 10 * i, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


@pytest.mark.parametrize("mode, numpy_dtype", [("I;16", np.uint16), ("P", np.uint8),
                                               ("RGBA", np.uint8), ("L", np.uint8)])
def test_an_image_is_never_converted_silently(tmp_path, mode, numpy_dtype):
    image = Image.fromarray(np.full((8, 8), 3, dtype=numpy_dtype)).convert(mode) \
        if mode != "I;16" else Image.fromarray(np.full((8, 8), 40000, dtype=np.uint16))
    image.save(tmp_path / "first.png")
    with pytest.raises(DatasetError) as refused:
        _records(tmp_path, {"first_frame": "first.png"})
    assert refused.value.field.endswith("train.jsonl:1") and "RGB" in refused.value.message


def test_an_rgb_image_loads_exactly(tmp_path):
    pixels = np.random.default_rng(0).integers(0, 256, (8, 6, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "first.png")
    [record] = _records(tmp_path, {"first_frame": "first.png"})
    [media] = record.media_inputs()
    assert torch.equal(media.data, torch.from_numpy(pixels).permute(2, 0, 1))


@pytest.mark.parametrize("value", ["../outside.png", "sub/../../outside.png", "ABSOLUTE",
                                   "link.png"])
def test_condition_paths_stay_under_the_prompt_files_folder(tmp_path, value):
    Image.new("RGB", (8, 8)).save(tmp_path / "outside.png")
    data = tmp_path / "data"
    data.mkdir()
    os.symlink(tmp_path / "outside.png", data / "link.png")
    value = str(tmp_path / "outside.png") if value == "ABSOLUTE" else value
    with pytest.raises(DatasetError) as refused:
        _records(data, {"first_frame": value})
    assert "leaves the prompt file's folder" in refused.value.message


def test_a_video_is_read_by_its_declared_demuxer_only(tmp_path):
    """FFmpeg picks a demuxer from the content when asked to guess (an HLS playlist named .mp4
    reads the URLs and files it lists); here the suffix declares it: mp4 bytes named .webm do
    not load, a playlist named .mp4 is only a broken mp4, and .m3u8 is no declared format."""
    _mp4(tmp_path / "clip.mp4")
    (tmp_path / "clip.webm").write_bytes((tmp_path / "clip.mp4").read_bytes())
    assert _records(tmp_path, {"video": "clip.mp4"})[0].media_inputs()[0].data.shape[0] == 4
    with pytest.raises(DatasetError, match="does not load"):
        _records(tmp_path, {"video": "clip.webm"})
    (tmp_path / "secret.txt").write_text("not for the trainer")
    playlist = ("#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\n"
                f"file://{tmp_path / 'secret.txt'}\n#EXT-X-ENDLIST\n")
    (tmp_path / "list.mp4").write_text(playlist)
    with pytest.raises(DatasetError, match="does not load"):
        _records(tmp_path, {"video": "list.mp4"})
    (tmp_path / "list.m3u8").write_text(playlist)
    with pytest.raises(DatasetError, match="no declared format"):
        _records(tmp_path, {"video": "list.m3u8"})


def test_video_frames_are_bounded_and_decoded_exactly_within(tmp_path, monkeypatch):
    import trainer.datasets as datasets
    _mp4(tmp_path / "clip.mp4", frames=6)
    [record] = _records(tmp_path, {"video": "clip.mp4"})
    assert record.media_inputs()[0].data.shape == (6, 3, 16, 16)
    monkeypatch.setattr(datasets, "MAX_VIDEO_FRAMES", 5)
    with pytest.raises(DatasetError, match="more than its bound|too many frames"):
        record.media_inputs()
    monkeypatch.setattr(datasets, "MAX_VIDEO_FRAMES", 1024)
    monkeypatch.setattr(datasets, "MAX_IMAGE_PIXELS", 15 * 16)
    with pytest.raises(DatasetError, match="too many pixels"):
        _records(tmp_path, {"video": "clip.mp4"})
    monkeypatch.setattr(datasets, "MAX_IMAGE_PIXELS", 4096 * 4096)
    monkeypatch.setattr(datasets, "MAX_MEDIA_BYTES", 64)
    with pytest.raises(DatasetError, match="too large"):
        _records(tmp_path, {"video": "clip.mp4"})


def test_a_deep_video_is_not_converted_silently(tmp_path):
    _mp4(tmp_path / "deep.mkv", frames=2, pix_fmt="yuv444p10le")
    with pytest.raises(DatasetError, match="8-bit"):
        _records(tmp_path, {"video": "deep.mkv"})


# ---- checkpoint marker -------------------------------------------------------------------------
@pytest.mark.parametrize("marker", ["../../elsewhere", "/etc", "step_000001/../../elsewhere",
                                    "step_000001/x", "..", "", "step_1"])
def test_the_latest_marker_names_a_checkpoint_of_this_run_only(tmp_path, marker):
    from trainer.logs import load_checkpoint, save_checkpoint
    run = tmp_path / "run"
    save_checkpoint(run, 1, {"default": {"w": torch.zeros(2)}}, {}, {"seed": 0})
    assert load_checkpoint(run)[2]["step"] == 1
    elsewhere = tmp_path / "elsewhere"
    save_checkpoint(tmp_path, 7, {"default": {"w": torch.ones(2)}}, {}, {})
    (tmp_path / "checkpoints" / "step_000007").rename(elsewhere)
    (run / "checkpoints" / "latest").write_text(marker)
    with pytest.raises(ConfigError) as refused:
        load_checkpoint(run)
    assert refused.value.field == "resume"
