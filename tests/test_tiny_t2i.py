"""The embedded tiny_t2i family: shipped weights, token ids, inference form, pretraining."""
from __future__ import annotations

import pytest
import torch

from adapters.inference_form import ShardedLinear, modules_with_suffix
from adapters.registry import get_family
from adapters.sample import LocalModels, generate
from adapters.tiny_t2i import SHIPPED_WEIGHTS, TinyT2IFamily
from contract import (ArtifactSpec, ConfigError, InvalidRequestError, Layout, LimitExceededError,
                      MediaArtifact, Modality, Representation, SamplingSpec, collect_artifacts)
from diffusion.step import Guidance, predict_velocity
from rewards.base import ScoreRequest
from rewards.verifiers.image import ImageAttributeScorer
from synthetic.shapes import Split, caption, sample_specs

torch.set_num_threads(1)
# How far above chance the shipped weights score on held-out prompts (see MODEL_CARD.md).
# Shape is not in the list: on held-out compositions it is at chance (the VAE's reconstructions
# score ~0.96 on shape since the decoder fine-tune, but the DiT's held-out latents give ambiguous
# outlines; the card records it), so there it is RL's job.
MARGIN = {"color": 0.3, "position": 0.3, "background": 0.3}


@pytest.fixture(scope="module")
def loaded():
    family = get_family("tiny_t2i")
    return family, LocalModels.load(family)          # shipped weights, offline


def test_registry():
    assert isinstance(get_family("tiny_t2i"), TinyT2IFamily)
    with pytest.raises(ConfigError) as err:
        get_family("no_such_model")
    assert err.value.field == "adapter" and "tiny_t2i" in err.value.expected


def test_shipped_weights_produce_valid_artifacts(loaded):
    adapter, components = loaded
    assert (SHIPPED_WEIGHTS / "MODEL_CARD.md").is_file()
    prompts = [caption(s) for s in sample_specs(3, 0)]
    sampled = generate(adapter, components, prompts, seeds=[0, 1, 2], num_steps=4)
    named = {"image_latent": sampled["image_latent"]}
    images = adapter.codec.decode("image_latent", components.decoders["image_latent"],
                                  named["image_latent"], SamplingSpec(seeds=(0, 1, 2)))
    assert torch.equal(images, sampled["image"])
    assert images.dtype == torch.uint8 and images.shape == (3, 3, 32, 32)
    produced = [MediaArtifact(adapter.io_spec["image_latent"], named["image_latent"]),
                MediaArtifact(adapter.io_spec["image"], images)]
    out = collect_artifacts(adapter.io_spec, adapter.io_spec.defaults, produced)
    assert set(out) == {"image_latent", "image"}
    # seeded: the same seeds give the same latents
    again = generate(adapter, components, prompts, seeds=[0, 1, 2], num_steps=4)
    assert torch.equal(sampled["image_latent"], again["image_latent"])


def test_shipped_weights_follow_held_out_prompts(loaded):
    # The shipped model is above chance on colour, position and background of unseen
    # compositions (chance = the same images scored against a shuffled prompt) but not perfect
    # (headroom for RL).
    adapter, components = loaded
    specs = sample_specs(24, 7, Split.EVAL)
    prompts = [caption(s) for s in specs]
    images = generate(adapter, components, prompts, list(range(24)), num_steps=12)["image"]
    shuffled = prompts[5:] + prompts[:5]
    assert sum(p != q for p, q in zip(prompts, shuffled)) >= 20
    spec = ArtifactSpec("image", Modality.IMAGE, Representation.DECODED, Layout.CHW,
                        source="image_latent")

    def mean_scores(texts):
        out = ImageAttributeScorer().score(ScoreRequest({"image": MediaArtifact(spec, images)},
                                                        tuple(texts)))
        return {k: sum(v) / len(v) for k, v in out.scores.items()}

    matched, chance = mean_scores(prompts), mean_scores(shuffled)
    for name in MARGIN:
        assert matched[name] > chance[name] + MARGIN[name], (name, matched, chance)
    assert matched["total"] < 0.98


def test_encoder_sees_the_dataset_ids_unchanged(loaded):
    adapter, components = loaded
    texts = [caption(s) for s in sample_specs(4, 3)] + [""]
    conditioner = adapter.conditioner
    dataset_ids = [conditioner.tokenizer(t)["input_ids"] for t in texts]   # what a dataset stores
    bundles = conditioner.tokenize(texts)
    assert [list(b.token_ids) for b in bundles] == dataset_ids
    seen = {}
    encoder = components.encoders["minilm"]
    hook = encoder.register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(ids=kwargs["input_ids"].clone()),
        with_kwargs=True)
    try:
        cond = conditioner.encode(components.encoders, bundles)
    finally:
        hook.remove()
    for row, ids in enumerate(dataset_ids):
        assert seen["ids"][row, :len(ids)].tolist() == ids
        assert (seen["ids"][row, len(ids):] == conditioner.tokenizer.pad_token_id).all()
        assert cond["mask"][row].sum() == len(ids)
    assert cond.token_ids[0] == {"minilm": tuple(dataset_ids[0])}
    # a row's condition does not depend on the rest of its batch (fixed padding)
    alone = conditioner.encode(components.encoders, bundles[:1])
    torch.testing.assert_close(alone["hidden"][0], cond["hidden"][0], rtol=0, atol=1e-5)
    with pytest.raises(LimitExceededError) as err:
        conditioner.tokenize(["a red circle " * 20])
    assert err.value.field == "prompts[0]"


def test_inference_form_gives_the_same_velocity(loaded):
    adapter, components = loaded
    transformer = components.transformers["transformer"]
    fused = adapter.to_inference_form(transformer)
    assert not list(modules_with_suffix(fused, "attn.to_q"))
    assert list(modules_with_suffix(fused, "attn.to_qkv"))
    fc1_name, fc1 = next(modules_with_suffix(transformer, "ff.net.0.proj"))
    sharded = fused.get_submodule(fc1_name)
    assert isinstance(sharded, ShardedLinear) and sharded.shard_order == (1, 0)
    half = fc1.out_features // 2
    assert torch.equal(sharded.shards[0].weight, fc1.weight[half:])      # the reorder is real
    gen = torch.Generator().manual_seed(0)
    state = torch.randn(3, 4, 8, 8, generator=gen)
    cond = adapter.conditioner.encode(components.encoders, adapter.conditioner.tokenize(
        [caption(s) for s in sample_specs(3, 4)]))
    sigma = torch.tensor([0.999, 0.5, 0.02])
    with torch.no_grad():
        v_train = predict_velocity(adapter.denoiser, {"transformer": transformer}, state, sigma,
                                   cond, Guidance.none(3))
        v_infer = predict_velocity(adapter.denoiser, {"transformer": fused}, state, sigma, cond,
                                   Guidance.none(3))
    assert (v_train - v_infer).abs().max() <= 1e-5
    assert v_train.abs().mean() > 0.1


def test_sampling_spec_is_checked(loaded):
    adapter, _ = loaded
    assert adapter.codec.state_shape(SamplingSpec(seeds=(0,))) == (4, 8, 8)
    with pytest.raises(InvalidRequestError) as err:
        adapter.codec.state_shape(SamplingSpec(seeds=(0,), height=64))
    assert err.value.field == "sampling.height"
    with pytest.raises(ConfigError) as err:
        get_family("tiny_t2i", "/nonexistent/tiny_t2i")
    assert err.value.field == "weights_path"


def test_pretrain_script_reduces_the_loss(tmp_path):
    from scripts.pretrain_t2i import run
    report = run(["--out", str(tmp_path), "--vae-steps", "12", "--dit-steps", "12",
                  "--batch-size", "8", "--eval-samples", "0", "--vae-lr", "3e-3",
                  "--dit-lr", "2e-3"])
    vae_before, vae_after = report["vae_probe"]
    dit_before, dit_after = report["dit_probe"]
    assert vae_after < vae_before and dit_after < dit_before
    assert (tmp_path / "loss_curves.png").is_file()
    vae = TinyT2IFamily(tmp_path).load("vae")                       # same layout loads
    assert vae.config.scaling_factor == pytest.approx(report["latent_scale"])


def test_decoder_finetune_keeps_the_latent_space(tmp_path):
    # --init-from + --decoder-finetune-steps trains only the VAE decoder: encoder, latent
    # normalisation and DiT are bit-identical to the base weights, so the DiT's latents stay valid.
    from scripts.pretrain_t2i import gradient_l1, run
    base, out = tmp_path / "base", tmp_path / "ft"
    run(["--out", str(base), "--vae-steps", "6", "--dit-steps", "2", "--batch-size", "8",
         "--eval-samples", "0"])
    report = run(["--init-from", str(base), "--out", str(out), "--decoder-finetune-steps", "6",
                  "--decoder-batch-size", "8", "--eval-samples", "0"])
    assert len(report["losses"]["decoder L1 + edge"]) == 6
    assert report["base"]["args"]["vae_steps"] == 6
    a, b = TinyT2IFamily(base), TinyT2IFamily(out)
    vae_a, vae_b = a.load("vae"), b.load("vae")
    for name in ("encoder", "quant_conv"):
        for (key, pa), pb in zip(getattr(vae_a, name).state_dict().items(),
                                 getattr(vae_b, name).state_dict().values()):
            assert torch.equal(pa, pb), key
    assert vae_a.config.scaling_factor == vae_b.config.scaling_factor
    assert vae_a.config.shift_factor == vae_b.config.shift_factor
    for pa, pb in zip(a.load("transformer").state_dict().values(),
                      b.load("transformer").state_dict().values()):
        assert torch.equal(pa, pb)
    assert any(not torch.equal(pa, pb) for pa, pb in zip(vae_a.decoder.state_dict().values(),
                                                         vae_b.decoder.state_dict().values()))
    assert "decoder-only fine-tuning" in (out / "MODEL_CARD.md").read_text()
    with pytest.raises(ConfigError) as err:
        run(["--init-from", str(base), "--out", str(out), "--vae-steps", "3"])
    assert err.value.field == "vae_steps/dit_steps"
    # The edge loss sees a shifted edge and not a constant offset.
    x = torch.zeros(1, 1, 8, 8)
    x[..., 2:6, 2:6] = 1.0
    ones = torch.ones(1, 1, 8, 8)
    assert float(gradient_l1(x + 0.5, x, ones)) == pytest.approx(0.0)
    assert float(gradient_l1(torch.roll(x, 1, dims=-1), x, ones)) > 0.1
