"""Per-stage GPU cost ESTIMATES for the 64-GPU worked plans (docs/CLUSTER.md), from public
architecture dimensions and FLOP counts at an assumed model-FLOPs utilisation -- not
measurements. A GPU run's measured figures replace them (same file format, "source": "measured").

    python -m bench.estimate_costs        # writes bench/costs/sd35_medium_h200.json, av30b_h200.json

Transformer forward FLOPs per sample: 2 x params x tokens (an MMDiT's two streams each hold about
half the weights and see only their own tokens: params x tokens) + attention 4 x tokens^2 x width
per attention layer.
A learner step per trained timestep: forward + backward (2x) + a recomputed forward (gradient
checkpointing) = 4 forwards; DiffusionNFT adds the old policy's forward (no grad): 5.
Seconds = FLOPs / (devices x peak x MFU).
"""
from __future__ import annotations

import json
from pathlib import Path

COSTS = Path(__file__).resolve().parent / "costs"
H200_BF16_TFLOPS = 989.0          # dense bf16 peak (NVIDIA H200 SXM datasheet)


def dit_forward_flops(params: float, width: int, layers: int, tokens: int,
                      extra_attn_layers: int = 0, extra_attn_tokens: int = 0,
                      streams: int = 1) -> float:
    """`streams` = 2 for an MMDiT: each token meets only its own stream's half of the weights."""
    linear = 2.0 * params * tokens / streams
    attention = 4.0 * tokens ** 2 * width * layers
    attention += 4.0 * extra_attn_tokens ** 2 * width * extra_attn_layers
    return linear + attention


def seconds(flops: float, devices: float, mfu: float) -> float:
    return flops / (devices * H200_BF16_TFLOPS * 1e12 * mfu)


def sd35_medium() -> dict:
    """SD3.5-medium (SD3Transformer2DModel: 24 layers, 24 heads x 64 = 1536 wide, 2.24 B
    params, dual attention in layers 0-12), 512x512: 32x32 = 1024 image tokens (16-ch latent,
    patch 2) + 77 CLIP + 256 T5 text tokens; flow_grpo's recipe: 10 steps, CFG (2 forwards)."""
    mfu = 0.35
    tokens, image_tokens = 1024 + 333, 1024
    fwd = dit_forward_flops(2.24e9, 1536, 24, tokens, 13, image_tokens, streams=2)
    steps, cfg = 10, 2
    rollout_s = seconds(fwd * steps * cfg, 1, mfu)
    learner_s = seconds(fwd * steps * cfg * 4, 1, mfu)          # every step trained, with CFG
    t5 = 2 * 4.76e9 * 256 + 2 * 0.695e9 * 77 + 2 * 0.123e9 * 77  # T5-XXL + CLIP-G + CLIP-L
    group = 16
    return {
        "what": "SD3.5-medium at 512x512, 10 SDE steps with CFG, groups of 16, one H200 per "
                "rollout replica",
        "source": f"ESTIMATE: FLOPs from public dims at {mfu:.0%} MFU of {H200_BF16_TFLOPS:g} "
                  "bf16 TFLOP/s (bench/estimate_costs.py); replace with a GPU run's measurements",
        "device_kind": "GPU", "samples_per_request": group,
        "derivation": {"dit_forward_tflop": fwd / 1e12, "forwards_per_sample": steps * cfg,
                       "text_encoders_tflop_per_prompt": t5 / 1e12, "mfu": mfu},
        "stages": {
            "encoder": {"seconds_per_request": round(seconds(t5, 1, mfu), 5)},
            "rollout": {"seconds_per_sample": round(rollout_s, 5)},
            # VAE decode 64x64x16 -> 512x512 (~2.5 TFLOP, conv-bound: 20 % MFU)
            "decoder:image_latent": {"seconds_per_sample": round(seconds(2.5e12, 1, 0.20), 5)},
            # PickScore (CLIP ViT-H/14 at 224^2, ~0.33 TFLOP) on a GPU share
            "scorer:pickscore": {"seconds_per_sample": round(seconds(0.33e12, 1, 0.20), 5)},
            # CLIPScore (CLIP ViT-L/14: 0.30 B image tower x 257 tokens + 0.12 B text tower x 77,
            # ~0.18 TFLOP; configs/gpu_example.yaml) on a GPU share
            "scorer:clipscore": {"seconds_per_sample": round(seconds(0.18e12, 1, 0.20), 5)},
            # OCR (rapidocr PP-OCRv4, CPU) is MEASURED: a 512x512 image with one text line,
            # 2 onnxruntime threads on this 2-core machine (loaded): 1.06 s per sample
            "scorer:ocr": {"seconds_per_sample": 1.06, "threads": 2,
                           "source": "measured here (CPU)"},
            "ingress": {"seconds_per_request": 0.02},    # CPU: validation + hops (graph.json)
        },
        "learner": {"seconds_per_sample": round(learner_s, 4),
                    "note": "LoRA FlowGRPO step per sample per GPU: 10 steps x CFG x 4"},
    }


def av30b() -> dict:
    """A 30B-class audio+video DiT (the seed's MiniMax-H3: 33 B DiT at TP 4, 32 B text encoder
    at ETP 4, 288x448): 5 s at 24 fps = 121 frames, 8x spatial / 4x temporal VAE, patch 2 ->
    31 x 18 x 28 = 15.6 k video tokens + 125 audio + 512 text; width 6144, 72 layers (assumed:
    33 B = 12 x width^2 x layers); 20 steps with CFG."""
    mfu = 0.35
    tokens = 31 * 18 * 28 + 125 + 512
    fwd = dit_forward_flops(33e9, 6144, 72, tokens)
    steps, cfg, tp = 20, 2, 4
    rollout_s = seconds(fwd * steps * cfg, tp, mfu)
    learner_s = seconds(fwd * 4 * 5, 1, mfu)            # NFT: 4 timesteps x 5 forwards
    encoder = 2 * 32e9 * 512
    group = 8
    return {
        "what": "30B-class text->video+audio DiT, 121 frames 288x448 + audio, 20 steps with "
                "CFG, TP 4 rollout replicas, ETP 4 text encoder, groups of 8",
        "source": f"ESTIMATE: FLOPs from assumed dims at {mfu:.0%} MFU of {H200_BF16_TFLOPS:g} "
                  "bf16 TFLOP/s (bench/estimate_costs.py); replace with a GPU run's measurements",
        "device_kind": "GPU", "samples_per_request": group,
        "derivation": {"tokens": tokens, "dit_forward_pflop": fwd / 1e15,
                       "forwards_per_sample": steps * cfg, "tp": tp, "mfu": mfu},
        "stages": {
            "encoder": {"seconds_per_request": round(seconds(encoder, 4, mfu), 5)},
            "rollout": {"seconds_per_sample": round(rollout_s, 3)},
            # 2.6 B-parameter 3D-conv video VAE (the seed's H3 VAE), ~50 TFLOP per clip
            "decoder:video_latent": {"seconds_per_sample": round(seconds(50e12, 1, 0.20), 4)},
            "decoder:audio_latent": {"seconds_per_sample": 0.01},
            "scorer:av_sync": {"seconds_per_sample": 0.05},           # CPU verifier
            "scorer:clap": {"seconds_per_sample": round(seconds(0.5e12, 1, 0.20), 5)},
            "scorer:imagebind": {"seconds_per_sample": round(seconds(6e12, 1, 0.20), 5)},
            "ingress": {"seconds_per_request": 0.02},
        },
        "learner": {"seconds_per_sample": round(learner_s, 2),
                    "note": "LoRA DiffusionNFT per sample per GPU (FSDP over the learner "
                            "group): 4 timesteps x 5 forwards"},
    }


def main() -> int:
    COSTS.mkdir(exist_ok=True)
    for name, costs in (("sd35_medium_h200", sd35_medium()), ("av30b_h200", av30b())):
        path = COSTS / f"{name}.json"
        path.write_text(json.dumps(costs, indent=2) + "\n")
        print(f"wrote {path}: {json.dumps(costs['stages'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
