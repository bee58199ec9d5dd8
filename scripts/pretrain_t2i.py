"""Pretrain the embedded tiny_t2i model on synthetic shapes and write its weights + model card.

    python -m scripts.pretrain_t2i --out adapters/weights/tiny_t2i --vae-steps 800 --dit-steps 3000

1. VAE: foreground-weighted reconstruction MSE + small KL (beta) on rendered train-split images
   (the shape covers ~10% of the pixels; weighting its pixels by 1 + fg_weight keeps its colour
   and outline sharp, which is what the verifier measures). Reported: the verifier's scores of
   the VAE's own reconstructions (the ceiling the DiT can reach).
2. Latent normalisation: shift = mean, scale = 1 / std of encoded latents (stored in vae config).
3. DiT: rectified flow matching (Liu et al. 2022; SD3, Esser et al. 2024, eq. 1-3):
   x_sigma = (1 - sigma) x0 + sigma eps, target v = eps - x0, sigma ~ logit-normal(0, 1),
   conditioned on MiniLM token states of the caption, caption dropout to "" for CFG; linear
   warm-up then cosine decay of the learning rate; each distinct training image is VAE-encoded
   once (the training set is finite: combinations x extents x jitters).
4. Evaluation: ODE Euler + CFG on held-out (eval-split) and train prompts, scored by the image
   verifier; chance = the same images scored against shuffled prompts.
Seeded end to end; single CPU thread.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from adapters.sample import LocalModels
from adapters.tiny_t2i import TinyT2IFamily, image_to_unit, vae_encode
from contract import Condition, ConfigError
from diffusion.step import Guidance, predict_velocity
from scripts.t2i_report import evaluate, evaluate_vae, plot_losses, write_model_card
from synthetic.shapes import (BACKGROUND_RGB, EXTENTS, MAX_OFFSET, ImageSpec, Split, caption,
                              render_batch, sample_specs, split_combinations)


def foreground_mask(specs: Sequence[ImageSpec], images: torch.Tensor) -> torch.Tensor:
    """float (B, 1, H, W): 1 where the rendered image differs from its background colour."""
    bg = torch.tensor([BACKGROUND_RGB[s.background] for s in specs], dtype=torch.uint8)
    return (images != bg[:, :, None, None]).any(dim=1, keepdim=True).to(torch.float32)


def warmup_cosine(warmup: int, steps: int):
    """LambdaLR factor: linear warm-up over `warmup` steps, then cosine decay to 10%."""
    def factor(k: int) -> float:
        if k < warmup:
            return (k + 1) / warmup
        progress = min(1.0, (k - warmup) / max(1, steps - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
    return factor


def train_vae(vae, steps: int, batch_size: int, lr: float, kl_beta: float, fg_weight: float,
              seed: int, probe: torch.Tensor) -> tuple[list[float], float, float]:
    """Returns (loss per step, probe recon MSE before, after)."""
    def probe_mse() -> float:
        with torch.no_grad():
            x = image_to_unit(probe)
            return float(((vae.decode(vae.encode(x).latent_dist.mode()).sample - x) ** 2).mean())

    before = probe_mse()
    vae.train().requires_grad_(True)
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(min(50, steps), steps))
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for step in tqdm(range(steps), desc="vae", mininterval=5):
        specs = sample_specs(batch_size, seed * 1_000_003 + step)
        images = render_batch(specs)                                      # (B, 3, H, W) u8
        x = image_to_unit(images)
        weight = 1.0 + fg_weight * foreground_mask(specs, images)         # (B, 1, H, W)
        dist = vae.encode(x).latent_dist
        recon = vae.decode(dist.sample(gen)).sample
        mse = (weight * (recon - x) ** 2).mean() / weight.mean()
        loss = mse + kl_beta * dist.kl().mean() / dist.mean[0].numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    vae.eval().requires_grad_(False)
    return losses, before, probe_mse()


def distinct_train_specs() -> list[ImageSpec]:
    """Every distinct train-split image: combination x extent x jitter (no eval composition)."""
    offsets = range(-MAX_OFFSET, MAX_OFFSET + 1)
    return [ImageSpec(*c, extent=e, offset=(dx, dy)) for c in split_combinations(Split.TRAIN)
            for e in EXTENTS for dx in offsets for dy in offsets]


def gradient_l1(recon: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Weighted L1 between horizontal and vertical finite differences (edges). (B, C, H, W)."""
    dx = lambda t: t[..., :, 1:] - t[..., :, :-1]                       # (B, C, H, W-1)
    dy = lambda t: t[..., 1:, :] - t[..., :-1, :]                       # (B, C, H-1, W)
    wx, wy = torch.maximum(dx(weight).abs(), weight[..., :, 1:]), weight[..., 1:, :]
    return ((wx * (dx(recon) - dx(x)).abs()).mean() / wx.mean()
            + (wy * (dy(recon) - dy(x)).abs()).mean() / wy.mean())


def finetune_decoder(vae, steps: int, batch_size: int, lr: float, fg_weight: float,
                     edge_weight: float, seed: int, probe: torch.Tensor
                     ) -> tuple[list[float], float, float]:
    """Fine-tune only the VAE decoder (post_quant_conv + decoder) with the encoder frozen, so
    the latent space (and the DiT trained in it) stays valid. Pairs: (frozen-encoder posterior
    latent -> render) of every distinct train image; half the batch uses the posterior mean,
    half a posterior sample (robustness to the DiT's imperfect latents). Loss: foreground-
    weighted L1 + edge_weight x weighted L1 of image gradients (crisp outlines: the verifier's
    shape feature is the bbox fill ratio of thresholded pixels). Returns (losses, probe recon
    MSE before, after)."""
    def probe_mse() -> float:
        with torch.no_grad():
            x = image_to_unit(probe)
            return float(((vae.decode(vae.encode(x).latent_dist.mode()).sample - x) ** 2).mean())

    specs = distinct_train_specs()
    images = render_batch(specs)                                          # (N, 3, H, W) u8
    x_all = image_to_unit(images)
    weight_all = 1.0 + fg_weight * foreground_mask(specs, images)         # (N, 1, H, W)
    with torch.no_grad():
        dists = [vae.encode(x_all[i:i + 256]).latent_dist for i in range(0, len(specs), 256)]
        mean_all = torch.cat([d.mean for d in dists])                     # (N, 4, h, w)
        std_all = torch.cat([d.std for d in dists])
    before = probe_mse()
    vae.requires_grad_(False)
    params = list(vae.decoder.parameters()) + list(vae.post_quant_conv.parameters())
    for p_ in params:
        p_.requires_grad_(True)
    vae.decoder.train()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(min(100, steps), steps))
    gen = torch.Generator().manual_seed(seed + 3)
    losses = []
    for step in tqdm(range(steps), desc="decoder", mininterval=5):
        idx = torch.randint(len(specs), (batch_size,), generator=gen)
        noisy = (torch.arange(batch_size) % 2 == 1).to(torch.float32)[:, None, None, None]
        z = mean_all[idx] + noisy * std_all[idx] * torch.randn(mean_all[idx].shape,
                                                                generator=gen)
        x, weight = x_all[idx], weight_all[idx]
        recon = vae.decode(z).sample
        l1 = (weight * (recon - x).abs()).mean() / weight.mean()
        loss = l1 + edge_weight * gradient_l1(recon, x, weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    vae.eval().requires_grad_(False)
    return losses, before, probe_mse()


def fit_latent_normalisation(vae, seed: int, n: int = 512) -> tuple[float, float]:
    """Set vae config shift/scale so DiT-space latents have mean 0, std 1. Returns them."""
    vae.register_to_config(shift_factor=0.0, scaling_factor=1.0)
    with torch.no_grad():
        z = vae_encode(vae, render_batch(sample_specs(n, seed)))
    shift, scale = float(z.mean()), float(1.0 / z.std())
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    return shift, scale


def caption_table(family: TinyT2IFamily, encoders) -> tuple[dict[str, int], Condition]:
    """Encode every train caption (and "" at index 0) once: the encoder is frozen."""
    texts = [""] + [caption(ImageSpec(*c)) for c in split_combinations(Split.TRAIN)]
    conditioner = family.conditioner
    return {t: i for i, t in enumerate(texts)}, conditioner.encode(encoders,
                                                                    conditioner.tokenize(texts))


def flow_matching_loss(family, transformer, x0: torch.Tensor, cond: Condition,
                       sigma: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """MSE(v_theta(x_sigma, sigma), eps - x0). x0, eps: (B, C, h, w); sigma: (B,)."""
    s = sigma[:, None, None, None]
    x_sigma = (1 - s) * x0 + s * eps
    v = predict_velocity(family.denoiser, {"transformer": transformer}, x_sigma, sigma, cond,
                         Guidance.none(x0.shape[0]))
    return ((v - (eps - x0)) ** 2).mean()


class LatentCache:
    """DiT-space latent (VAE mode) of each distinct spec, encoded on first use."""

    def __init__(self, vae):
        self.vae = vae
        self.latents: dict[ImageSpec, torch.Tensor] = {}

    def __call__(self, specs: Sequence[ImageSpec]) -> torch.Tensor:
        new = list(dict.fromkeys(s for s in specs if s not in self.latents))
        if new:
            with torch.no_grad():
                z = vae_encode(self.vae, render_batch(new))               # (N, 4, 8, 8)
            self.latents.update(zip(new, z))
        return torch.stack([self.latents[s] for s in specs])              # (B, 4, 8, 8)


def train_dit(adapter, transformer, vae, table: dict[str, int], cond_all: Condition,
              steps: int, batch_size: int, lr: float, dropout: float, seed: int
              ) -> tuple[list[float], float, float]:
    """Returns (loss per step, probe loss before, after) (probe: fixed batch, noise, sigmas)."""
    gen = torch.Generator().manual_seed(seed + 1)
    encode = LatentCache(vae)

    def batch(step: int, drop: bool) -> tuple[torch.Tensor, Condition, torch.Tensor,
                                               torch.Tensor]:
        specs = sample_specs(batch_size, seed * 1_000_003 + step + 7)
        x0 = encode(specs)                                                # (B, 4, 8, 8)
        rows = torch.tensor([table[caption(s)] for s in specs])
        if drop:
            rows = torch.where(torch.rand(batch_size, generator=gen) < dropout, 0, rows)
        sigma = torch.sigmoid(torch.randn(batch_size, generator=gen))    # logit-normal(0, 1)
        eps = torch.randn(x0.shape, generator=gen)
        return x0, cond_all.index_select(rows), sigma, eps

    probe = batch(-1, drop=False)

    def probe_loss() -> float:
        transformer.eval()
        with torch.no_grad():
            return float(flow_matching_loss(adapter, transformer, *probe))

    before = probe_loss()
    transformer.train().requires_grad_(True)
    opt = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(min(100, steps), steps))
    losses = []
    for step in tqdm(range(steps), desc="dit", mininterval=5):
        loss = flow_matching_loss(adapter, transformer, *batch(step, drop=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    transformer.eval().requires_grad_(False)
    return losses, before, probe_loss()


def parse_args(argv: Sequence[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--init-from", type=Path, default=None,
                        help="start from saved weights (skips the VAE and DiT stages)")
    parser.add_argument("--vae-steps", type=int, default=None, help="default 800")
    parser.add_argument("--dit-steps", type=int, default=None, help="default 3000")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--vae-batch-size", type=int, default=None,
                        help="VAE batch size (default: --batch-size)")
    parser.add_argument("--vae-lr", type=float, default=5e-3)
    parser.add_argument("--dit-lr", type=float, default=1e-3)
    parser.add_argument("--kl-beta", type=float, default=1e-4)
    parser.add_argument("--vae-fg-weight", type=float, default=4.0,
                        help="extra loss weight of the shape's pixels in the VAE/decoder loss")
    parser.add_argument("--decoder-finetune-steps", type=int, default=0,
                        help="decoder-only fine-tuning steps after the VAE and DiT (0: none)")
    parser.add_argument("--decoder-batch-size", type=int, default=16)
    parser.add_argument("--decoder-lr", type=float, default=2e-3)
    parser.add_argument("--decoder-edge-weight", type=float, default=1.0)
    parser.add_argument("--caption-dropout", type=float, default=0.1)
    parser.add_argument("--eval-samples", type=int, default=60)
    parser.add_argument("--eval-steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.init_from is not None and (args.vae_steps or args.dit_steps):
        raise ConfigError("--init-from skips the VAE and DiT stages", field="vae_steps/dit_steps",
                          expected="unset or 0 with --init-from",
                          actual=(args.vae_steps, args.dit_steps))
    args.vae_steps = (0 if args.init_from else 800) if args.vae_steps is None else args.vae_steps
    args.dit_steps = (0 if args.init_from else 3000) if args.dit_steps is None else args.dit_steps
    args.vae_batch_size = args.vae_batch_size or args.batch_size
    return args


def run(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    base = None
    if args.init_from is not None:
        adapter = TinyT2IFamily(args.init_from)
        components = {name: adapter.load(name) for name in ("transformer", "vae")}
        base_path = args.init_from / "pretrain_report.json"
        if not base_path.is_file():
            raise ConfigError("--init-from needs the pretrain report of the weights",
                              field="init_from", expected=str(base_path), actual="missing")
        base = json.loads(base_path.read_text())
        base = base.get("base") or base                          # the run that trained VAE+DiT
    else:
        adapter = TinyT2IFamily()
        components = adapter.build(seed=args.seed)
    vae, transformer = components["vae"], components["transformer"]
    times, losses = {}, {}
    probe = render_batch(sample_specs(64, 10**9 + args.seed))
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    vae_probe = dit_probe = decoder_probe = None
    if args.init_from is None:
        t0 = time.perf_counter()
        losses["VAE recon + KL"], *vae_probe = train_vae(
            vae, args.vae_steps, args.vae_batch_size, args.vae_lr, args.kl_beta,
            args.vae_fg_weight, args.seed, probe)
        shift, scale = fit_latent_normalisation(vae, args.seed + 2)
        times["vae"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        table, cond_all = caption_table(adapter, adapter.load_encoders())
        losses["DiT flow matching"], *dit_probe = train_dit(
            adapter, transformer, vae, table, cond_all, args.dit_steps, args.batch_size,
            args.dit_lr, args.caption_dropout, args.seed)
        times["dit"] = time.perf_counter() - t0
    if args.decoder_finetune_steps > 0:
        t0 = time.perf_counter()
        losses["decoder L1 + edge"], *decoder_probe = finetune_decoder(
            vae, args.decoder_finetune_steps, args.decoder_batch_size, args.decoder_lr,
            args.vae_fg_weight, args.decoder_edge_weight, args.seed, probe)
        times["decoder"] = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    adapter.save(components, args.out)
    curves_png = "loss_curves.png" if args.init_from is None else "finetune_loss_curves.png"
    plot_losses(losses, args.out / curves_png)
    t0 = time.perf_counter()
    evaluation = {}
    if args.eval_samples > 0:
        local = LocalModels({"transformer": transformer}, adapter.load_encoders(), {},
                            {"image_latent": {"vae": vae}})
        evaluation["vae_reconstruction"] = {"renders": evaluate_vae(vae, args.eval_samples,
                                                                    1_000_000)}
        for split, seed in ((Split.EVAL, 2_000_000), (Split.TRAIN, 3_000_000)):
            evaluation[split.value] = evaluate(adapter, local, split, args.eval_samples,
                                               seed, args.eval_steps, args.guidance)
    times["eval"] = time.perf_counter() - t0
    report = {"argv": list(argv) if argv is not None else [],
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "vae_params": sum(p.numel() for p in vae.parameters()),
              "dit_params": sum(p.numel() for p in transformer.parameters()),
              "vae_probe": vae_probe, "dit_probe": dit_probe, "decoder_probe": decoder_probe,
              "latent_shift": shift, "latent_scale": scale, "time_s": times, "eval": evaluation,
              "losses": losses}
    if base is not None:
        report["base"] = base
    (args.out / "pretrain_report.json").write_text(json.dumps(
        {k: v for k, v in report.items() if k != "losses"}, indent=2) + "\n")
    write_model_card(args.out / "MODEL_CARD.md", report)
    return report


if __name__ == "__main__":
    from contract.cli import run_cli
    import sys
    raise SystemExit(run_cli("python -m scripts.pretrain_t2i", run, sys.argv[1:]))
