"""Tiny random models of every family mmpack packs for, small enough for a CPU.

Each is a real transformers model of that family with the published vocabulary size and
special-token ids (the shards hold real ids) and the published vision geometry (patch,
merge and temporal patch sizes, ``tokens_per_second``), with tiny widths and depths.
``tiny_config(model_type)`` is its ``config.json``; the tests write it into the model
directories they build, and ``train_qwen2_vl.py --model tiny-<model_type>`` trains one.
"""

from __future__ import annotations

from typing import Any

QWEN2_IDS = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}
QWEN3_5_IDS = {
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
}
SIGLIP = {  # a tiny SigLIP tower, patch 14, no pooling head (LLaVA-OneVision, Gemma 3)
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "patch_size": 14,
    "vision_use_head": False,
}
TEXT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 32768,
}
VISION = {
    "depth": 2,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "out_hidden_size": 32,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
AUDIO_ENCODER = {  # a tiny Whisper-style encoder over 128 mel bins (Qwen2-Audio, Qwen2.5-Omni)
    "d_model": 32,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "encoder_layers": 1,
    "num_mel_bins": 128,
    "max_source_positions": 1500,
}
MOE = {"moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2}
HYBRID = {
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}


GLM_IDS = {  # GLM-4.5's token layout (GLM-4.5V, GLM-4.6V, GLM-4.6V-Flash)
    "image_token_id": 151363,
    "video_token_id": 151364,
    "image_start_token_id": 151339,
    "image_end_token_id": 151340,
    "video_start_token_id": 151341,
    "video_end_token_id": 151342,
}
GLM41V_IDS = {**GLM_IDS, "image_token_id": 151343, "video_token_id": 151344}  # GLM-4.1V's config.json
GLM_OCR_IDS = {  # GLM-OCR's own vocabulary (its config.json)
    "image_token_id": 59280,
    "video_token_id": 59281,
    "image_start_token_id": 59256,
    "image_end_token_id": 59257,
    "video_start_token_id": 59258,
    "video_end_token_id": 59259,
}
GLM_VISION = {  # GLM's tower: patch 14, merge 2, temporal 2, learnt positions of a 336 px image
    "depth": 2,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "out_hidden_size": 32,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "image_size": 336,
}
GLM_MOE = {  # GLM-4.5V's MoE shape: one dense layer first, a shared expert, top-k routing
    "moe_intermediate_size": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
}


GEMMA4_IDS = {
    "image_token_id": 258880,
    "video_token_id": 258884,
    "audio_token_id": 258881,
    "boi_token_id": 255999,
    "eoi_token_id": 258882,
    "boa_token_id": 256000,
    "eoa_token_index": 258883,
}
GEMMA4_TEXT = {
    "model_type": "gemma4_text",
    **TEXT,
    "vocab_size": 262144,
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 64,
    "global_head_dim": 16,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "hidden_size_per_layer_input": 0,
    "use_bidirectional_attention": "vision",
}
GEMMA4_VISION = {
    "model_type": "gemma4_vision",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "patch_size": 16,
    "pooling_kernel_size": 3,
    "position_embedding_size": 10240,
    "standardize": True,
}


def _rope(section: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section, **extra}
    }


TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2_vl": {
        "text_config": {
            "vocab_size": 151936,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            **_rope([2, 1, 1]),
        },
        "vision_config": {"depth": 1, "embed_dim": 16, "hidden_size": 16, "num_heads": 2, "mlp_ratio": 2},
        **QWEN2_IDS,
    },
    "qwen2_5_vl": {
        "text_config": {**TEXT, "vocab_size": 151936, **_rope([2, 1, 1])},
        "vision_config": {
            **VISION,
            "patch_size": 14,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
        },
        **QWEN2_IDS,
    },
    "qwen3_vl": {
        "text_config": {**TEXT, "vocab_size": 151936, **_rope([2, 1, 1], mrope_interleaved=True)},
        "vision_config": {
            **VISION,
            "patch_size": 16,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
        **QWEN2_IDS,
    },
    "qwen3_vl_moe": {
        "text_config": {
            **TEXT,
            **MOE,
            "decoder_sparse_step": 1,
            "vocab_size": 151936,
            **_rope([2, 1, 1], mrope_interleaved=True),
        },
        "vision_config": {
            **VISION,
            "patch_size": 16,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
        **QWEN2_IDS,
    },
    "qwen3_5": {
        "text_config": {
            **TEXT,
            **HYBRID,
            "vocab_size": 248320,
            **_rope([1, 1, 0], mrope_interleaved=True, partial_rotary_factor=0.5),
        },
        "vision_config": {**VISION, "patch_size": 16, "num_position_embeddings": 16},
        **QWEN3_5_IDS,
    },
    "qwen3_5_moe": {
        "text_config": {
            **{k: v for k, v in TEXT.items() if k != "intermediate_size"},
            **HYBRID,
            **MOE,
            "shared_expert_intermediate_size": 16,
            "vocab_size": 248320,
            **_rope([1, 1, 0], mrope_interleaved=True, partial_rotary_factor=0.5),
        },
        "vision_config": {**VISION, "patch_size": 16, "num_position_embeddings": 16},
        **QWEN3_5_IDS,
    },
    "internvl": {  # InternVL3-1B-hf's geometry: 448 px tiles, patch 14, pixel shuffle 0.5 → 256 tokens
        "text_config": {"model_type": "qwen2", **TEXT, "vocab_size": 151674},
        "vision_config": {
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": [448, 448],
            "patch_size": [14, 14],
        },
        "downsample_ratio": 0.5,
        "image_token_id": 151667,
    },
    # llava-onevision-qwen2-0.5b-ov-hf's geometry: SigLIP at 384 px, patch 14 → 27 × 27 = 729 tokens
    # per crop (processor_config.json num_image_tokens), the 36 anyres pinpoints of
    # preprocessor_config.json, "full" features of the last layer, anyres_max_9; the Qwen2-0.5B
    # vocabulary (151936) + <image>, <video>, padded to a multiple of 64 as the conversion does
    "llava_onevision": {
        "text_config": {"model_type": "qwen2", **TEXT, "vocab_size": 152000, "use_sliding_window": False},
        "vision_config": {**SIGLIP, "image_size": 384},
        "image_token_index": 151646,
        "video_token_index": 151647,
        "vision_feature_select_strategy": "full",
        "vision_feature_layer": -1,
        "vision_aspect_ratio": "anyres_max_9",
        "image_grid_pinpoints": [[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)],
    },
    # gemma-3-4b-it's geometry: SigLIP at 896 px, patch 14, 64 × 64 patches pooled 4 × 4 → 256 tokens
    # per image (mm_tokens_per_image), the Gemma 3 vocabulary (262144 + <image_soft_token>, 262208
    # rows as published); one sliding-window layer (a window shorter than an image's sample, so the
    # packed masks' window matters) and one full-attention layer
    "gemma3": {
        "text_config": {
            "model_type": "gemma3_text",
            **TEXT,
            "vocab_size": 262208,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 64,
        },
        "vision_config": {**SIGLIP, "image_size": 896},
        "mm_tokens_per_image": 256,
        "image_token_index": 262144,
        "boi_token_index": 255999,
        "eoi_token_index": 256000,
    },
    # Gemma 4 (gemma-4-31B-it's layout): the Gemma 4 ids in Gemma 3's 262144-row vocabulary, a
    # sliding-window layer (a window shorter than an image's sample) and a full-attention layer with
    # keys as values and a head dim of its own, image blocks bidirectional on sliding layers only
    # ("vision"), no per-layer inputs; its tower: patch 16, 3 × 3 pooling, standardized outputs
    "gemma4": {"text_config": GEMMA4_TEXT, "vision_config": GEMMA4_VISION, **GEMMA4_IDS},
    # gemma-4-26B-A4B-it's: the same with a mixture of experts beside every layer's MLP
    "gemma4_moe": {
        "model_type": "gemma4",
        "text_config": {
            **GEMMA4_TEXT,
            "enable_moe_block": True,
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": 16,
        },
        "vision_config": GEMMA4_VISION,
        **GEMMA4_IDS,
    },
    # GLM-V: GLM-4.5V's rotary layout (half the head dim rotated, mRoPE sections t, h, w), GLM-4.5's
    # vocabulary (151552 rows); GLM-OCR: its whole head dim rotated, its 59392-row vocabulary
    "glm4v": {  # GLM-4.1V-9B's token ids
        "text_config": {
            **TEXT,
            "head_dim": 16,
            "vocab_size": 151552,
            **_rope([2, 1, 1], partial_rotary_factor=0.5),
        },
        "vision_config": GLM_VISION,
        **GLM41V_IDS,
    },
    "glm4v_moe": {
        "text_config": {
            **TEXT,
            **GLM_MOE,
            "head_dim": 16,
            "vocab_size": 151552,
            **_rope([2, 1, 1], partial_rotary_factor=0.5),
        },
        "vision_config": GLM_VISION,
        **GLM_IDS,
    },
    "glm46v": {
        "text_config": {
            **TEXT,
            "head_dim": 16,
            "vocab_size": 151552,
            **_rope([2, 1, 1], partial_rotary_factor=0.5),
        },
        "vision_config": GLM_VISION,
        **GLM_IDS,
    },
    "glm_ocr": {
        "text_config": {**TEXT, "vocab_size": 59392, **_rope([2, 1, 1], partial_rotary_factor=1.0)},
        "vision_config": GLM_VISION,
        **GLM_OCR_IDS,
    },
    # Qwen2-Audio-7B-Instruct's layout: the Qwen vocabulary and its audio tokens (156032 rows as
    # published), a Whisper-style encoder over 3000 feature frames of 128 mel bins (its 1500
    # positions), pooled 2:1 into <|AUDIO|> tokens
    "qwen2_audio": {
        "text_config": {"model_type": "qwen2", **TEXT, "vocab_size": 156032},
        "audio_config": {"model_type": "qwen2_audio_encoder", **AUDIO_ENCODER},
        "audio_token_index": 151646,
    },
    # the Qwen2.5-Omni thinker: Qwen2.5-VL's vision tower and language model (mRoPE sections of
    # the published 16:24:24 ratio), a Whisper-style audio encoder
    "qwen2_5_omni_thinker": {
        "text_config": {**TEXT, "vocab_size": 151936, **_rope([2, 1, 1])},
        "vision_config": {**VISION, "patch_size": 14, "window_size": 112, "fullatt_block_indexes": [1]},
        "audio_config": {
            **AUDIO_ENCODER,
            "n_window": 100,  # the published default: attention within 2 s (200-frame) windows of a clip
            "output_dim": 32,
        },
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
    },
    # the Qwen3-Omni thinker: Qwen3-VL's vision tower (patch 16, deepstack), a Qwen3-MoE language
    # model (interleaved mRoPE), the chunked audio encoder (13 tokens per 100 frames); the ids and
    # position_id_per_seconds of the published thinker config
    "qwen3_omni_moe_thinker": {
        "text_config": {
            **TEXT,
            **MOE,
            "decoder_sparse_step": 1,
            "vocab_size": 152064,
            **_rope([2, 1, 1], mrope_interleaved=True),
        },
        "vision_config": {
            **VISION,
            "patch_size": 16,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
        "audio_config": {**AUDIO_ENCODER, "n_window": 50, "output_dim": 32, "downsample_hidden_size": 8},
        "audio_token_id": 151675,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "audio_start_token_id": 151669,
        "audio_end_token_id": 151670,
        "position_id_per_seconds": 13,
    },
}


def tiny_config(model_type: str) -> dict[str, Any]:
    """The ``config.json`` of the tiny model of ``model_type``."""
    return {"model_type": model_type, **TINY_CONFIGS[model_type]}


def tiny_model(model_type: str, seed: int = 0, attn_implementation: str = "sdpa"):
    """A random tiny model of ``model_type`` (fp32)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoModelForMultimodalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**tiny_config(model_type))
    auto = AutoModelForMultimodalLM if model_type == "qwen2_audio" else AutoModelForImageTextToText
    model = auto.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    if model_type == "gemma3":  # its projection starts at zero: images would not reach the logits
        torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.02)
    return model.eval()
