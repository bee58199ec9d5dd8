"""Reward-model throughput and memory: one-at-a-time vs batched calls per scorer, in one run.

    python -m bench.reward_models_bench [--batch 4] [--threads 2] [--only pickscore ocr]
-> bench/results/reward_models.json + bench/results/reward_models.png

Each scorer runs in its own fresh process (so its memory is its own): the checkpoint, written
beforehand by another process at the public full-size architecture with random weights in the
real on-disk format, is loaded through the scorer's real loader, then scored on B images one
call per image and in one call.
Speed does not depend on the weight values; the scores are meaningless here.
Architectures: PickScore = CLIP ViT-H/14 (transformers), CLIPScore and the aesthetic predictor =
CLIP ViT-L/14 (the aesthetic one loads the vision tower only), HPSv2.1 = open_clip ViT-H-14,
ImageReward = BLIP ViT-L/16 + BERT-base with cross-attention; OCR uses its shipped PP-OCRv4
weights on rendered text. Memory (the checkpoint is written by another process first):
`rss_after_score_mb` is the scorer process's resident set after its first call (every weight
touched; interpreter and libraries included), `peak_rss_mb` its peak, loading included.
Text vocabularies are the locally built ones (CLIP keeps 49408 embedding rows; ImageReward's
BERT table has ~130 rows instead of 30524, 23 M fewer parameters).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"

VIT_L14 = {"text_config": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                           "num_attention_heads": 12, "vocab_size": 49408},
           "vision_config": {"hidden_size": 1024, "intermediate_size": 4096,
                             "num_hidden_layers": 24, "num_attention_heads": 16,
                             "image_size": 224, "patch_size": 14},
           "projection_dim": 768}
VIT_H14 = {"text_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                           "num_attention_heads": 16, "vocab_size": 49408},
           "vision_config": {"hidden_size": 1280, "intermediate_size": 5120,
                             "num_hidden_layers": 32, "num_attention_heads": 16,
                             "image_size": 224, "patch_size": 14},
           "projection_dim": 1024}
BERT_BASE_MED = {"architectures": ["BertModel"], "hidden_act": "gelu", "hidden_size": 768,
                 "intermediate_size": 3072, "layer_norm_eps": 1e-12,
                 "max_position_embeddings": 512, "model_type": "bert", "num_attention_heads": 12,
                 "num_hidden_layers": 12, "pad_token_id": 0, "type_vocab_size": 2,
                 "encoder_width": 1024, "add_cross_attention": True,
                 "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}


def _spec(name: str, tmp: Path):
    """Write the checkpoint of `name` under tmp; returns (ScorerSpec, media kind)."""
    from testing import preference_snapshots as ps
    from rewards.registry import ScorerSpec
    if name == "pickscore":
        return ScorerSpec(kind="pickscore", params={"model_dir": ps.write_hf_clip_dir(
            tmp / "clip_h", VIT_H14)}), "image"
    if name == "clipscore":
        return ScorerSpec(kind="clipscore", params={"model_dir": ps.write_hf_clip_dir(
            tmp / "clip_l", VIT_L14)}), "image"
    if name == "aesthetic":
        return ScorerSpec(kind="aesthetic", params={
            "clip_dir": ps.write_hf_clip_dir(tmp / "clip_l", VIT_L14),
            "head_path": ps.write_aesthetic_head(tmp / "aesthetic.pth", 768)}), "image"
    if name == "hpsv2":
        import open_clip
        cfg = open_clip.get_model_config("ViT-H-14")
        return ScorerSpec(kind="hpsv2", params={"checkpoint": ps.write_hps_checkpoint(
            tmp / "HPS_v2.1_compressed.pt", cfg), "architecture": "ViT-H-14"}), "image"
    if name == "image_reward":
        from rewards.image_reward import BlipDims
        params = ps.write_image_reward_dir(tmp / "ir", BlipDims().model_dump(), BERT_BASE_MED)
        return ScorerSpec(kind="image_reward", params=params), "image"
    if name == "ocr":
        return ScorerSpec(kind="ocr", params={"threads": 2}), "text"
    raise ValueError(name)


def _media(kind: str, batch: int):
    import torch

    from contract import ArtifactSpec, MediaArtifact
    spec = ArtifactSpec("image", "image", "decoded", "CHW", source="image_latent")
    words = ["OPEN", "HELLO WORLD", "CAFE", "EXIT", "PIZZA", "BOOKS", "RL", "TAXI"]
    targets = [words[i % len(words)] for i in range(batch)]
    if kind == "text":
        import numpy as np
        from PIL import Image, ImageDraw, ImageFont
        font = ImageFont.load_default(size=48)
        imgs = []
        for w in targets:
            im = Image.new("RGB", (512, 512), "white")
            ImageDraw.Draw(im).text((40, 220), w, fill="black", font=font)
            imgs.append(torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1))
        data = torch.stack(imgs)
    else:
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, 256, (batch, 3, 512, 512), generator=g, dtype=torch.uint8)
    return {"image": MediaArtifact(spec, data)}, targets


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def write(name: str, tmp: str, queue) -> None:
    """In its own process (so its memory is not the scorer's): write the checkpoint."""
    spec, kind = _spec(name, Path(tmp))
    queue.put((spec.model_dump(mode="json"), kind))


def measure(name: str, spec: dict, kind: str, batch: int, threads: int, timing: bool,
            queue) -> None:
    """In a fresh process: build the scorer, time B single calls and one batched call (or, with
    timing off, score one image), report memory."""
    import torch

    from rewards.base import ScoreRequest
    from rewards.registry import ScorerSpec, build_scorer

    torch.set_num_threads(threads)
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    scorer = build_scorer(ScorerSpec.model_validate(spec))
    load_s = time.perf_counter() - t0
    params = sum(p.numel() * p.element_size() for m in vars(scorer).values()
                 if isinstance(m, torch.nn.Module) for p in m.parameters())
    arts, targets = _media(kind, batch)
    prompts = tuple(f'a photo of a sign that says "{t}"' for t in targets)
    meta = tuple({"ocr_text": t} for t in targets)
    one = lambda i: scorer.score(ScoreRequest(  # noqa: E731
        {k: type(a)(a.spec, a.data[i:i + 1]) for k, a in arts.items()}, prompts[i:i + 1],
        meta[i:i + 1]))
    one(0)                                                    # warm-up (touches every weight)
    memory = {"param_mb": params / 2**20, "rss_before_load_mb": rss0,
              "rss_after_score_mb": _rss_mb(),
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if not timing:
        queue.put({"name": name, **memory})
        return
    t0 = time.perf_counter()
    singles = [one(i) for i in range(batch)]
    t_single = time.perf_counter() - t0
    t0 = time.perf_counter()
    batched = scorer.score(ScoreRequest(arts, prompts, meta))
    t_batched = time.perf_counter() - t0
    key = scorer.primary
    drift = max(abs(s.scores[key][0] - b) for s, b in zip(singles, batched.scores[key]))
    queue.put({"name": name, "batch": batch, "load_s": load_s,
               "batch1_samples_per_s": batch / t_single,
               "batched_samples_per_s": batch / t_batched, "speedup": t_single / t_batched,
               "batch1_total_s": t_single, "batched_total_s": t_batched,
               "max_abs_score_diff_batch_vs_single": drift, **memory,
               "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               "mean_score": sum(batched.scores[key]) / batch})


def plot(results: dict, batch: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    x = list(range(len(names)))
    fig, (ax, am) = plt.subplots(1, 2, figsize=(12, 4.5))
    one = [results[n]["batch1_samples_per_s"] for n in names]
    many = [results[n]["batched_samples_per_s"] for n in names]
    ax.bar([i - 0.2 for i in x], one, width=0.4, label="one image per call")
    ax.bar([i + 0.2 for i in x], many, width=0.4, label=f"one call of {batch}")
    for i, (a, b) in enumerate(zip(one, many)):
        ax.text(i + 0.2, b, f"x{b / a:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("images / s (CPU)")
    ax.set_title("Reward models: batched vs one at a time")
    ax.legend(fontsize=8)
    am.bar(x, [results[n]["rss_after_score_mb"] / 1024 for n in names],
           label="resident after scoring")
    am.bar(x, [results[n]["param_mb"] / 1024 for n in names], width=0.5, label="parameters")
    am.set_xticks(x, names, fontsize=8)
    am.set_ylabel("GiB")
    am.set_title("Scorer process memory (fp32)")
    am.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _in_process(ctx, target, *args):
    """Run target(*args, queue) in a fresh spawned process; its one queued result."""
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    out = queue.get()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"{target.__name__}{args[:1]} exited with {proc.exitcode}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--memory-only", action="store_true",
                        help="measure memory only (one image), merged into the existing JSON")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    names = args.only or ["ocr", "clipscore", "aesthetic", "pickscore", "hpsv2", "image_reward"]
    ctx = mp.get_context("spawn")
    results = {}
    for name in names:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
            spec, kind = _in_process(ctx, write, name, tmp)
            r = _in_process(ctx, measure, name, spec, kind, args.batch, args.threads,
                            not args.memory_only)
        results[r.pop("name")] = r
        if args.memory_only:
            print(f"{name:13s} params {r['param_mb']:7.0f} MB  resident after scoring "
                  f"{r['rss_after_score_mb']:7.0f} MB  peak {r['peak_rss_mb']:7.0f} MB",
                  flush=True)
            continue
        print(f"{name:13s} 1-by-1 {r['batch1_samples_per_s']:6.2f}/s  batched "
              f"{r['batched_samples_per_s']:6.2f}/s  x{r['speedup']:.2f}  params "
              f"{r['param_mb']:7.0f} MB  resident {r['rss_after_score_mb']:7.0f} MB  "
              f"diff {r['max_abs_score_diff_batch_vs_single']:.1e}", flush=True)
    import torch
    report = {"batch": args.batch, "torch_threads": args.threads, "image": [3, 512, 512],
              "load_avg_1m": os.getloadavg()[0], "cpu_count": os.cpu_count(),
              "torch": torch.__version__, "python": platform.python_version(),
              "weights": "random init at full size in each real format (OCR: shipped weights)",
              "scorers": results}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "reward_models.json"
    if args.memory_only and out.exists():                # memory figures into the timed run's
        old = json.loads(out.read_text())
        for name, r in results.items():
            old["scorers"].setdefault(name, {}).update(r)
        old["memory"] = {"load_avg_1m": report["load_avg_1m"], "note": "measured apart, one "
                         "image, checkpoint written in another process"}
        report = old
    elif args.only and out.exists():                     # a partial rerun keeps the others
        old = json.loads(out.read_text())
        report["scorers"] = {**old.get("scorers", {}), **results}
    out.write_text(json.dumps(report, indent=2))
    plot(report["scorers"], args.batch, RESULTS / "reward_models.png")
    print(f"wrote {out} and reward_models.png")


if __name__ == "__main__":
    main()
