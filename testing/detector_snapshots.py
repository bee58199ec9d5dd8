"""Random-init detectors in transformers' own formats, what the GenEval scorer's tests read:
Mask2FormerForUniversalSegmentation (a Swin backbone from its config) with its image processor,
loadable by AutoModelForUniversalSegmentation, and DetrForObjectDetection (a ResNet backbone from
its config, no timm) with DetrImageProcessor, loadable by AutoModelForObjectDetection."""
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


def write_tiny_mask2former(path: str | Path, classes: Sequence[str], num_queries: int = 8,
                           seed: int = 0) -> str:
    from transformers import (Mask2FormerConfig, Mask2FormerForUniversalSegmentation,
                              Mask2FormerImageProcessor, SwinConfig)
    path = Path(path)
    backbone = SwinConfig(image_size=32, patch_size=4, embed_dim=32, depths=[1, 1, 1, 1],
                          num_heads=[1, 1, 2, 2], window_size=2,
                          out_features=["stage1", "stage2", "stage3", "stage4"])
    cfg = Mask2FormerConfig(backbone_config=backbone, use_pretrained_backbone=False,
                            feature_size=32, mask_feature_size=32, hidden_dim=32,
                            encoder_feedforward_dim=32, dim_feedforward=32, encoder_layers=1,
                            decoder_layers=2, num_attention_heads=2, num_queries=num_queries,
                            common_stride=4, id2label=dict(enumerate(classes)),
                            label2id={c: i for i, c in enumerate(classes)})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        Mask2FormerForUniversalSegmentation(cfg).save_pretrained(path)
    Mask2FormerImageProcessor(size={"shortest_edge": 32, "longest_edge": 64},
                              size_divisor=32).save_pretrained(path)
    return str(path)
