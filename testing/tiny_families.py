"""The components of each tiny checkpoint family (testing/tiny_checkpoints.py writes them):
real diffusers / transformers classes at toy sizes, built under a seed, with every tensor their
initialiser leaves constant perturbed by seeded noise (so a skipped tensor or a dropped condition
changes the output). `<family>_parts(seed)` returns the pipeline's components and extra config.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from testing import tiny_tokenizers

PERTURB_STD = 0.05    # noise added to every constant tensor (norm weights, biases, zero inits)


@dataclass
class Parts:
    """A family's components (model_index name -> object) and its extra pipeline config."""
    components: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- shared pieces


def perturb_constants(module: torch.nn.Module, generator: torch.Generator,
                      std: float = PERTURB_STD) -> int:
    """Add seeded noise to every saved floating tensor whose elements are all equal; returns how
    many tensors were changed."""
    changed = 0
    with torch.no_grad():
        for _, tensor in sorted(module.state_dict(keep_vars=True).items()):
            if not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            flat = tensor.detach().flatten()
            if bool(torch.all(flat == flat[0])):
                tensor.add_(std * torch.randn(tensor.shape, generator=generator))
                changed += 1
    return changed


def _seeded(seed: int, make: Callable[[], Any]) -> Any:
    """Build a module under `seed` and perturb its constants with a generator of the same seed."""
    torch.manual_seed(seed)
    module = make()
    if isinstance(module, torch.nn.Module):
        module.eval()
        perturb_constants(module, torch.Generator().manual_seed(seed + 10_000))
    return module


def _clip_text(seed: int, hidden: int, act: str, projection: bool, vocab_size: int):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    # Real CLIP configs keep the legacy ids bos=0, pad=1, eos=2 (eos=2 makes the pooler take
    # input_ids.argmax(), i.e. the tokenizer's <|endoftext|>, the largest id). The MLP width
    # divides by 2 and 4 like real ones (3072, 5120) so ETP can split it (diffusers' test: 37).
    config = CLIPTextConfig(bos_token_id=0, eos_token_id=2, pad_token_id=1, vocab_size=vocab_size,
                            hidden_size=hidden, intermediate_size=40, num_attention_heads=4,
                            num_hidden_layers=5, layer_norm_eps=1e-5, hidden_act=act,
                            projection_dim=hidden, max_position_embeddings=77)
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return _seeded(seed, lambda: cls(config))


def _t5(seed: int, d_model: int, vocab_size: int, umt5: bool = False):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    kwargs = dict(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2,
                  num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
                  feed_forward_proj="gated-gelu", dropout_rate=0.0, tie_word_embeddings=False,
                  pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    if umt5:
        return _seeded(seed, lambda: UMT5EncoderModel(UMT5Config(**kwargs)))
    return _seeded(seed, lambda: T5EncoderModel(T5Config(**kwargs)))


def _image_vae(seed: int, shift_factor: float, scaling_factor: float):
    """AutoencoderKL with SD3 / FLUX's layout: 4 levels (8x down), 16 latent channels, no quant
    convs; only the widths are tiny."""
    from diffusers import AutoencoderKL

    return _seeded(seed, lambda: AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 16, 16),
        layers_per_block=1, latent_channels=16, norm_num_groups=4, sample_size=64,
        use_quant_conv=False, use_post_quant_conv=False, shift_factor=shift_factor,
        scaling_factor=scaling_factor))


def _flow_scheduler(**config):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**config)


VOCAB_SIZE = 1000     # every tiny tokenizer and text encoder (len(tokenizer) == vocab_size)

# --------------------------------------------------------------------------- families


def sd3_parts(seed: int) -> Parts:
    """SD3.5-medium layout: CLIP-L + CLIP-G (pooled + penultimate hidden) + T5, MMDiT with qk
    RMSNorm and a dual-attention block, patch 2."""
    from diffusers import SD3Transformer2DModel

    transformer = _seeded(seed, lambda: SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
        attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
        joint_attention_dim=96, pooled_projection_dim=32 + 48, pos_embed_max_size=16,
        qk_norm="rms_norm", dual_attention_layers=(0,)))
    return Parts({
        "transformer": transformer,
        "vae": _image_vae(seed + 1, shift_factor=0.0609, scaling_factor=1.5035),
        "text_encoder": _clip_text(seed + 2, 32, "quick_gelu", True, VOCAB_SIZE),
        "text_encoder_2": _clip_text(seed + 3, 48, "gelu", True, VOCAB_SIZE),
        "text_encoder_3": _t5(seed + 4, 96, VOCAB_SIZE),
        "tokenizer": tiny_tokenizers.clip_tokenizer(VOCAB_SIZE),
        "tokenizer_2": tiny_tokenizers.clip_tokenizer(VOCAB_SIZE, pad_token="!"),
        "tokenizer_3": tiny_tokenizers.t5_tokenizer(VOCAB_SIZE),
        "scheduler": _flow_scheduler(num_train_timesteps=1000, shift=3.0),
        "image_encoder": None, "feature_extractor": None,
    })


def flux_parts(seed: int) -> Parts:
    """FLUX.1-dev layout: CLIP-L pooled + T5, guidance embedding, 2x2-packed 16-channel latents,
    dynamic shift as FLUX.1-dev's scheduler config."""
    from diffusers import FluxTransformer2DModel

    transformer = _seeded(seed, lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=True, axes_dims_rope=(4, 4, 8)))
    return Parts({
        "transformer": transformer,
        "vae": _image_vae(seed + 1, shift_factor=0.1159, scaling_factor=0.3611),
        "text_encoder": _clip_text(seed + 2, 32, "quick_gelu", False, VOCAB_SIZE),
        "text_encoder_2": _t5(seed + 3, 32, VOCAB_SIZE),
        "tokenizer": tiny_tokenizers.clip_tokenizer(VOCAB_SIZE),
        "tokenizer_2": tiny_tokenizers.t5_tokenizer(VOCAB_SIZE),
        "scheduler": _flow_scheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                     base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                     max_image_seq_len=4096),
        "image_encoder": None, "feature_extractor": None,
    })


def _wan_transformer(seed: int, in_channels: int = 16, **kwargs):
    from diffusers import WanTransformer3DModel

    return _seeded(seed, lambda: WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
        in_channels=in_channels, out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32,
        num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
        **kwargs))


def _wan_common(seed: int, shift: float) -> dict[str, Any]:
    from diffusers import AutoencoderKLWan

    return {
        # Wan 2.1's VAE layout (8x spatial, 4x temporal: 4n+1 frames); latents_mean / std are
        # the real checkpoint's (the class defaults).
        "vae": _seeded(seed + 1, lambda: AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, True, True])),
        "text_encoder": _t5(seed + 2, 32, VOCAB_SIZE, umt5=True),
        "tokenizer": tiny_tokenizers.t5_tokenizer(VOCAB_SIZE),
        "scheduler": _flow_scheduler(num_train_timesteps=1000, shift=shift),
    }


def wan21_parts(seed: int) -> Parts:
    return Parts({"transformer": _wan_transformer(seed), "transformer_2": None,
                  **_wan_common(seed, shift=7.0)})


def wan21_i2v_parts(seed: int) -> Parts:
    """Wan2.1-I2V-480P layout: 36 input channels (noise 16 + frame mask 4 + condition latents 16),
    a CLIP vision encoder whose penultimate hidden states enter through added k/v projections."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    image_encoder = _seeded(seed + 5, lambda: CLIPVisionModel(CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, projection_dim=16, num_hidden_layers=2,
        num_attention_heads=2, image_size=32, patch_size=4, hidden_act="gelu")))
    transformer = _wan_transformer(seed, in_channels=36, image_dim=16, added_kv_proj_dim=24)
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return Parts({"transformer": transformer, "transformer_2": None,
                  "image_encoder": image_encoder, "image_processor": processor,
                  **_wan_common(seed, shift=7.0)})


def wan22_parts(seed: int) -> Parts:
    """Wan2.2-T2V-A14B layout: a high-noise `transformer` and a low-noise `transformer_2` (other
    seeds, so a swapped expert shows), switched at boundary_ratio * num_train_timesteps."""
    return Parts({"transformer": _wan_transformer(seed), "transformer_2": _wan_transformer(seed + 7),
                  **_wan_common(seed, shift=3.0)},
                 config={"boundary_ratio": 0.875})


def _gemma3(seed: int, tokenizer):
    """Gemma3ForConditionalGeneration (text stack used; a tiny SigLIP tower keeps the class)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tiny_tokenizers.GEMMA_TRAILING}
    config = Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, max_position_embeddings=2048, sliding_window=64,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=16, patch_size=4),
        mm_tokens_per_image=4, boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"])
    return _seeded(seed, lambda: Gemma3ForConditionalGeneration(config))


def ltx2_parts(seed: int) -> Parts:
    """LTX-2.0 layout: Gemma3 (all hidden states) -> LTX2TextConnectors (learnable registers) ->
    one transformer over video + audio tokens; video VAE 32x spatial / 8x temporal (8n+1 frames);
    audio VAE over 16 mel bins (4x down in time and mel); vocoder to 24 kHz stereo."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video,
                           LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    tokenizer = tiny_tokenizers.gemma_tokenizer(VOCAB_SIZE)
    text_encoder = _gemma3(seed + 2, tokenizer)
    text = text_encoder.config.text_config
    mel_bins, audio_latent_channels = 16, 2
    audio_features = audio_latent_channels * (mel_bins // 4)     # packed [B, L, C * M / 4]
    transformer = _seeded(seed, lambda: LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2,
        attention_head_dim=8, cross_attention_dim=16, vae_scale_factors=(8, 32, 32),
        audio_in_channels=audio_features, audio_out_channels=audio_features,
        audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8,
        audio_scale_factor=4, audio_sampling_rate=16000, audio_hop_length=160, num_layers=2,
        qk_norm="rms_norm_across_heads", caption_channels=text.hidden_size, rope_type="split"))
    connectors = _seeded(seed + 3, lambda: LTX2TextConnectors(
        caption_channels=text.hidden_size, text_proj_in_factor=text.num_hidden_layers + 1,
        video_connector_num_attention_heads=4, video_connector_attention_head_dim=8,
        video_connector_num_layers=1, video_connector_num_learnable_registers=8,
        audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1, audio_connector_num_learnable_registers=8,
        connector_rope_base_seq_len=4096, rope_theta=10000.0, causal_temporal_positioning=False,
        rope_type="split"))
    vae = _seeded(seed + 1, lambda: AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 32, 32),
        decoder_block_out_channels=(8, 16, 32), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1), spatio_temporal_scaling=(True, True, True, True),
        decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(False, False, False, False),
        downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
        upsample_type=("spatiotemporal",) * 3, upsample_residual=(True, True, True),
        upsample_factor=(2, 2, 2), timestep_conditioning=False, patch_size=4, patch_size_t=1,
        encoder_causal=True, decoder_causal=False,
        # Stated, as LTX-2's config does: the default formula (patch * 2 ** #scaling blocks)
        # would give 64 / 16, not the 32 / 8 these down / up blocks really produce.
        spatial_compression_ratio=32, temporal_compression_ratio=8))
    audio_vae = _seeded(seed + 4, lambda: AutoencoderKLLTX2Audio(
        base_channels=audio_features, output_channels=2, ch_mult=(1, 2, 4), num_res_blocks=1,
        attn_resolutions=None, in_channels=2, resolution=16, latent_channels=audio_latent_channels,
        norm_type="pixel", causality_axis="height", dropout=0.0, mid_block_add_attention=False,
        sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=mel_bins))
    # 100 mel frames/s (16000 / 160) x 240 samples per frame = 24 kHz, LTX-2's real output rate.
    vocoder = _seeded(seed + 5, lambda: LTX2Vocoder(
        in_channels=2 * mel_bins, hidden_channels=32, out_channels=2,
        upsample_kernel_sizes=[12, 15, 16], upsample_factors=[6, 5, 8], resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1,
        output_sampling_rate=24000))
    return Parts({
        "transformer": transformer, "vae": vae, "audio_vae": audio_vae, "vocoder": vocoder,
        "text_encoder": text_encoder, "tokenizer": tokenizer, "connectors": connectors,
        # LTX-2's converted checkpoint: dynamic shift from the video token count, terminal 0.1.
        "scheduler": _flow_scheduler(num_train_timesteps=1000, use_dynamic_shifting=True,
                                     base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
                                     max_image_seq_len=4096, shift_terminal=0.1),
        "processor": None, "prompt_enhancer": None, "duration_head": None,
    })
