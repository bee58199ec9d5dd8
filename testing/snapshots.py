"""Write random-init scorer models in their real on-disk formats (tests, benches, smoke runs).

Each writer produces exactly what the scorer's loader reads for real weights (an open_clip
local-dir, a CLAP HF snapshot, an ImageBind .pth), so the loading path under test is the real one.
Scores of random weights mean nothing; these exist to exercise shapes, plumbing and speed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# open_clip architecture at the smallest useful size (real CLIP BPE, 3.4 M params).
TINY_CLIP = {"embed_dim": 32,
             "vision_cfg": {"image_size": 64, "layers": 2, "width": 64, "patch_size": 16,
                            "head_width": 32},
             "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 64, "heads": 2,
                          "layers": 2}}

# ClapConfig kwargs: HTSAT audio tower + RoBERTa text tower, 370 k params.
TINY_CLAP = {"text_config": {"vocab_size": 1000, "hidden_size": 32, "num_hidden_layers": 2,
                             "num_attention_heads": 2, "intermediate_size": 64,
                             "max_position_embeddings": 80, "projection_dim": 32},
             "audio_config": {"patch_embeds_hidden_size": 16, "depths": [1, 1, 1, 1],
                              "num_attention_heads": [1, 1, 2, 2], "hidden_size": 128,
                              "projection_dim": 32, "window_size": 8, "spec_size": 256,
                              "num_mel_bins": 64, "enable_fusion": False},
             "projection_dim": 32}

_CORPUS = ["a red square on a blue background", "a green circle", "a dog barking loudly",
           "a bell ringing", "a drum beat with a low tone", "a high pitched whistle",
           "a yellow triangle moving left", "rain falling on a roof", "a piano playing a chord",
           "silence", "people talking in a room", "a bird singing", "an engine running"]


def write_clip_dir(path: str | Path, model_cfg: dict[str, Any] | None = None, seed: int = 0) -> str:
    """open_clip local-dir (open_clip_config.json + open_clip_model.safetensors); returns
    the `local-dir:` model string."""
    import open_clip
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model_cfg or TINY_CLIP
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = open_clip.CLIP(**cfg)
    (path / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg,
                                                            "preprocess_cfg": {}}))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(path / "open_clip_model.safetensors"))
    return f"local-dir:{path}"


def write_clap_dir(path: str | Path, clap_cfg: dict[str, Any] | None = None, seed: int = 0) -> str:
    """CLAP HF snapshot (model + ClapProcessor with a byte-level BPE tokenizer trained on a small
    corpus, and a rand_trunc feature extractor for the unfused model); returns the dir."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import (ClapConfig, ClapFeatureExtractor, ClapModel, ClapProcessor,
                              RobertaTokenizerFast)

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = ClapConfig(**(clap_cfg or TINY_CLAP))
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(_CORPUS * 4, vocab_size=min(cfg.text_config.vocab_size, 400),
                            min_frequency=1,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    tok_dir = path / "bpe"
    tok_dir.mkdir(exist_ok=True)
    bpe.save_model(str(tok_dir))
    # transformers 5 names these `vocab=` / `merges=` (vocab_file= is silently ignored).
    tokenizer = RobertaTokenizerFast(vocab=str(tok_dir / "vocab.json"),
                                     merges=str(tok_dir / "merges.txt"),
                                     model_max_length=cfg.text_config.max_position_embeddings - 2)
    truncation = "fusion" if cfg.audio_config.enable_fusion else "rand_trunc"
    fe = ClapFeatureExtractor(feature_size=cfg.audio_config.num_mel_bins, truncation=truncation,
                              padding="repeatpad")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ClapModel(cfg).eval()
    model.save_pretrained(str(path))
    ClapProcessor(feature_extractor=fe, tokenizer=tokenizer).save_pretrained(str(path))
    return str(path)


def main(argv: list[str] | None = None) -> int:
    """`python -m testing.snapshots clap DIR`: the tiny random-init CLAP snapshot the tiny
    text->video+audio configs read (configs/tiny_t2va.yaml, configs/ltx2_tiny.yaml)."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m testing.snapshots")
    parser.add_argument("kind", choices=("clap", "clip"))
    parser.add_argument("dir")
    args = parser.parse_args(argv)
    print((write_clap_dir if args.kind == "clap" else write_clip_dir)(args.dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
