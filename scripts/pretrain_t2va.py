"""Pretrain the tiny_t2va model on synthetic bouncing-square clips (one CPU core, minutes).

Stages (all seeded): (1) the per-frame video VAE (L1 + MSE + KL), (2) the audio VAE (waveform L1 +
multi-resolution STFT magnitude + KL), (3) the joint DiT by flow matching in the project
convention, x_sigma = (1 - sigma) x0 + sigma eps, target v = eps - x0, with the model called in its
own DATA-PROGRESS time through `diffusion.conventions` (Lipman et al. 2023, eq. 23 with a linear
path). Captions are dropped (null prompt) with p_uncond for classifier-free guidance; with p_fl2va
the first/last latent frames are frozen clean conditions (FL2VA) and left out of the loss.

    python -m scripts.pretrain_t2va --out adapters/weights/tiny_t2va
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch.nn import functional as F
from tqdm import tqdm

from adapters.tiny_t2va import TinyT2VAConfig, TinyT2VAFamily
from contract import MediaRole
from diffusion.step import Guidance, predict_velocity
from synthetic.clips import caption, render, sample_specs


def clip_pool(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """n rendered clips: video (n, T, 3, H, W) uint8, audio (n, 1, N) float32, captions."""
    specs = sample_specs(n, seed)
    clips = [render(s) for s in specs]
    video = torch.from_numpy(np.stack([c.video for c in clips]))
    audio = torch.from_numpy(np.stack([c.audio for c in clips]))
    return video, audio, [caption(s) for s in specs]


def stft_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Multi-resolution STFT magnitude loss (Yamamoto et al. 2020, eq. 4-6). (B, 1, N) inputs."""
    total = pred.new_zeros(())
    for n_fft in (256, 512, 1024):
        win = torch.hann_window(n_fft)
        sp = torch.stft(pred[:, 0], n_fft, n_fft // 4, window=win, return_complex=True).abs()
        st = torch.stft(target[:, 0], n_fft, n_fft // 4, window=win, return_complex=True).abs()
        total = total + (sp - st).norm() / st.norm().clamp_min(1e-6)               # convergence
        total = total + (torch.log(sp + 1e-5) - torch.log(st + 1e-5)).abs().mean()  # log-mag
    return total


def train_video_vae(vae, video: torch.Tensor, steps: int, batch: int, lr: float,
                    gen: torch.Generator) -> list[float]:
    frames = video.reshape(-1, *video.shape[2:])                                 # (n*T, 3, H, W)
    opt = torch.optim.AdamW(vae.parameters(), lr=lr)
    vae.train()
    losses = []
    for _ in tqdm(range(steps), desc="video vae"):
        x = frames[torch.randint(len(frames), (batch,), generator=gen)].float() / 127.5 - 1
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample(gen)).sample
        loss = (rec - x).abs().mean() + F.mse_loss(rec, x) + 1e-6 * post.kl().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    vae.eval()
    if steps == 0:
        return losses
    with torch.no_grad():   # DiT space: (z - shift) * scale with unit variance
        z = torch.cat([vae.encode(frames[i:i + 256].float() / 127.5 - 1).latent_dist.mode()
                       for i in range(0, min(len(frames), 1024), 256)])
    vae.register_to_config(shift_factor=float(z.mean()), scaling_factor=float(1 / z.std()))
    return losses


def train_audio_vae(vae, audio: torch.Tensor, steps: int, batch: int, lr: float,
                    gen: torch.Generator) -> list[float]:
    opt = torch.optim.AdamW(vae.parameters(), lr=lr)
    vae.train()
    losses = []
    for _ in tqdm(range(steps), desc="audio vae"):
        x = audio[torch.randint(len(audio), (batch,), generator=gen)]
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample(gen)).sample
        kl = 0.5 * (post.mean ** 2 + post.var - 1.0 - post.logvar).mean()          # 1-D latent KL
        loss = (rec - x).abs().mean() * 10 + stft_loss(rec, x) + 1e-4 * kl
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    vae.eval()
    return losses


def train_dit(adapter: TinyT2VAFamily, components, video: torch.Tensor, audio: torch.Tensor,
              captions: list[str], steps: int, batch: int, lr: float, p_uncond: float,
              p_fl2va: float, gen: torch.Generator, warmup: int = 100) -> list[float]:
    vvae, avae = components["video_vae"], components["audio_vae"]
    codec, conditioner = adapter.codec, adapter.conditioner
    with torch.no_grad():
        lat_v = torch.cat([codec.encode_video(vvae, video[i:i + 64]) for i in range(0, len(video), 64)])
        lat_a = torch.cat([codec.encode_audio(avae, audio[i:i + 64]) for i in range(0, len(audio), 64)])
        x0_all = codec.pack(lat_v, lat_a)                                           # (n, S)
        unique = sorted(set(captions)) + [""]
        prompts = conditioner.tokenize(unique[:-1]) + [conditioner.null_prompt()]
        enc = conditioner.encode(adapter.load_encoders(), prompts)                  # U rows
    cap_index = torch.tensor([unique.index(c) for c in captions])
    null_index = len(unique) - 1
    net = components["transformer"]
    net.train().requires_grad_(True)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    nv = int(np.prod(codec.video_latent_shape))
    losses = []
    for _ in tqdm(range(steps), desc="dit"):
        rows = torch.randint(len(x0_all), (batch,), generator=gen)
        x0 = x0_all[rows]
        ci = cap_index[rows].clone()
        ci[torch.rand(batch, generator=gen) < p_uncond] = null_index
        cond = enc.index_select(ci)
        sigma = torch.sigmoid(torch.randn(batch, generator=gen))                   # logit-normal
        eps = torch.randn(x0.shape, generator=gen)
        x = (1 - sigma[:, None]) * x0 + sigma[:, None] * eps                       # (B, S)
        target = eps - x0
        weight = torch.ones_like(x0)
        media = None
        if torch.rand((), generator=gen) < p_fl2va:   # FL2VA: clean first/last frames, frozen
            v0, _ = codec.unpack(x0)
            frames = {MediaRole.FIRST_FRAME: v0[:, :, 0], MediaRole.LAST_FRAME: v0[:, :, -1]}
            x = codec.frozen_frames(frames).apply(x)
            media = {"frame_flags": codec.frame_flags(frames).expand(batch, -1)}
            keep = torch.ones_like(v0)
            keep[:, :, 0] = 0
            keep[:, :, -1] = 0
            weight[:, :nv] = keep.flatten(1)
        v_pred = predict_velocity(adapter.denoiser, {"transformer": net}, x, sigma, cond,
                                  Guidance.none(batch), media)
        loss = ((v_pred - target) ** 2 * weight).sum() / weight.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    net.eval().requires_grad_(False)
    return losses


def plot_losses(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(curves), figsize=(4 * len(curves), 3))
    for ax, (name, values) in zip(np.atleast_1d(axes), curves.items()):
        ax.plot(values, lw=0.5, alpha=0.4)
        k = max(1, len(values) // 50)
        ax.plot(np.convolve(values, np.ones(k) / k, mode="valid"), lw=1.5)
        ax.set_title(name)
        ax.set_yscale("log")
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="Pretrain tiny_t2va on synthetic clips")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clips", type=int, default=1024, help="size of the rendered clip pool")
    p.add_argument("--video-vae-steps", type=int, default=500)
    p.add_argument("--audio-vae-steps", type=int, default=600)
    p.add_argument("--dit-steps", type=int, default=2500)
    p.add_argument("--vae-batch", type=int, default=16)
    p.add_argument("--dit-batch", type=int, default=32)
    p.add_argument("--vae-lr", type=float, default=2e-3)
    p.add_argument("--dit-lr", type=float, default=1e-3)
    p.add_argument("--p-uncond", type=float, default=0.1)
    p.add_argument("--p-fl2va", type=float, default=0.3)
    p.add_argument("--warmup", type=int, default=100, help="DiT linear lr warmup steps")
    p.add_argument("--init", default=None, help="start from these weights (stages with 0 steps "
                   "keep them, e.g. --video-vae-steps 0 reuses a trained video VAE)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    adapter = TinyT2VAFamily(args.init) if args.init else TinyT2VAFamily(config=TinyT2VAConfig())
    components = adapter.build(seed=args.seed) if args.init is None else \
        {name: adapter.load(name) for name in ("transformer", "video_vae", "audio_vae")}
    if args.init is not None and args.dit_steps > 0 and (args.video_vae_steps or args.audio_vae_steps):
        components["transformer"] = adapter.build(seed=args.seed)["transformer"]  # fresh DiT
    video, audio, captions = clip_pool(args.clips, args.seed)
    timings, curves = {}, {}
    t0 = time.time()
    curves["video_vae"] = train_video_vae(components["video_vae"], video,
                                          args.video_vae_steps, args.vae_batch, args.vae_lr, gen)
    timings["video_vae_s"] = time.time() - t0
    t0 = time.time()
    avae = components["audio_vae"].requires_grad_(True)
    components["video_vae"].requires_grad_(True)
    curves["audio_vae"] = train_audio_vae(avae, audio, args.audio_vae_steps,
                                          args.vae_batch, args.vae_lr, gen)
    if args.audio_vae_steps > 0:
        with torch.no_grad():
            z = avae.encode(audio[:256]).latent_dist.mean
        adapter.set_config(adapter.config.model_copy(update={
            "audio_latent_shift": float(z.mean()), "audio_latent_scale": float(1 / z.std())}))
    timings["audio_vae_s"] = time.time() - t0
    t0 = time.time()
    curves["dit"] = train_dit(adapter, components, video, audio, captions, args.dit_steps,
                              args.dit_batch, args.dit_lr, args.p_uncond, args.p_fl2va, gen,
                              args.warmup)
    timings["dit_s"] = time.time() - t0
    adapter.save(components, out)
    plot_losses(curves, out / "loss_curves.png")
    def window(v: list[float]) -> int:
        return max(3, len(v) // 20)

    curves = {k: v for k, v in curves.items() if v}
    report = {"args": vars(args), "timings": timings,
              "first_loss": {k: float(np.mean(v[:window(v)])) for k, v in curves.items()},
              "final_loss": {k: float(np.mean(v[-window(v):])) for k, v in curves.items()}}
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    from contract.cli import run_cli
    raise SystemExit(run_cli("python -m scripts.pretrain_t2va", main))
