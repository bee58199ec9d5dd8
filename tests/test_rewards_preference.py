"""PickScore, CLIPScore, LAION aesthetic, HPSv2.1 and ImageReward: tiny random weights written in
each real on-disk format once per session, loaded back through the scorers' real loaders.

Random-weight scores mean nothing; these tests check loading, formats, shapes, determinism,
batch independence, typed errors, and each score formula against an independent computation."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from contract import ArtifactSpec, ConfigError, MediaArtifact, MediaFormatError, ScoreStatus
from rewards.base import Scorer, ScoreRequest
from rewards.registry import ScorerSpec, build_scorer
from testing.snapshots import TINY_CLIP

torch.set_num_threads(1)
IMAGE = ArtifactSpec("image", "image", "decoded", "CHW", source="image_latent")
VIDEO = ArtifactSpec("video", "video", "decoded", "TCHW", source="video_latent", fps=8.0)
PROMPTS = ("a red cat", "a blue dog painting", "hello world sign")


def _images(seed=0, batch=3, h=40, w=56):
    g = torch.Generator().manual_seed(seed)
    return {"image": MediaArtifact(IMAGE, torch.randint(0, 256, (batch, 3, h, w), generator=g,
                                                        dtype=torch.uint8))}


# What the reference repositories' own code does, written here (not the scorers' code):
# OpenAI CLIP's normalisation, used by HPSv2's open_clip fork (OPENAI_DATASET_MEAN / STD) and by
# ImageReward's `_transform`; both resize the PIL image's shorter side with bicubic, centre-crop,
# ToTensor, Normalize.
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_REWARD_MEAN, IMAGE_REWARD_STD = 0.16717362830052426, 1.0333394966054072   # ImageReward.py
IMAGE_REWARD_MAX_TOKENS = 35                     # ImageReward.score: padding / truncation length


def _smooth_images(seed=0, batch=3, h=40, w=56):
    """Sums of a vertical and a horizontal sinusoid per channel, in [47, 208]: images whose
    resize is not dominated by PIL's uint8 rounding and clipping between its two passes."""
    g = torch.Generator().manual_seed(seed)
    y, x = torch.linspace(0, 1, h).view(h, 1), torch.linspace(0, 1, w).view(1, w)
    freq = torch.rand(batch, 3, 2, 1, 1, generator=g) * 3 + 0.5
    phase = torch.rand(batch, 3, 2, 1, 1, generator=g) * 2 * math.pi
    wave = torch.sin(2 * math.pi * freq[:, :, 0] * y + phase[:, :, 0]) + \
        torch.sin(2 * math.pi * freq[:, :, 1] * x + phase[:, :, 1])
    return {"image": MediaArtifact(IMAGE, (127.5 + 40 * wave).round().to(torch.uint8))}


def _published_transform(images: torch.Tensor, n_px: int) -> torch.Tensor:
    """(N, 3, H, W) uint8 -> the reference repositories' eval transform on PIL images."""
    from PIL import Image
    from torchvision.transforms import (CenterCrop, Compose, InterpolationMode, Normalize,
                                        Resize, ToTensor)
    transform = Compose([Resize(n_px, interpolation=InterpolationMode.BICUBIC), CenterCrop(n_px),
                         lambda im: im.convert("RGB"), ToTensor(),
                         Normalize(OPENAI_MEAN, OPENAI_STD)])
    return torch.stack([transform(Image.fromarray(im.permute(1, 2, 0).numpy()))
                        for im in images])


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    from testing import preference_snapshots as ps
    root = tmp_path_factory.mktemp("preference")
    clip_dir = ps.write_hf_clip_dir(root / "clip")
    return {"clip_dir": clip_dir, "root": root,
            "aesthetic_head": ps.write_aesthetic_head(root / "aesthetic.pth", input_size=16),
            "hps": ps.write_hps_checkpoint(root / "HPS_v2.1_compressed.pt", TINY_CLIP),
            "image_reward": ps.write_image_reward_dir(root / "image_reward")}


def _params(kind, ck):
    return {"pickscore": {"model_dir": ck["clip_dir"]},
            "clipscore": {"model_dir": ck["clip_dir"]},
            "aesthetic": {"clip_dir": ck["clip_dir"], "head_path": ck["aesthetic_head"]},
            "hpsv2": {"checkpoint": ck["hps"], "model_cfg": TINY_CLIP},
            "image_reward": ck["image_reward"]}[kind]


KINDS = ["pickscore", "clipscore", "aesthetic", "hpsv2", "image_reward"]


@pytest.fixture(scope="session")
def scorers(checkpoints):
    return {k: build_scorer(ScorerSpec(kind=k, params=_params(k, checkpoints))) for k in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_loads_scores_deterministic_and_batch_independent(kind, scorers):
    scorer = scorers[kind]
    assert isinstance(scorer, Scorer) and scorer.name == kind
    arts = _images()
    out = scorer.score(ScoreRequest(arts, PROMPTS))
    assert out.batch_size == 3 and out.status == (ScoreStatus.OK,) * 3
    vals = out.scores[scorer.primary]
    assert all(math.isfinite(v) for v in vals) and len({round(v, 7) for v in vals}) == 3
    again = scorer.score(ScoreRequest(arts, PROMPTS))
    assert again.scores == out.scores
    for i in range(3):
        one = {"image": MediaArtifact(IMAGE, arts["image"].data[i:i + 1])}
        single = scorer.score(ScoreRequest(one, PROMPTS[i:i + 1]))
        assert single.scores[scorer.primary][0] == pytest.approx(vals[i], abs=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_refuses_float_pixels_and_wrong_layout(kind, scorers):
    with pytest.raises(MediaFormatError) as e:
        scorers[kind].score(ScoreRequest({"image": MediaArtifact(IMAGE, torch.rand(1, 3, 8, 8))},
                                         PROMPTS[:1]))
    assert e.value.field == "artifacts.image.dtype"
    hwc = torch.zeros(1, 40, 56, 3, dtype=torch.uint8)
    with pytest.raises(MediaFormatError) as e:
        scorers[kind].score(ScoreRequest({"image": MediaArtifact(IMAGE, hwc)}, PROMPTS[:1]))
    assert e.value.field == f"{kind}.artifacts.image.shape"


def test_pickscore_and_clipscore_formulas(scorers, checkpoints):
    """Against transformers' own CLIPModel forward: logits_per_image = exp(s) * cos."""
    from transformers import CLIPModel, CLIPProcessor
    model = CLIPModel.from_pretrained(checkpoints["clip_dir"]).eval()
    proc = CLIPProcessor.from_pretrained(checkpoints["clip_dir"])
    arts = _images()
    pil = list(arts["image"].data.permute(0, 2, 3, 1).numpy())
    with torch.no_grad():
        inputs = proc(text=list(PROMPTS), images=pil, return_tensors="pt", padding=True)
        logits = model(**inputs).logits_per_image.diagonal()
    scale = model.logit_scale.detach().exp()
    pick = scorers["pickscore"].score(ScoreRequest(arts, PROMPTS))
    clip = scorers["clipscore"].score(ScoreRequest(arts, PROMPTS))
    assert torch.allclose(torch.tensor(pick.scores["pickscore"]), logits, atol=1e-4)
    cos = logits / scale
    assert torch.allclose(torch.tensor(clip.scores["clipscore"]), 2.5 * cos.clamp(min=0),
                          atol=1e-5)
    assert pick.metadata["logit_scale"] == pytest.approx(float(scale))


def _affine(state, prefix=""):
    """The linear MLP head composed into one affine map (it has no activations): (W, b)."""
    W, b = torch.eye(state[f"{prefix}layers.0.weight"].shape[1]), None
    b = torch.zeros(W.shape[0])
    for i in (0, 2, 4, 6, 7):
        w, c = state[f"{prefix}layers.{i}.weight"], state[f"{prefix}layers.{i}.bias"]
        W, b = w @ W, w @ b + c
    return W, b


def test_aesthetic_formula(scorers, checkpoints):
    from transformers import CLIPModel, CLIPProcessor
    model = CLIPModel.from_pretrained(checkpoints["clip_dir"]).eval()
    proc = CLIPProcessor.from_pretrained(checkpoints["clip_dir"])
    arts = _images()
    with torch.no_grad():
        px = proc(images=list(arts["image"].data.permute(0, 2, 3, 1).numpy()),
                  return_tensors="pt")["pixel_values"]
        emb = model.get_image_features(pixel_values=px).pooler_output
    emb = F.normalize(emb, dim=-1)
    W, b = _affine(torch.load(checkpoints["aesthetic_head"], weights_only=True))
    want = (emb @ W.T + b).squeeze(-1)
    got = torch.tensor(scorers["aesthetic"].score(ScoreRequest(arts, PROMPTS)).scores["aesthetic"])
    assert torch.allclose(got, want, atol=1e-5)
    assert got.std() > 0


# PIL's bicubic resize rounds to uint8 after each of its two passes and the scorers resize the
# float tensor: a resized image agrees to this much in the score (rounding alone moves these tiny
# models' scores by under half of it, a crop one pixel off by more than twice), one already at
# the model's size exactly
RESIZE_ATOL = {"hpsv2": 1e-3, "image_reward": 1e-4}


@pytest.mark.parametrize("size", [(64, 64), (40, 56)])
def test_hps_formula(scorers, checkpoints, size):
    """As HPSv2's img_score: open_clip's forward (output_dict) on its eval transform,
    diag(image_features @ text_features.T)."""
    import open_clip
    model = open_clip.CLIP(**TINY_CLIP, output_dict=True).eval()
    model.load_state_dict(torch.load(checkpoints["hps"], weights_only=True)["state_dict"])
    arts = _images(h=size[0], w=size[1]) if size == (64, 64) else _smooth_images(h=size[0],
                                                                                 w=size[1])
    tok = open_clip.SimpleTokenizer(context_length=TINY_CLIP["text_cfg"]["context_length"])
    with torch.no_grad():
        out = model(_published_transform(arts["image"].data,
                                         TINY_CLIP["vision_cfg"]["image_size"]),
                    tok(list(PROMPTS)))
    want = (out["image_features"] @ out["text_features"].T).diagonal()
    got = torch.tensor(scorers["hpsv2"].score(ScoreRequest(arts, PROMPTS)).scores["hps"])
    atol = 1e-5 if size == (64, 64) else RESIZE_ATOL["hpsv2"]
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


def _blip_vit_reference(sd, x, heads):
    """BLIP's ViT written out from the checkpoint tensors (pre-norm blocks, exact GELU, LN 1e-6)."""
    p = "blip.visual_encoder."
    ln = lambda t, k: F.layer_norm(t, t.shape[-1:], sd[p + k + ".weight"],  # noqa: E731
                                   sd[p + k + ".bias"], 1e-6)
    lin = lambda t, k: t @ sd[p + k + ".weight"].T + sd[p + k + ".bias"]
    h = F.conv2d(x, sd[p + "patch_embed.proj.weight"], sd[p + "patch_embed.proj.bias"],
                 stride=sd[p + "patch_embed.proj.weight"].shape[-1]).flatten(2).transpose(1, 2)
    h = torch.cat([sd[p + "cls_token"].expand(len(h), -1, -1), h], 1) + sd[p + "pos_embed"]
    i = 0
    while f"{p}blocks.{i}.norm1.weight" in sd:
        b = f"blocks.{i}."
        B, N, C = h.shape
        qkv = lin(ln(h, b + "norm1"), b + "attn.qkv").view(B, N, 3, heads, C // heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = ((q @ k.transpose(-1, -2)) / math.sqrt(C // heads)).softmax(-1) @ v
        h = h + lin(a.transpose(1, 2).reshape(B, N, C), b + "attn.proj")
        h = h + lin(F.gelu(lin(ln(h, b + "norm2"), b + "mlp.fc1")), b + "mlp.fc2")
        i += 1
    return ln(h, "norm")


def _med_bert_reference(sd, ids, mask, image_embeds, med):
    """BLIP's med.py BertModel in "multimodal" mode written out from the checkpoint tensors:
    word + position embeddings, post-norm layers of self-attention (padding masked with -1e4),
    cross-attention to the image, exact-GELU MLP."""
    p = "blip.text_encoder."
    heads, eps = med["num_attention_heads"], med["layer_norm_eps"]
    ln = lambda t, k: F.layer_norm(t, t.shape[-1:], sd[p + k + ".weight"],  # noqa: E731
                                   sd[p + k + ".bias"], eps)
    lin = lambda t, k: t @ sd[p + k + ".weight"].T + sd[p + k + ".bias"]  # noqa: E731

    def attend(h, ctx, k, bias):
        B, N, C = h.shape
        split = lambda t: t.view(B, -1, heads, C // heads).transpose(1, 2)  # noqa: E731
        q, key, v = split(lin(h, k + ".self.query")), split(lin(ctx, k + ".self.key")), \
            split(lin(ctx, k + ".self.value"))
        a = ((q @ key.transpose(-1, -2)) / math.sqrt(C // heads) + bias).softmax(-1) @ v
        return ln(h + lin(a.transpose(1, 2).reshape(B, N, C), k + ".output.dense"),
                  k + ".output.LayerNorm")

    h = sd[p + "embeddings.word_embeddings.weight"][ids] + \
        sd[p + "embeddings.position_embeddings.weight"][:ids.shape[1]]
    h = ln(h, "embeddings.LayerNorm")
    pad = ((1.0 - mask[:, None, None, :].float()) * -10000.0)
    for i in range(med["num_hidden_layers"]):
        b = f"encoder.layer.{i}."
        h = attend(h, h, b + "attention", pad)
        h = attend(h, image_embeds, b + "crossattention", 0.0)
        h = ln(h + lin(F.gelu(lin(h, b + "intermediate.dense")), b + "output.dense"),
               b + "output.LayerNorm")
    return h


@pytest.mark.parametrize("size", [(32, 32), (40, 56)])
def test_image_reward_formula(scorers, checkpoints, size):
    """As ImageReward.score: its `_transform`, BLIP's tokenizer (bert-base-uncased + [DEC] +
    [ENC]) padded / truncated at 35, ViT -> BERT cross-attending -> [CLS] -> MLP, then
    (r - mean) / std with the reference's constants; every piece written in this file."""
    import json

    from transformers import BertTokenizer
    scorer = scorers["image_reward"]
    params = checkpoints["image_reward"]
    sd = torch.load(params["checkpoint"], weights_only=True)
    med = json.loads(open(params["med_config"]).read())
    tokenizer = BertTokenizer.from_pretrained(params["tokenizer_dir"], local_files_only=True)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    arts = _images(h=size[0], w=size[1]) if size == (32, 32) else _smooth_images(h=size[0],
                                                                                 w=size[1])
    x = _published_transform(arts["image"].data, params["vision"]["image_size"])
    with torch.no_grad():
        image_embeds = _blip_vit_reference(sd, x, params["vision"]["num_attention_heads"])
        tok = tokenizer(list(PROMPTS), padding="max_length", truncation=True,
                        max_length=IMAGE_REWARD_MAX_TOKENS, return_tensors="pt")
        assert tok["input_ids"].shape == (3, 35) and bool((tok["input_ids"][:, 0] == 2).all())
        cls = _med_bert_reference(sd, tok["input_ids"], tok["attention_mask"], image_embeds,
                                  med)[:, 0]
    W, b = _affine(sd, "mlp.")
    want = ((cls @ W.T + b).squeeze(-1) - IMAGE_REWARD_MEAN) / IMAGE_REWARD_STD
    got = torch.tensor(scorer.score(ScoreRequest(arts, PROMPTS)).scores["image_reward"])
    atol = 1e-5 if size == (32, 32) else RESIZE_ATOL["image_reward"]
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    # the text encoder attends bidirectionally: a later token changes the [CLS] state
    a = scorer.score(ScoreRequest(_images(batch=1), ("a red cat",))).scores["image_reward"][0]
    b2 = scorer.score(ScoreRequest(_images(batch=1), ("a red dog",))).scores["image_reward"][0]
    assert a != b2


def test_checkpoints_in_the_wrong_format_are_config_errors(checkpoints, tmp_path):
    ck = checkpoints
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"this is not a torch file")
    cases = [
        ("aesthetic", dict(_params("aesthetic", ck), head_path=ck["hps"]), "aesthetic.head_path"),
        ("aesthetic", dict(_params("aesthetic", ck), head_path=str(junk)), "aesthetic.head_path"),
        ("hpsv2", dict(_params("hpsv2", ck), checkpoint=ck["aesthetic_head"]), "hpsv2.checkpoint"),
        ("hpsv2", dict(_params("hpsv2", ck), model_cfg=dict(TINY_CLIP, embed_dim=48)),
         "hpsv2.checkpoint"),
        ("image_reward", dict(_params("image_reward", ck), checkpoint=ck["hps"]),
         "image_reward.checkpoint"),
        ("image_reward", dict(_params("image_reward", ck), vision=dict(
            ck["image_reward"]["vision"], hidden_size=48)), "image_reward.checkpoint"),
        ("pickscore", {"model_dir": str(tmp_path)}, "pickscore.model_dir"),
        ("clipscore", {"model_dir": ck["clip_dir"], "dtype": "int8"}, "clipscore.dtype"),
    ]
    for kind, params, field in cases:
        with pytest.raises(ConfigError) as e:
            build_scorer(ScorerSpec(kind=kind, params=params))
        assert e.value.field == field, (kind, e.value)


def test_snapshot_missing_weights_is_refused(checkpoints, tmp_path):
    """A CLIP config with the vision weights absent must not load as random weights."""
    import shutil

    from safetensors.torch import load_file, save_file
    d = tmp_path / "partial"
    shutil.copytree(checkpoints["clip_dir"], d)
    sd = load_file(d / "model.safetensors")
    save_file({k: v for k, v in sd.items() if not k.startswith("vision_model.")},
              str(d / "model.safetensors"))
    for kind, params in (("pickscore", {"model_dir": str(d)}),
                         ("aesthetic", {"clip_dir": str(d),
                                        "head_path": checkpoints["aesthetic_head"]})):
        with pytest.raises(ConfigError, match="lacks weights"):
            build_scorer(ScorerSpec(kind=kind, params=params))


def test_video_frames_are_sampled_averaged_and_recorded(scorers, checkpoints):
    video = build_scorer(ScorerSpec(kind="pickscore", params=_params("pickscore", checkpoints),
                                    video={"artifact": "video", "num_frames": 3}))
    assert video.required_artifacts == ("video",) and video.primary == "pickscore"
    g = torch.Generator().manual_seed(3)
    clips = torch.randint(0, 256, (2, 9, 3, 32, 32), generator=g, dtype=torch.uint8)
    out = video.score(ScoreRequest({"video": MediaArtifact(VIDEO, clips)}, PROMPTS[:2]))
    assert out.metadata["frame_indices"] == [1, 4, 7] and out.metadata["num_frames"] == 9
    image = scorers["pickscore"]
    for i in range(2):
        frames = {"image": MediaArtifact(IMAGE, clips[i, [1, 4, 7]])}
        per_frame = image.score(ScoreRequest(frames, (PROMPTS[i],) * 3)).scores["pickscore"]
        assert out.scores["pickscore"][i] == pytest.approx(sum(per_frame) / 3, abs=1e-5)
    with pytest.raises(MediaFormatError) as e:                        # fewer frames than declared
        video.score(ScoreRequest({"video": MediaArtifact(VIDEO, clips[:, :2])}, PROMPTS[:2]))
    assert e.value.field == "pickscore.artifacts.video.frames"
