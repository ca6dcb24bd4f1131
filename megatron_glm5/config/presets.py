"""Built-in models: the released GLM-5.3-Flash (``glm5_flash_config``) and a tiny one covering KDA, DSA, dense and
MoE layers for CPU tests and the quickstart (``tiny_config``), as HF config dicts and as ``Glm5Config``."""

from __future__ import annotations

from megatron_glm5.config.schema import Glm5Config
from megatron_glm5.layer_types import INDEXED_ATTENTION, LINEAR_ATTENTION


def glm5_flash_hf_text_config() -> dict:
    """The released GLM-5.3-Flash text config (the values that change the math)."""
    n = 45
    return dict(
        model_type="glm5_next_text", vocab_size=154880, hidden_size=4096, intermediate_size=12288,
        moe_intermediate_size=2048, num_hidden_layers=n, num_attention_heads=64, num_key_value_heads=64,
        n_shared_experts=1, n_routed_experts=288, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=0, v_head_dim=256, qk_nope_head_dim=256, n_group=1, topk_group=1, num_experts_per_tok=8,
        norm_topk_prob=True, rms_norm_eps=1e-5, pad_token_id=154820, index_topk=2048, index_head_dim=128,
        index_n_heads=32, swiglu_limit=10.0, linear_head_dim=128, linear_num_heads=64, linear_conv_kernel_dim=4,
        linear_lower_bound=-5.0, hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20, index_kpool=4,
        index_kpool_always_select_tail=True, num_nextn_predict_layers=1,
        mlp_layer_types=["dense"] * 3 + ["sparse"] * (n - 3),
        layer_types=[LINEAR_ATTENTION if i % 4 != 3 else INDEXED_ATTENTION for i in range(n)],
    )


def glm5_flash_hf_config() -> dict:
    return {
        "architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
        "text_config": glm5_flash_hf_text_config(),
        "vision_config": dict(depth=24, hidden_size=1024, num_heads=16, intermediate_size=4096, out_hidden_size=4096,
                              projection_intermediate_size=10240, patch_size=14, temporal_patch_size=2,
                              spatial_merge_size=2, in_channels=3, rms_norm_eps=1e-5, attention_bias=True,
                              swiglu_limit=10.0, rope_parameters={"rope_theta": 10000.0, "rope_type": "axial"}),
        "image_token_id": 154854, "video_token_id": 154855, "image_start_token_id": 154830,
        "image_end_token_id": 154831, "video_start_token_id": 154832, "video_end_token_id": 154833,
        "tie_word_embeddings": False,
    }


def tiny_hf_config(num_layers: int = 4, hc_mult: int = 3, with_vision: bool = True, mtp: bool = False) -> dict:
    """A tiny GLM-5.3 config that covers KDA, DSA (with a sparse top-k), dense and MoE layers."""
    layer_types = [LINEAR_ATTENTION if i % 2 == 0 else INDEXED_ATTENTION for i in range(num_layers)]
    mlp_types = ["dense"] + ["sparse"] * (num_layers - 1)
    text = dict(
        model_type="glm5_next_text", vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1, norm_topk_prob=True,
        rms_norm_eps=1e-5, pad_token_id=0, index_topk=8, index_head_dim=16, index_n_heads=8, swiglu_limit=10.0,
        linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
        hc_mult=hc_mult, hc_eps=1e-6, hc_sinkhorn_iters=5, index_kpool=4, index_kpool_always_select_tail=True,
        mlp_layer_types=mlp_types, layer_types=layer_types, initializer_range=0.02,
    )
    if mtp:
        text["num_nextn_predict_layers"] = 1
    cfg = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "text_config": text,
           "image_token_id": 250, "video_token_id": 251, "image_start_token_id": 252, "image_end_token_id": 253,
           "video_start_token_id": 254, "video_end_token_id": 255, "tie_word_embeddings": False}
    if with_vision:
        cfg["vision_config"] = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                                    projection_intermediate_size=80, patch_size=14, temporal_patch_size=2,
                                    spatial_merge_size=2, in_channels=3, rms_norm_eps=1e-5, attention_bias=True,
                                    swiglu_limit=10.0, rope_parameters={"rope_theta": 10000.0, "rope_type": "axial"})
    return cfg


def glm5_flash_config(**overrides) -> Glm5Config:
    """The released GLM-5.3-Flash model (320B total / 18B active)."""
    return Glm5Config.from_hf(glm5_flash_hf_config(), **overrides)


def tiny_config(**overrides) -> Glm5Config:
    """A tiny model for CPU tests and the quickstart."""
    return Glm5Config.from_hf(tiny_hf_config(), **overrides)


PRESETS = {"glm5-flash": glm5_flash_config, "tiny": tiny_config}
