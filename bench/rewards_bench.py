"""Reward-scorer throughput: samples/s at batch 1 vs one batched call, per scorer, in one run.

    python -m bench.rewards_bench [--batch 16] [--threads 2]
-> bench/results/rewards.json + bench/results/rewards.png

Models are real architectures with random weights written in their real on-disk formats (the
loaders are the production ones): CLIP ViT-B-32 (open_clip), CLAP HTSAT-unfused + RoBERTa
(transformers ClapConfig defaults), and ImageBind with reduced dims (the 1.2 B "huge" model needs
~5 GB and ~7 s per video sample on CPU, beyond this shared machine). Speed depends only on the
architecture, not on the weight values; the scores themselves are meaningless here.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from contract import ArtifactSpec, MediaArtifact
from rewards.base import ScoreRequest

RESULTS = Path(__file__).parent / "results"
IMAGEBIND_REDUCED = dict(out_embed_dim=256, vision_embed_dim=384, vision_num_blocks=4,
                         vision_num_heads=6, audio_embed_dim=384, audio_num_blocks=4,
                         audio_num_heads=6, text_embed_dim=384, text_num_blocks=4,
                         text_num_heads=6, depth_embed_dim=64, depth_num_blocks=1,
                         depth_num_heads=2, thermal_embed_dim=64, thermal_num_blocks=1,
                         thermal_num_heads=2, imu_embed_dim=64, imu_num_blocks=1, imu_num_heads=2)


def make_media(batch: int, seed: int = 0) -> dict[str, MediaArtifact]:
    g = torch.Generator().manual_seed(seed)
    sr, seconds, fps, frames = 16000, 4, 8, 16
    image = ArtifactSpec("image", "image", "decoded", "CHW", source="image_latent")
    video = ArtifactSpec("video", "video", "decoded", "TCHW", source="video_latent", fps=fps)
    audio = ArtifactSpec("audio", "audio", "decoded", "CT", source="audio_latent",
                         sample_rate=sr)
    return {
        "image": MediaArtifact(image, torch.randint(0, 256, (batch, 3, 256, 256), generator=g,
                                                    dtype=torch.uint8)),
        "video": MediaArtifact(video, torch.randint(0, 256, (batch, frames, 3, 128, 128),
                                                    generator=g, dtype=torch.uint8)),
        "audio": MediaArtifact(audio, 0.1 * torch.randn(batch, 2, sr * seconds, generator=g)),
    }


def build_scorers(workdir: Path) -> dict[str, object]:
    from rewards.clap import ClapScorer, ClapScorerConfig
    from rewards.clip import ClipScorer, ClipScorerConfig
    from rewards.imagebind import ImageBindScorer, ImageBindScorerConfig
    from testing.snapshots import write_clap_dir

    out: dict[str, object] = {}
    out["clip ViT-B-32 (image)"] = ClipScorer(ClipScorerConfig(model="ViT-B-32", random_init=True))
    out["clip ViT-B-32 (video, 8 frames)"] = ClipScorer(ClipScorerConfig(
        name="clip_video", model="ViT-B-32", random_init=True, artifact="video",
        modality="video", num_frames=8))
    out["clap htsat-unfused (audio)"] = ClapScorer(ClapScorerConfig(
        model_dir=write_clap_dir(workdir / "clap", clap_cfg={})))
    out["imagebind reduced (audio-video)"] = ImageBindScorer(ImageBindScorerConfig(
        pairs=("audio_video", "text_video", "text_audio"), random_init=True,
        dims=IMAGEBIND_REDUCED))
    return out


def time_scorer(scorer, media, prompts, batch: int) -> dict[str, float]:
    def single(i):
        arts = {k: MediaArtifact(a.spec, a.data[i:i + 1], a.metadata) for k, a in media.items()}
        return scorer.score(ScoreRequest(arts, prompts[i:i + 1]))

    single(0)                                                  # warm-up (allocator, lazy init)
    t0 = time.perf_counter()
    singles = [single(i) for i in range(batch)]
    t_single = time.perf_counter() - t0
    t0 = time.perf_counter()
    batched = scorer.score(ScoreRequest(media, prompts))
    t_batched = time.perf_counter() - t0
    key = scorer.primary
    drift = max(abs(s.scores[key][0] - b) for s, b in zip(singles, batched.scores[key]))
    return {"batch1_samples_per_s": batch / t_single, "batched_samples_per_s": batch / t_batched,
            "batch1_total_s": t_single, "batched_total_s": t_batched,
            "speedup": t_single / t_batched, "max_abs_score_diff_batch_vs_single": drift}


def plot(results: dict, batch: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    one = [results[n]["batch1_samples_per_s"] for n in names]
    many = [results[n]["batched_samples_per_s"] for n in names]
    ax.bar([i - 0.2 for i in x], one, width=0.4, label="batch 1 (sequential calls)")
    ax.bar([i + 0.2 for i in x], many, width=0.4, label=f"batched (B={batch})")
    for i, (a, b) in enumerate(zip(one, many)):
        ax.text(i + 0.2, b, f"x{b / a:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [n.replace(" (", "\n(") for n in names], fontsize=8)
    ax.set_ylabel("samples / s (CPU)")
    ax.set_title("Reward scorer throughput, batch 1 vs batched (random weights, real archs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    prompts = tuple(f"a sample prompt number {i} with a red square and a bell"
                    for i in range(args.batch))
    media = make_media(args.batch)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        scorers = build_scorers(Path(tmp))
        build_s = time.perf_counter() - t0
        for name, scorer in scorers.items():
            results[name] = time_scorer(scorer, media, prompts, args.batch)
            r = results[name]
            print(f"{name:34s} batch1 {r['batch1_samples_per_s']:7.2f}/s  "
                  f"batched {r['batched_samples_per_s']:7.2f}/s  x{r['speedup']:.2f}  "
                  f"diff {r['max_abs_score_diff_batch_vs_single']:.1e}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {"batch": args.batch, "torch_threads": args.threads, "build_s": build_s,
              "load_avg_1m": os.getloadavg()[0], "cpu_count": os.cpu_count(),
              "torch": torch.__version__, "python": platform.python_version(),
              "media": {k: a.summary() for k, a in media.items()},
              "weights": "random init (real architectures); throughput only",
              "scorers": results}
    (RESULTS / "rewards.json").write_text(json.dumps(report, indent=2))
    plot(results, args.batch, RESULTS / "rewards.png")
    print(f"wrote {RESULTS / 'rewards.json'} and rewards.png")


if __name__ == "__main__":
    main()
