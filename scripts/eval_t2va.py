"""Verifier figures of the tiny_t2va weights on held-out synthetic prompts (for MODEL_CARD.md).

T2VA: AV-sync of generated clips vs the same clips with the audio shifted by 3 frames, pitch /
colour agreement; the real clips of the same specs as a reference. FL2VA: condition-frame fidelity
to the given first/last frames vs to another clip's frames.

    python -m scripts.eval_t2va [--weights DIR] [--n 32] [--out report.json] [--grid grid.png]
"""
from __future__ import annotations

import argparse
import json
from typing import Sequence

import numpy as np
import torch

from adapters.sample import LocalModels, generate
from adapters.sample_clip import frame_grid
from adapters.tiny_t2va import TinyT2VAFamily
from contract import MediaArtifact, MediaRole
from rewards.base import ScoreRequest
from rewards.verifiers.av import AVSyncScorer, ConditionFrameScorer, PitchColorScorer
from synthetic.clips import caption, render, sample_specs


def shift_audio(audio: torch.Tensor, frames: int, sample_rate: int, fps: float) -> torch.Tensor:
    """Delay (B, C, N) audio by `frames` video frames (zero-filled)."""
    n = int(round(frames * sample_rate / fps))
    out = torch.zeros_like(audio)
    out[..., n:] = audio[..., :-n]
    return out


def evaluate(adapter: TinyT2VAFamily, components: LocalModels, n: int = 32, seed: int = 10_000,
             steps: int = 20, guidance: float = 3.0) -> tuple[dict, np.ndarray]:
    specs = sample_specs(n, seed)
    prompts = [caption(s) for s in specs]
    real = [render(s) for s in specs]
    spec_v, spec_a = adapter.io_spec["video"], adapter.io_spec["audio"]
    fps, sr = spec_v.fps, spec_a.sample_rate
    gen = generate(adapter, components, prompts, list(range(n)), steps, guidance)

    def arts(video, audio):
        return {"video": MediaArtifact(spec_v, video), "audio": MediaArtifact(spec_a, audio)}

    def mean(out, key):
        return float(np.mean(out.scores[key]))

    sync, pitch = AVSyncScorer(), PitchColorScorer()
    real_v = torch.from_numpy(np.stack([c.video for c in real]))
    real_a = torch.from_numpy(np.stack([c.audio for c in real]))
    report = {"n": n, "steps": steps, "guidance": guidance, "t2va": {
        "av_sync_generated": mean(sync.score(ScoreRequest(arts(gen["video"], gen["audio"]),
                                                          tuple(prompts))), "av_sync"),
        "av_sync_generated_audio_shifted_3": mean(sync.score(ScoreRequest(
            arts(gen["video"], shift_audio(gen["audio"], 3, sr, fps)), tuple(prompts))), "av_sync"),
        "av_sync_real": mean(sync.score(ScoreRequest(arts(real_v, real_a), tuple(prompts))),
                             "av_sync"),
        "av_sync_real_audio_shifted_3": mean(sync.score(ScoreRequest(
            arts(real_v, shift_audio(real_a, 3, sr, fps)), tuple(prompts))), "av_sync"),
    }}
    p = pitch.score(ScoreRequest(arts(gen["video"], gen["audio"]), tuple(prompts)))
    report["t2va"].update({f"{k}_generated": mean(p, k)
                           for k in ("pitch_color", "pitch_caption", "pitch_video")})
    # FL2VA: condition on the real clips' first / last frames
    media = {MediaRole.FIRST_FRAME: real_v[:, 0], MediaRole.LAST_FRAME: real_v[:, -1]}
    fl = generate(adapter, components, prompts, list(range(n)), steps, guidance, media)
    meta = tuple({"first_frame": real_v[i, 0], "last_frame": real_v[i, -1]} for i in range(n))
    other = meta[1:] + meta[:1]
    cf = ConditionFrameScorer()
    fl_arts = arts(fl["video"], fl["audio"])
    report["fl2va"] = {
        "condition_frames_own": mean(cf.score(ScoreRequest(fl_arts, tuple(prompts), meta)),
                                     "condition_frames"),
        "condition_frames_other_clip": mean(cf.score(ScoreRequest(fl_arts, tuple(prompts), other)),
                                            "condition_frames"),
        "av_sync_generated": mean(sync.score(ScoreRequest(fl_arts, tuple(prompts))), "av_sync"),
    }
    grid = frame_grid(np.concatenate([real_v[:4].numpy(), gen["video"][:4].numpy(),
                                      fl["video"][:4].numpy()]))
    return report, grid


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="Verifier figures of tiny_t2va")
    p.add_argument("--weights", default=None)
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=3.0)
    p.add_argument("--out", default=None, help="JSON report path")
    p.add_argument("--grid", default=None, help="PNG: rows = 4 real, 4 T2VA, 4 FL2VA clips")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    adapter = TinyT2VAFamily(args.weights)
    components = LocalModels.load(adapter)
    report, grid = evaluate(adapter, components, args.n, steps=args.steps, guidance=args.guidance)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.grid:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        plt.imsave(args.grid, grid)
    return report


if __name__ == "__main__":
    from contract.cli import run_cli
    raise SystemExit(run_cli("python -m scripts.eval_t2va", main))
