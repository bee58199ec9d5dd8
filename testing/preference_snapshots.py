"""Random-init preference reward models in their real on-disk formats (tests, benches, smoke runs).

Each writer produces what the scorer's loader reads for the real checkpoint:
- a transformers CLIP snapshot dir (config.json + model.safetensors + CLIPProcessor files with
  vocab.json / merges.txt) -- PickScore_v1, CLIP ViT-L/14, CLIP-ViT-H-14-laion2B;
- the LAION aesthetic head `.pth` (a state dict of the 768-1024-128-64-16-1 MLP, `layers.N.*`);
- an HPS v2 checkpoint `.pt` ({"state_dict": open_clip CLIP state dict});
- ImageReward: `ImageReward.pt` (BLIP key names `blip.visual_encoder.*`, `blip.text_encoder.*`,
  `mlp.layers.N.*`), `med_config.json` and a bert-base-uncased-style tokenizer dir (vocab.txt).
Tokenizers are written by hand (character-level CLIP BPE with no merges; a small WordPiece
vocabulary), so they are identical on every run. Scores of random weights mean nothing.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# transformers CLIPConfig kwargs at toy size (image 32, patch 8).
TINY_HF_CLIP = {"text_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 2, "max_position_embeddings": 77},
                "vision_config": {"hidden_size": 32, "intermediate_size": 64,
                                  "num_hidden_layers": 2, "num_attention_heads": 2,
                                  "image_size": 32, "patch_size": 8},
                "projection_dim": 16}

# ImageReward: BLIP ViT dims (the real one is ViT-L/16 at 224) and a BERT med_config at toy size.
TINY_BLIP_VISION = {"image_size": 32, "patch_size": 8, "hidden_size": 32, "num_hidden_layers": 2,
                    "num_attention_heads": 2, "intermediate_size": 64}
TINY_MED_CONFIG = {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1,
                   "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 32,
                   "initializer_range": 0.02, "intermediate_size": 64, "layer_norm_eps": 1e-12,
                   "max_position_embeddings": 64, "model_type": "bert", "num_attention_heads": 2,
                   "num_hidden_layers": 2, "pad_token_id": 0, "type_vocab_size": 2,
                   "encoder_width": 32, "add_cross_attention": True}

_WORDS = ["a", "the", "of", "and", "with", "on", "in", "red", "green", "blue", "cat", "dog",
          "photo", "painting", "square", "circle", "sign", "says", "open", "hello", "world"]


def _perturb(module: torch.nn.Module, seed: int) -> None:
    """Move constant parameters (norm weights 1, biases 0) off their init, so a loader that skips
    a tensor changes the scores."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _byte_level_chars() -> list[str]:
    """The 256 printable characters byte-level BPE (GPT-2 / CLIP) maps the bytes 0..255 to."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _clip_tokenizer(path: Path):
    """CLIPTokenizer from vocab.json + merges.txt: every byte-level character alone and with the
    end-of-word mark, no merges (character-level, deterministic)."""
    from transformers import CLIPTokenizer

    chars = _byte_level_chars()
    vocab = {c: i for i, c in enumerate(chars + [c + "</w>" for c in chars])}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    # transformers 5 names these `vocab=` / `merges=` (vocab_file= is silently ignored).
    return CLIPTokenizer(vocab=str(path / "vocab.json"), merges=str(path / "merges.txt"),
                         pad_token="<|endoftext|>")


def write_hf_clip_dir(path: str | Path, clip_cfg: dict[str, Any] | None = None,
                      seed: int = 0) -> str:
    """transformers CLIP snapshot (model + CLIPProcessor); returns the dir."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _clip_tokenizer(path)
    cfg = dict(clip_cfg or TINY_HF_CLIP)
    text_cfg = cfg.get("text_config", {})
    text = dict(text_cfg, vocab_size=max(len(tokenizer), text_cfg.get("vocab_size", 0)),
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    proj = cfg.get("projection_dim", 512)     # real snapshots repeat it in both sub-configs
    config = CLIPConfig(**dict(cfg, text_config=dict(text, projection_dim=proj),
                               vision_config=dict(cfg.get("vision_config", {}),
                                                  projection_dim=proj)))
    size = config.vision_config.image_size
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}),
        tokenizer=tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPModel(config).eval()
        _perturb(model, seed)
    model.save_pretrained(str(path))
    processor.save_pretrained(str(path))
    return str(path)


def mlp_state_dict(input_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of the aesthetic / ImageReward MLP head (input-1024-128-64-16-1)."""
    from rewards.heads import LinearMLPHead
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = LinearMLPHead(input_size)
        _perturb(head, seed)
    return {k: v.contiguous() for k, v in head.state_dict().items()}


def write_aesthetic_head(path: str | Path, input_size: int = 16, seed: int = 0) -> str:
    """The head file, as sac+logos+ava1-l14-linearMSE.pth stores it (a bare state dict)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(mlp_state_dict(input_size, seed), path)
    return str(path)


def write_hps_checkpoint(path: str | Path, model_cfg: dict[str, Any], seed: int = 0) -> str:
    """{"state_dict": ...} of an open_clip CLIP, as HPS_v2(.1)_compressed.pt stores it."""
    import open_clip

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = open_clip.CLIP(**model_cfg)
        _perturb(model, seed)
    torch.save({"state_dict": model.state_dict()}, path)
    return str(path)


def write_bert_tokenizer_dir(path: str | Path) -> str:
    """A bert-base-uncased-style tokenizer dir (vocab.txt, lower-casing WordPiece)."""
    from transformers import BertTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789.,!?\"'")
    vocab = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + _WORDS + letters
             + ["##" + c for c in letters])
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizer(vocab=str(path / "vocab.txt"), do_lower_case=True).save_pretrained(str(path))
    return str(path)


def write_image_reward_dir(path: str | Path, vision: dict[str, Any] | None = None,
                           med_config: dict[str, Any] | None = None, seed: int = 0) -> dict:
    """ImageReward.pt + med_config.json + tokenizer/ in `path`; returns the scorer params."""
    from rewards.image_reward import (BlipDims, build_blip, to_blip_state_dict,
                                      tokenizer_with_specials)

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok_dir = write_bert_tokenizer_dir(path / "tokenizer")
    med = dict(med_config or TINY_MED_CONFIG)
    med["vocab_size"] = len(tokenizer_with_specials(tok_dir))
    (path / "med_config.json").write_text(json.dumps(med))
    dims = BlipDims(**(vision or TINY_BLIP_VISION))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vis, text = build_blip(dims, med)
        _perturb(vis, seed)
        _perturb(text, seed + 1)
    state = to_blip_state_dict(vis, text)
    state.update({f"mlp.{k}": v for k, v in mlp_state_dict(med["hidden_size"], seed).items()})
    torch.save(state, path / "ImageReward.pt")
    return {"checkpoint": str(path / "ImageReward.pt"), "med_config": str(path / "med_config.json"),
            "tokenizer_dir": tok_dir, "vision": dims.model_dump()}
