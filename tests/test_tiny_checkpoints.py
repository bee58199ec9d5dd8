"""The tiny checkpoints are real diffusers checkpoints: diffusers' own pipelines load them from
disk (local files only) and sample with them, the same seed rebuilds them byte for byte, their
tokenizers behave as the published ones, and no tensor is left at a constant initial value."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

import diffusers
from diffusers import DiffusionPipeline
from adapters.families import TINY_CHECKPOINTS
from testing.tiny_checkpoints import PIPELINE_CLASSES, SAMPLE_SIZES, Family, build, main
from testing.tiny_families import VOCAB_SIZE

FAMILIES = [f.value for f in Family]      # every tiny checkpoint the family table declares
PROMPT = "a robot dancing in the rain"
OTHER_PROMPT = "a golden castle on top of a hill at sunset"
# LTX-2's defaults add STG and modality-isolation forwards and x0 rescaling: pin them off.
LTX2_PLAIN = dict(guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0)

LATENT_SHAPES = {
    "sd3": [(1, 16, 8, 12)], "flux": [(1, 24, 64)],           # FLUX: packed 2x2 tokens
    "flux_kontext": [(1, 24, 64)],             # the source's appended tokens cut off again
    "wan21": [(1, 16, 3, 4, 6)], "wan21_i2v": [(1, 16, 3, 4, 6)], "wan22": [(1, 16, 3, 4, 6)],
    "ltx2": [(1, 4, 2, 2, 3), (1, 2, 9, 4)],                  # video, audio (unpacked)
}
DECODED_SHAPES = {
    "sd3": [(1, 3, 64, 96)], "flux": [(1, 3, 64, 96)], "flux_kontext": [(1, 3, 64, 96)],
    "wan21": [(1, 9, 3, 32, 48)], "wan21_i2v": [(1, 9, 3, 32, 48)], "wan22": [(1, 9, 3, 32, 48)],
    # 9 frames at 25 fps: L = round(9 / 25 * 16000 / 160 / 4) = 9 audio latents,
    # 4L - 3 = 33 mel frames, 240 samples each at 24 kHz.
    "ltx2": [(1, 9, 3, 64, 96), (1, 2, 33 * 240)],
}
TEXT_STACKS = {
    "sd3": [("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2"),
            ("tokenizer_3", "text_encoder_3")],
    "flux": [("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2")],
    "flux_kontext": [("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2")],
    "wan21": [("tokenizer", "text_encoder")], "wan21_i2v": [("tokenizer", "text_encoder")],
    "wan22": [("tokenizer", "text_encoder")], "ltx2": [("tokenizer", "text_encoder")],
}
# the checkpoints testing/tiny_families.py builds, whose sampled shapes and tokenizers this file
# states (a family with its own builder states its own in its family tests)
SAMPLED = sorted(LATENT_SHAPES)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Toy-sized ops gain nothing from intra-op threads; on a busy 2-core machine two spinning
    OpenMP threads per op cost many times the wall time of one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pipelines(tiny_checkpoint):
    """Each family's checkpoint loaded once through `DiffusionPipeline.from_pretrained`."""
    loaded = {}

    def get(family: str):
        if family not in loaded:
            pipe = DiffusionPipeline.from_pretrained(tiny_checkpoint(family), local_files_only=True)
            pipe.set_progress_bar_config(disable=True)
            loaded[family] = pipe
        return loaded[family]

    return get


def _condition_image(width: int, height: int) -> PIL.Image.Image:
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], axis=-1)
    return PIL.Image.fromarray(rgb.astype(np.uint8))


def _sample(pipe, family: str, output_type: str, prompt: str = PROMPT, **overrides):
    size = SAMPLE_SIZES[Family(family)]
    kwargs = {**size.call_kwargs(), "num_inference_steps": 2, "output_type": output_type}
    if family == "wan21_i2v":
        kwargs["image"] = _condition_image(size.width, size.height)
    if family == "flux_kontext":     # an edit: a source of another size, kept as it is
        kwargs.update(image=_condition_image(80, 48), _auto_resize=False,
                      max_area=size.height * size.width)
    if family == "ltx2":
        kwargs.update(LTX2_PLAIN)
    kwargs.update(overrides)
    out = pipe(prompt=prompt, generator=torch.Generator().manual_seed(0), **kwargs)
    if family == "ltx2":
        return [out.frames, out.audio]
    return [out.images if family in ("sd3", "flux", "flux_kontext") else out.frames]


def _files(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("family", SAMPLED)
def test_diffusers_pipelines_load_and_sample(family, pipelines, tiny_checkpoint):
    pipe = pipelines(family)
    assert type(pipe).__name__ == PIPELINE_CLASSES[Family(family)]
    own = getattr(diffusers, PIPELINE_CLASSES[Family(family)]).from_pretrained(
        tiny_checkpoint(family), local_files_only=True)
    own.set_progress_bar_config(disable=True)

    latents = _sample(pipe, family, "latent")
    assert [tuple(t.shape) for t in latents] == LATENT_SHAPES[family]
    assert all(torch.isfinite(t).all() for t in latents)
    for a, b in zip(latents, _sample(own, family, "latent")):
        assert torch.equal(a, b)                       # same files, same numbers
    other = _sample(pipe, family, "latent", prompt=OTHER_PROMPT)
    assert (latents[0] - other[0]).abs().max() > 1e-3   # the text condition reaches the latents
    if family == "flux_kontext":                        # and the edit's source does
        flipped = _condition_image(80, 48).transpose(PIL.Image.Transpose.FLIP_LEFT_RIGHT)
        assert (latents[0] - _sample(pipe, family, "latent", image=flipped)[0]).abs().max() > 1e-3

    decoded = _sample(pipe, family, "pt")
    assert [tuple(t.shape) for t in decoded] == DECODED_SHAPES[family]
    assert decoded[0].min() >= 0 and decoded[0].max() <= 1        # images / frames in [0, 1]
    assert all(torch.isfinite(t).all() for t in decoded)
    if family == "ltx2":
        assert pipe.vocoder.config.output_sampling_rate == 24000
        assert decoded[1].abs().max() > 0


def test_wan22_switches_experts_at_the_boundary(pipelines):
    pipe = pipelines("wan22")
    calls = {"transformer": 0, "transformer_2": 0}
    hooks = [getattr(pipe, name).register_forward_hook(
        lambda *_, name=name: calls.__setitem__(name, calls[name] + 1)) for name in calls]
    try:
        _sample(pipe, "wan22", "latent", num_inference_steps=4, guidance_scale=5.0)
    finally:
        for hook in hooks:
            hook.remove()
    boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
    high = int((pipe.scheduler.timesteps >= boundary).sum())
    assert pipe.config.boundary_ratio == 0.875 and 0 < high < 4
    assert calls == {"transformer": 2 * high, "transformer_2": 2 * (4 - high)}   # cond + uncond


# The sigmas each pipeline sets at its sized call with 4 steps (docs/MODEL_FAMILIES.md): SD3 and
# Wan shift a linspace between the already-shifted extremes again; FLUX and LTX-2 pass
# linspace(1, 1/n, n) and a mu from the token count (LTX-2 then stretches to 0.1).
PIPELINE_SIGMAS = {
    "sd3": [1.0, 0.85769, 0.60215, 0.00893, 0.0],
    "flux": [1.0, 0.82626, 0.61319, 0.34573, 0.0],
    "wan21": [1.0, 0.93398, 0.78135, 0.04676, 0.0],
    "wan22": [1.0, 0.85769, 0.60215, 0.00893, 0.0],
    "ltx2": [1.0, 0.77498, 0.48569, 0.1, 0.0],
}


@pytest.mark.parametrize("family", sorted(PIPELINE_SIGMAS))
def test_pipeline_sigmas_are_the_documented_ones(family, pipelines):
    pipe = pipelines(family)
    _sample(pipe, family, "latent", num_inference_steps=4)
    torch.testing.assert_close(pipe.scheduler.sigmas, torch.tensor(PIPELINE_SIGMAS[family]),
                               atol=1e-5, rtol=0)


def test_ltx2_condition_pipelines_share_the_checkpoint(tiny_checkpoint, pipelines):
    from diffusers import LTX2ConditionPipeline, LTX2ImageToVideoPipeline
    from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition

    size = SAMPLE_SIZES[Family.LTX2]
    image = _condition_image(size.width, size.height)
    i2v = LTX2ImageToVideoPipeline.from_pretrained(tiny_checkpoint("ltx2"), local_files_only=True)
    condition = LTX2ConditionPipeline.from_pretrained(tiny_checkpoint("ltx2"), local_files_only=True)
    text_only = _sample(pipelines("ltx2"), "ltx2", "latent")
    for pipe, inputs in ((i2v, {"image": image}),
                         (condition, {"conditions": [LTX2VideoCondition(frames=image, index=0),
                                                     LTX2VideoCondition(frames=image, index=8)]})):
        pipe.set_progress_bar_config(disable=True)
        latents = _sample(pipe, "ltx2", "latent", **inputs)
        assert [tuple(t.shape) for t in latents] == LATENT_SHAPES["ltx2"]
        assert (latents[0] - text_only[0]).abs().max() > 1e-3


def test_ltx2_normalises_the_latents_it_is_given(pipelines):
    """`latents=` / `audio_latents=` are taken as raw VAE latents and normalised (and packed)."""
    pipe = pipelines("ltx2")
    video = torch.randn(1, 4, 2, 2, 3, generator=torch.Generator().manual_seed(1))
    audio = torch.randn(1, 2, 9, 4, generator=torch.Generator().manual_seed(2))
    vae, audio_vae = pipe.vae, pipe.audio_vae
    packed = pipe.prepare_latents(latents=video, dtype=torch.float32, device="cpu")
    mean, std = vae.latents_mean.view(1, -1, 1, 1, 1), vae.latents_std.view(1, -1, 1, 1, 1)
    expected = ((video - mean) * vae.config.scaling_factor / std).permute(0, 2, 3, 4, 1)
    torch.testing.assert_close(packed, expected.reshape(1, 12, 4))
    packed_audio = pipe.prepare_audio_latents(latents=audio, dtype=torch.float32, device="cpu")
    flat = audio.transpose(1, 2).flatten(2, 3)                   # [B, L, C * M]
    torch.testing.assert_close(packed_audio, (flat - audio_vae.latents_mean) / audio_vae.latents_std)


@pytest.mark.parametrize("family", FAMILIES)
def test_same_seed_rebuilds_identical_files(family, tiny_checkpoint, tmp_path):
    assert _files(build(family, tmp_path, seed=0)) == _files(tiny_checkpoint(family))


def test_the_shared_builders_checkpoints_are_all_stated():
    assert set(SAMPLED) == set(DECODED_SHAPES) == set(TEXT_STACKS) == \
        {f.value for f in Family if TINY_CHECKPOINTS[f.value].builder and
         TINY_CHECKPOINTS[f.value].builder.startswith("testing.tiny_families:")}


def test_another_seed_changes_weights_not_tokenizers(tiny_checkpoint, tmp_path):
    seed0, seed1 = _files(tiny_checkpoint("wan21")), _files(build("wan21", tmp_path, seed=1))
    assert seed0.keys() == seed1.keys()
    changed = {name for name in seed0 if seed0[name] != seed1[name]}
    assert {"transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
            "text_encoder/model.safetensors"} <= changed
    assert not {name for name in changed if name.startswith(("tokenizer/", "scheduler/"))}


@pytest.mark.parametrize("family", SAMPLED)
def test_tokenizers_match_their_text_encoders(family, pipelines, tiny_checkpoint):
    pipe = pipelines(family)
    index = json.loads((tiny_checkpoint(family) / "model_index.json").read_text())
    for tokenizer_name, encoder_name in TEXT_STACKS[family]:
        tokenizer, encoder = getattr(pipe, tokenizer_name), getattr(pipe, encoder_name)
        config = getattr(encoder.config, "text_config", encoder.config)
        assert len(tokenizer) == config.vocab_size == VOCAB_SIZE
        ids = tokenizer(PROMPT, padding="max_length", max_length=24).input_ids
        assert max(ids) < config.vocab_size
        assert tokenizer.unk_token_id not in tokenizer(PROMPT, add_special_tokens=False).input_ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == PROMPT
        kind = index[tokenizer_name][1]
        if kind == "CLIPTokenizer":
            assert tokenizer.model_max_length == 77
            eos = tokenizer.eos_token_id
            assert ids[0] == tokenizer.bos_token_id and eos == VOCAB_SIZE - 1
            assert ids.index(eos) == int(torch.tensor(ids).argmax())   # CLIP's pooled position
            # SD3's second CLIP tokenizer pads with "!" (id 0), as the published one.
            pad = ("!", 0) if (family, tokenizer_name) == ("sd3", "tokenizer_2") else ("<|endoftext|>", eos)
            assert (tokenizer.pad_token, tokenizer.pad_token_id) == pad and ids[-1] == pad[1]
        elif kind == "T5TokenizerFast":
            length = ids.index(tokenizer.eos_token_id) + 1
            assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)
            assert set(ids[length:]) == {0}
            # T5's sentinels close the vocabulary in reverse: <extra_id_0> is the last id.
            assert [tokenizer.convert_tokens_to_ids(f"<extra_id_{i}>") for i in (0, 99)] == \
                [VOCAB_SIZE - 1, VOCAB_SIZE - 100]
        elif kind == "GemmaTokenizerFast":
            assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 1, 2)
            assert tokenizer.padding_side == "left"
            assert ids[ids.index(2):][0] == 2 and set(ids[:ids.index(2)]) == {0}   # pads, <bos>, text
            assert encoder.config.image_token_index == tokenizer.convert_tokens_to_ids("<image_soft_token>")
        else:
            raise AssertionError(f"unexpected tokenizer class {kind}")


def test_clip_vocab_and_merges_alone_load_the_same_tokenizer(tiny_checkpoint, tmp_path):
    """Published SD3 / FLUX checkpoints ship CLIP as vocab.json + merges.txt, no tokenizer.json."""
    from transformers import CLIPTokenizer

    for name in ("tokenizer", "tokenizer_2"):
        full = tiny_checkpoint("sd3") / name
        published = tmp_path / name
        shutil.copytree(full, published, ignore=shutil.ignore_patterns("tokenizer.json"))
        a, b = CLIPTokenizer.from_pretrained(full), CLIPTokenizer.from_pretrained(published)
        assert not (published / "tokenizer.json").exists()
        for text in (PROMPT, OTHER_PROMPT, "Hello, World! 3D"):
            assert a(text, padding="max_length", max_length=77).input_ids == \
                b(text, padding="max_length", max_length=77).input_ids


def _components(family: str, tiny_checkpoint, pipelines) -> dict:
    """The checkpoint's components: through its DiffusionPipeline, or (a modular layout, which
    DiffusionPipeline does not load) each one as model_index.json names it."""
    if TINY_CHECKPOINTS[family].writer is None:
        return pipelines(family).components
    from adapters.checkpoint import load_component
    root = tiny_checkpoint(family)
    index = json.loads((root / "model_index.json").read_text())
    return {name: load_component(root, name) for name in index if not name.startswith("_")}


@pytest.mark.parametrize("family", FAMILIES)
def test_no_saved_tensor_is_left_constant(family, pipelines, tiny_checkpoint):
    checked, constant = 0, []
    for name, component in _components(family, tiny_checkpoint, pipelines).items():
        if not isinstance(component, torch.nn.Module):
            continue
        for key, tensor in component.state_dict().items():
            if tensor.is_floating_point() and tensor.numel() > 1:
                checked += 1
                if bool(torch.all(tensor == tensor.flatten()[0])):
                    constant.append(f"{name}.{key}")
    assert checked > 20 and constant == []


def test_existing_directory_is_not_replaced(tiny_checkpoint):
    path = tiny_checkpoint("wan21")
    before = _files(path)
    with pytest.raises(FileExistsError, match="wan21"):
        build("wan21", path.parent)
    assert _files(path) == before


def test_command_line_builds_into_the_out_directory(tmp_path, capsys):
    main(["--family", "wan21", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "wan21" / "model_index.json").read_text())["_class_name"] == "WanPipeline"
    assert str(tmp_path / "wan21") in capsys.readouterr().out
