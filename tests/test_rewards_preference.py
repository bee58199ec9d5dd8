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
from rewards.snapshots import TINY_CLIP

torch.set_num_threads(1)
IMAGE = ArtifactSpec("image", "image", "decoded", "CHW", source="image_latent")
VIDEO = ArtifactSpec("video", "video", "decoded", "TCHW", source="video_latent", fps=8.0)
PROMPTS = ("a red cat", "a blue dog painting", "hello world sign")


def _images(seed=0, batch=3, h=40, w=56):
    g = torch.Generator().manual_seed(seed)
    return {"image": MediaArtifact(IMAGE, torch.randint(0, 256, (batch, 3, h, w), generator=g,
                                                        dtype=torch.uint8))}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    from rewards import preference_snapshots as ps
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


def test_hps_formula(scorers, checkpoints):
    """Against open_clip's forward (output_dict): diag(image_features @ text_features.T)."""
    import open_clip
    from rewards.embedding import CLIP_MEAN, CLIP_STD, pixels_to_model
    model = open_clip.CLIP(**TINY_CLIP, output_dict=True).eval()
    model.load_state_dict(torch.load(checkpoints["hps"], weights_only=True)["state_dict"])
    arts = _images()
    tok = open_clip.SimpleTokenizer(context_length=TINY_CLIP["text_cfg"]["context_length"])
    with torch.no_grad():
        out = model(pixels_to_model(arts["image"].data, 64, CLIP_MEAN, CLIP_STD),
                    tok(list(PROMPTS)))
    want = (out["image_features"] @ out["text_features"].T).diagonal()
    got = torch.tensor(scorers["hpsv2"].score(ScoreRequest(arts, PROMPTS)).scores["hps"])
    assert torch.allclose(got, want, atol=1e-5)


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


def test_image_reward_formula(scorers, checkpoints):
    from rewards.embedding import CLIP_MEAN, CLIP_STD, pixels_to_model
    from rewards.image_reward import REWARD_MEAN, REWARD_STD
    scorer = scorers["image_reward"]
    params = checkpoints["image_reward"]
    sd = torch.load(params["checkpoint"], weights_only=True)
    arts = _images()
    x = pixels_to_model(arts["image"].data, params["vision"]["image_size"], CLIP_MEAN, CLIP_STD)
    with torch.no_grad():
        image_embeds = _blip_vit_reference(sd, x, params["vision"]["num_attention_heads"])
        assert torch.allclose(scorer._vision(pixel_values=x).last_hidden_state, image_embeds,
                              atol=1e-5)       # BLIP key renaming is right
        tok = scorer._tokenizer(list(PROMPTS), padding="max_length", truncation=True,
                                max_length=35, return_tensors="pt")
        assert tok["input_ids"].shape == (3, 35) and bool((tok["input_ids"][:, 0] == 2).all())
        cls = scorer._text(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"],
                           encoder_hidden_states=image_embeds, is_decoder=False
                           ).last_hidden_state[:, 0]
    W, b = _affine(sd, "mlp.")
    want = ((cls @ W.T + b).squeeze(-1) - REWARD_MEAN) / REWARD_STD
    got = torch.tensor(scorer.score(ScoreRequest(arts, PROMPTS)).scores["image_reward"])
    assert torch.allclose(got, want, atol=1e-5)
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
