"""The tiny Qwen-Image checkpoint's components (testing/tiny_checkpoints.py writes them): the
real classes of QwenImagePipeline at toy sizes -- QwenImageTransformer2DModel, the 3-D causal
AutoencoderKLQwenImage (8x spatial), a Qwen2_5_VLForConditionalGeneration text encoder with
grouped key/value heads and a tiny vision tower (the class the pipeline names), and a
Qwen2Tokenizer (byte-level BPE with Qwen's chat tokens) learned here from a fixed corpus.
Constant tensors get seeded noise as in testing/tiny_families.py.
"""
from __future__ import annotations

from collections import Counter

from testing import tiny_tokenizers
from testing.tiny_families import Parts, _flow_scheduler, _seeded

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_VOCAB_SIZE = 1000
# the system prompts of QwenImagePipeline / QwenImageEditPipeline, learned with the corpus so the
# templates tokenize as compactly as the real vocabulary makes them
_TEMPLATE_TEXT = [
    "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:",
    "Describe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the "
    "image. Generate a new image that meets the user's requirements while maintaining "
    "consistency with the original input where appropriate.",
    "system", "user", "assistant", "Picture 1:", "Picture 2:",
]


def qwen2_tokenizer(vocab_size: int = QWEN_VOCAB_SIZE):
    """Qwen2Tokenizer: Qwen's byte-level pre-tokenizer, the 256 byte symbols in GPT-2 order,
    greedy merges over the corpus, then the chat / vision special tokens last."""
    from transformers import Qwen2Tokenizer

    symbols = tiny_tokenizers._byte_symbols()
    probe = Qwen2Tokenizer(vocab={s: i for i, s in enumerate(symbols)}, merges=[])
    units: Counter = tiny_tokenizers._units(probe.backend_tokenizer,
                                            tiny_tokenizers.corpus() + _TEMPLATE_TEXT * 20)
    merges = tiny_tokenizers.learn_merges(units, vocab_size - len(symbols) - len(QWEN_SPECIALS))
    tokens = symbols + tiny_tokenizers._new_tokens(merges) + QWEN_SPECIALS
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != vocab_size:
        raise ValueError(f"Qwen2 vocabulary has duplicates: {len(vocab)} != {vocab_size}")
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[tuple(m) for m in merges],
                               model_max_length=32768)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS[1:]})
    return tokenizer


def qwen2_5_vl(seed: int, tokenizer):
    """Qwen2_5_VLForConditionalGeneration: a 2-layer text stack with 4 query and 2 key/value
    heads (etp 2 splits both), multimodal RoPE sections summing to head_dim / 2, a 1-block
    vision tower whose merger projects to the text width."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2],
                                          "rope_theta": 1e6},
                         pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|endoftext|>"],
                         eos_token_id=ids["<|im_end|>"]),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           out_hidden_size=32, fullatt_block_indexes=[0], window_size=112),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"])
    return _seeded(seed, lambda: Qwen2_5_VLForConditionalGeneration(config))


def qwen_image_vae(seed: int):
    """AutoencoderKLQwenImage with the real 8x spatial compression and 16 latent channels
    (per-channel latent mean / std as the real config has them); tiny widths."""
    from diffusers import AutoencoderKLQwenImage

    import torch
    g = torch.Generator().manual_seed(seed + 20_000)
    mean = [round(float(v), 4) for v in 0.5 * torch.randn(16, generator=g)]
    std = [round(float(v), 4) for v in 1.0 + torch.rand(16, generator=g)]
    return _seeded(seed, lambda: AutoencoderKLQwenImage(
        base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
        temperal_downsample=[False, True, True], latents_mean=mean, latents_std=std))


def qwen_image_parts(seed: int) -> Parts:
    """QwenImagePipeline layout; the scheduler is Qwen-Image's (exponential dynamic shift with
    its own base / max shift and sequence lengths, shift_terminal 0.02)."""
    from diffusers import QwenImageTransformer2DModel

    tokenizer = qwen2_tokenizer()
    transformer = _seeded(seed, lambda: QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)))
    return Parts(components={
        "transformer": transformer, "vae": qwen_image_vae(seed + 1),
        "text_encoder": qwen2_5_vl(seed + 2, tokenizer), "tokenizer": tokenizer,
        "scheduler": _flow_scheduler(
            base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
            num_train_timesteps=1000, shift=1.0, shift_terminal=0.02, use_dynamic_shifting=True,
            time_shift_type="exponential", invert_sigmas=False, use_beta_sigmas=False,
            use_exponential_sigmas=False, use_karras_sigmas=False)})


def qwen_image_edit_processor(tokenizer):
    """Qwen2VLProcessor as QwenImageEditPipeline loads it: the checkpoint's tokenizer and a
    Qwen2-VL image processor of the tiny vision tower's patching (14 px patches, 2x2 merge, 2
    frames) bounded to at most 56 x 56 pixels, so a source image becomes 2 x 2 vision tokens."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2,
                                            min_pixels=28 * 28, max_pixels=56 * 56)
    video_processor = Qwen2VLVideoProcessor(patch_size=14, merge_size=2, temporal_patch_size=2)
    return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                            video_processor=video_processor)


def qwen_image_edit_parts(seed: int) -> Parts:
    """QwenImageEditPipeline layout: Qwen-Image's components (the edit transformer is Qwen-Image's
    class and config) and the processor that feeds the source image to the vision tower."""
    parts = qwen_image_parts(seed)
    processor = qwen_image_edit_processor(parts.components["tokenizer"])
    return Parts(components={**parts.components, "processor": processor})


def qwen_image_edit_plus_parts(seed: int) -> Parts:
    """QwenImageEditPlusPipeline layout: exactly Qwen-Image-Edit's components (the published
    Qwen-Image-Edit-2509 ships the same classes and configs); only the pipeline that saves
    them, and so how its source images are presented, differs."""
    return qwen_image_edit_parts(seed)
