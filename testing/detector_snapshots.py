"""A random-init object detector in transformers' own format (DetrForObjectDetection with a
ResNet backbone built from its config, no timm, and its DetrImageProcessor), loadable by
AutoModelForObjectDetection from the folder: what the GenEval scorer's tests read."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch


def write_tiny_detr(path: str | Path, classes: Sequence[str], num_queries: int = 12,
                    seed: int = 0) -> str:
    from transformers import DetrConfig, DetrForObjectDetection, DetrImageProcessor, ResNetConfig
    path = Path(path)
    cfg = DetrConfig(use_timm_backbone=False, use_pretrained_backbone=False,
                     backbone_config=ResNetConfig(embedding_size=8, hidden_sizes=[8, 16],
                                                  depths=[1, 1], out_features=["stage2"],
                                                  layer_type="basic"),
                     d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                     num_queries=num_queries, id2label=dict(enumerate(classes)),
                     label2id={c: i for i, c in enumerate(classes)})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        DetrForObjectDetection(cfg).save_pretrained(path)
    DetrImageProcessor(size={"shortest_edge": 32, "longest_edge": 64}).save_pretrained(path)
    return str(path)
