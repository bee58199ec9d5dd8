"""A tiny random MiniMax-H3 checkpoint in the published modular layout (diffusers 0.42.1).

    python -m testing.tiny_minimax_h3 --out DIR          # -> DIR/minimax_h3
    python -m testing.tiny_minimax_h3 --fl2va-prompts configs/prompts/minimax_h3
        # the tiny recipe's FL2VA prompt files (keyframes from synthetic clips)

Components, each saved by its own `save_pretrained` in its subfolder: `text_encoder`
(Qwen3VLForConditionalGeneration with 51 text layers, since the pipeline reads hidden_states[50]
and refuses a shorter stack, 8 query / 4 key-value heads as the real conditioner groups them
(etp 2 and 4 split it, 3 does not) and a two-block vision tower), `tokenizer` (a
byte-level BPE Qwen2Tokenizer learned on the project corpus with Qwen-VL's vision specials),
`processor` (Qwen3VLProcessor over that tokenizer), `vae` (AutoencoderKLMiniMaxH3 with the real
16x spatial / 17-frame chunk geometry), `audio_vae` (AutoencoderKLMiniMaxH3Audio with the real hop
of 800 samples at 32 kHz: 40 latents per second, which the pipeline assumes), `scheduler` (shift
12) / `audio_scheduler` (shift 3), `transformer` (t2va / fl2va) and `transformer_ref` (ref2va),
two transformers with different weights. `model_index.json` and `modular_model_index.json` name
the classes. Constant tensors get seeded noise (testing.tiny_families.perturb_constants).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from testing.tiny_families import _seeded, perturb_constants
from testing.tiny_tokenizers import _byte_symbols, _new_tokens, _units, corpus, learn_merges

NAME = "minimax_h3"
VOCAB_SIZE = 1000
VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TEXT_LAYERS = 51             # the pipeline reads hidden_states[50]; it needs more than 50 layers
TEXT_HIDDEN = 32
VIDEO_LATENT_CHANNELS = 8
AUDIO_LATENT_CHANNELS = 8
# 124 frames (17 n + 5, 5.17 s: the pipeline generates 5 to 15 s) at 32 x 64 pixels
SAMPLE_SIZE = {"height": 32, "width": 64, "num_frames": 124}

PIPELINE_COMPONENTS = {
    "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration"),
    "tokenizer": ("transformers", "Qwen2Tokenizer"),
    "processor": ("transformers", "Qwen3VLProcessor"),
    "vae": ("diffusers", "AutoencoderKLMiniMaxH3"),
    "audio_vae": ("diffusers", "AutoencoderKLMiniMaxH3Audio"),
    "scheduler": ("diffusers", "MiniMaxH3Scheduler"),
    "audio_scheduler": ("diffusers", "MiniMaxH3Scheduler"),
    "transformer": ("diffusers", "MiniMaxH3Transformer3DModel"),
    "transformer_ref": ("diffusers", "MiniMaxH3Transformer3DModel"),
}


def qwen2_tokenizer(vocab_size: int = VOCAB_SIZE):
    """Qwen2Tokenizer: byte-level BPE learned on the project corpus, <|endoftext|> and the
    Qwen-VL vision specials added as special tokens (ids after the BPE vocabulary)."""
    from transformers import Qwen2Tokenizer

    symbols = _byte_symbols()
    num_merges = vocab_size - len(symbols) - 1 - len(VISION_SPECIALS)
    units = _units(Qwen2Tokenizer().backend_tokenizer, corpus())
    merges = learn_merges(units, num_merges)
    tokens = symbols + _new_tokens(merges)
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("Qwen2 vocabulary has duplicate merges")
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_SPECIALS})
    if len(tokenizer) != vocab_size:
        raise ValueError(f"Qwen2 tokenizer has {len(tokenizer)} tokens, not {vocab_size}")
    return tokenizer


def qwen3_vl_processor(tokenizer):
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    image = Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2,
                                  min_pixels=32 * 32, max_pixels=64 * 128)
    video = Qwen3VLVideoProcessor(patch_size=16, temporal_patch_size=2, merge_size=2)
    return Qwen3VLProcessor(image_processor=image, tokenizer=tokenizer, video_processor=video)


def qwen3_vl(seed: int, tokenizer):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_SPECIALS}
    config = Qwen3VLConfig(
        text_config={"vocab_size": VOCAB_SIZE, "hidden_size": TEXT_HIDDEN, "intermediate_size": 48,
                     "num_hidden_layers": TEXT_LAYERS, "num_attention_heads": 8,
                     "num_key_value_heads": 4, "head_dim": 8, "max_position_embeddings": 4096,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                         "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                       "out_hidden_size": TEXT_HIDDEN, "patch_size": 16, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "num_position_embeddings": 64,
                       "deepstack_visual_indexes": [0]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    return _seeded(seed, lambda: Qwen3VLForConditionalGeneration(config))


def transformer(seed: int):
    from diffusers import MiniMaxH3Transformer3DModel

    return _seeded(seed, lambda: MiniMaxH3Transformer3DModel(
        num_attention_heads=2, attention_head_dim=32, hidden_size=48, num_layers=2,
        num_refiner_layers=1, ffn_dim=64, in_channels=VIDEO_LATENT_CHANNELS,
        audio_in_channels=AUDIO_LATENT_CHANNELS, patch_size=(1, 2, 2), text_dim=TEXT_HIDDEN,
        freq_dim=32, time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=4))


def video_vae(seed: int):
    from diffusers import AutoencoderKLMiniMaxH3

    g = torch.Generator().manual_seed(seed + 7)
    mean = (torch.randn(VIDEO_LATENT_CHANNELS, generator=g) * 0.1).tolist()
    std = (1 + torch.rand(VIDEO_LATENT_CHANNELS, generator=g) * 0.5).tolist()
    return _seeded(seed, lambda: AutoencoderKLMiniMaxH3(
        latent_channels=VIDEO_LATENT_CHANNELS, block_out_channels=(8, 8, 16, 16),
        layers_per_block=1, spatial_downsample_factors=(2, 2, 2, 2),
        temporal_downsample_factors=(1, 2, 2, 1), norm_num_groups=4, decoder_num_layers=1,
        decoder_num_attention_heads=2, decoder_attention_head_dim=8,
        decoder_num_register_tokens=2, decoder_ffn_mult=2, latents_mean=mean, latents_std=std))


def audio_vae(seed: int):
    from diffusers import AutoencoderKLMiniMaxH3Audio

    g = torch.Generator().manual_seed(seed + 11)
    mean = (torch.randn(AUDIO_LATENT_CHANNELS, generator=g) * 0.1).tolist()
    std = (1 + torch.rand(AUDIO_LATENT_CHANNELS, generator=g) * 0.5).tolist()
    return _seeded(seed, lambda: AutoencoderKLMiniMaxH3Audio(
        encoder_dim=4, encoder_rates=(2, 4, 4, 5, 5), latent_dim=16,
        latent_channels=AUDIO_LATENT_CHANNELS, num_attention_heads=2, decoder_dim=128,
        decoder_rates=(5, 5, 2, 2, 2, 2, 2), decoder_kernel_sizes=(9, 9, 4, 4, 4, 4, 4),
        resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),), sampling_rate=32000,
        latents_mean=mean, latents_std=std))


def components(seed: int = 0) -> dict:
    from diffusers import MiniMaxH3Scheduler

    tokenizer = qwen2_tokenizer()
    parts = {
        "text_encoder": qwen3_vl(seed, tokenizer), "tokenizer": tokenizer,
        "processor": qwen3_vl_processor(tokenizer), "vae": video_vae(seed + 1),
        "audio_vae": audio_vae(seed + 2), "scheduler": MiniMaxH3Scheduler(shift=12.0),
        "audio_scheduler": MiniMaxH3Scheduler(shift=3.0), "transformer": transformer(seed + 3),
        "transformer_ref": transformer(seed + 4),
    }
    g = torch.Generator().manual_seed(seed + 100)
    for name in ("text_encoder", "vae", "audio_vae", "transformer", "transformer_ref"):
        perturb_constants(parts[name], g)
    return parts


def build(root: Path, seed: int = 0) -> Path:
    """Write root/minimax_h3 and return it."""
    out = Path(root) / NAME
    out.mkdir(parents=True, exist_ok=True)
    parts = components(seed)
    for name, part in parts.items():
        part.save_pretrained(out / name)
    index = {"_class_name": "MiniMaxH3ModularPipeline", "_diffusers_version": "0.42.1",
             **{name: list(lib_cls) for name, lib_cls in PIPELINE_COMPONENTS.items()}}
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    modular = {"_class_name": "MiniMaxH3ModularPipeline", "_blocks_class_name": "MiniMaxH3Blocks",
               "_diffusers_version": "0.42.1",
               **{name: [lib, cls, {"pretrained_model_name_or_path": None, "subfolder": name,
                                    "type_hint": [lib, cls]}]
                  for name, (lib, cls) in PIPELINE_COMPONENTS.items()}}
    (out / "modular_model_index.json").write_text(json.dumps(modular, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fl2va-prompts", type=Path, help="write the FL2VA prompt files here")
    args = parser.parse_args(argv)
    if args.fl2va_prompts is not None:
        print(write_fl2va_prompts(args.fl2va_prompts, "fl2va_train", 6, seed=1))
        print(write_fl2va_prompts(args.fl2va_prompts, "fl2va_test", 2, seed=2))
    if args.out is not None:
        print(build(args.out, args.seed))



def write_fl2va_prompts(folder: Path, name: str, count: int, seed: int) -> Path:
    """folder/<name>.jsonl: `count` synthetic bouncing-square clips (synthetic/clips.py) as
    FL2VA prompts, their first and last frames as keyframes (frames/<name>_<i>_{first,last}.png):
    each 32 x 32 render placed on the 32 x 64 canvas the tiny recipe samples (the rest is the
    clip's background; nothing is resized)."""
    from PIL import Image

    from synthetic import clips

    frames = folder / "frames"
    frames.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, spec in enumerate(clips.sample_specs(count, seed)):
        video = clips.render(spec).video                        # (T, 3, 32, 32) uint8
        record = {"prompt": clips.caption(spec)}
        for role, frame in (("first_frame", video[0]), ("last_frame", video[-1])):
            canvas = torch.tensor(clips.BACKGROUND, dtype=torch.uint8).view(3, 1, 1).repeat(
                1, clips.SIZE, 2 * clips.SIZE)
            canvas[:, :, :clips.SIZE] = torch.from_numpy(frame)
            path = frames / f"{name}_{i}_{role.split('_')[0]}.png"
            Image.fromarray(canvas.permute(1, 2, 0).numpy()).save(path)
            record[role] = f"frames/{path.name}"
        lines.append(json.dumps(record))
    out = folder / f"{name}.jsonl"
    out.write_text("\n".join(lines) + "\n")
    return out


if __name__ == "__main__":
    main()
