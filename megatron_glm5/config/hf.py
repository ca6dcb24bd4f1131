"""HF ``config.json`` <-> :class:`~megatron_glm5.config.schema.Glm5Config`: the value checks, the mapping of every
math-changing HF key onto megatron-core's / this project's field names (as ``Glm5NextTextConfig.__post_init__``
reads them), and the export of a config as HF ``config.json`` (only what the model has).

:class:`HFConfigIO` carries ``Glm5Config.from_hf`` and ``Glm5Config.to_hf_dict`` (a base class of the schema, so
this module needs nothing from it).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch.nn.functional as F

from megatron_glm5.config.hf_defaults import HF_TEXT_DEFAULTS
from megatron_glm5.config.vision import Glm5VisionConfig
from megatron_glm5.errors import Glm5ConfigError
from megatron_glm5.layer_types import INDEXED_ATTENTION, LINEAR_ATTENTION, SPARSE_MLP

if TYPE_CHECKING:  # the schema subclasses HFConfigIO
    from megatron_glm5.config.schema import Glm5Config


class HFConfigIO:
    """``from_hf`` / ``to_hf_dict`` of :class:`~megatron_glm5.config.schema.Glm5Config`."""

    @classmethod
    def from_hf(cls, path_or_dict: Any, **overrides) -> "Glm5Config":
        """Build from an HF checkpoint dir, a config.json path or a dict. ``overrides`` set Glm5Config fields
        (e.g. parallel sizes, backends, params_dtype)."""
        if isinstance(path_or_dict, dict):
            full = path_or_dict
        else:
            p = str(path_or_dict)
            if os.path.isdir(p):
                p = os.path.join(p, "config.json")
            if not os.path.exists(p):
                raise Glm5ConfigError(f"config.json: not found at {p}")
            try:
                with open(p, encoding="utf-8") as fh:
                    full = json.load(fh)
            except (OSError, ValueError, RecursionError) as e:
                raise Glm5ConfigError(f"{p}: not readable JSON ({' '.join(str(e).split())[:200]})") from None
        check_hf_config_types(full)
        text = full.get("text_config")
        if text is None:
            text = {k: v for k, v in full.items() if k != "vision_config"}
        vision = full.get("vision_config")
        kw = {**_megatron_defaults(), **_text_fields_from_hf(text)}
        if vision is not None:
            kw["vision"] = Glm5VisionConfig.from_hf_dict(vision)
        for k in ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
                  "video_start_token_id", "video_end_token_id"):
            if k in full:
                kw[k] = full[k]
        if full.get("quantization_config") is not None:
            kw["hf_quantization_config"] = dict(full["quantization_config"])
        if full.get("tie_word_embeddings", text.get("tie_word_embeddings", False)):
            kw["tie_word_embeddings"] = True
        kw.update(overrides)
        return cls(**kw)

    def to_hf_dict(self) -> dict:
        """The HF config.json dict (nested text_config / vision_config) for this model."""
        text = dict(self.hf_text_config)
        text.update(
            model_type="glm5_next_text", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.ffn_hidden_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_attention_heads, n_shared_experts=self.n_shared_experts,
            routed_scaling_factor=self.moe_router_topk_scaling_factor,
            kv_lora_rank=self.kv_lora_rank, q_lora_rank=self.q_lora_rank, qk_rope_head_dim=0,
            v_head_dim=self.v_head_dim, qk_nope_head_dim=self.qk_head_dim,
            n_group=self.moe_router_num_groups or 1, topk_group=self.moe_router_group_topk or 1,
            num_experts_per_tok=self.moe_router_topk, norm_topk_prob=self.norm_topk_prob, rms_norm_eps=self.layernorm_epsilon,
            pad_token_id=self.pad_token_id, tie_word_embeddings=self.tie_word_embeddings,
            mlp_layer_types=list(self.mlp_layer_types), layer_types=list(self.layer_types),
            indexer_types=list(self.indexer_types), index_topk=self.index_topk, index_head_dim=self.index_head_dim,
            index_n_heads=self.index_n_heads, swiglu_limit=self.swiglu_limit, linear_head_dim=self.linear_head_dim,
            linear_num_heads=self.linear_num_heads, linear_conv_kernel_dim=self.linear_conv_kernel_dim,
            linear_lower_bound=self.linear_lower_bound, hc_mult=self.hc_mult, hc_eps=self.hc_eps,
            hc_sinkhorn_iters=self.hc_sinkhorn_iters, index_kpool=self.index_kpool,
            index_kpool_always_select_tail=self.index_kpool_always_select_tail,
            initializer_range=self.init_method_std,
        )
        if self.num_moe_experts:  # a model without MoE layers has neither; the source config's values are kept
            text.update(n_routed_experts=self.num_moe_experts, moe_intermediate_size=self.moe_ffn_hidden_size)
        if self.mtp_num_layers:
            text["num_nextn_predict_layers"] = self.mtp_num_layers
        else:  # e.g. built without MTP from a checkpoint that holds no MTP weights
            text.pop("num_nextn_predict_layers", None)
        text.pop("linear_attn_config", None)
        out = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
               "text_config": text, "tie_word_embeddings": self.tie_word_embeddings,
               "image_token_id": self.image_token_id, "video_token_id": self.video_token_id,
               "image_start_token_id": self.image_start_token_id, "image_end_token_id": self.image_end_token_id,
               "video_start_token_id": self.video_start_token_id, "video_end_token_id": self.video_end_token_id}
        if self.vision is not None:
            out["vision_config"] = self.vision.to_hf_dict()
        if self.hf_quantization_config is not None:
            out["quantization_config"] = dict(self.hf_quantization_config)
        return out


# HF config.json value types and ranges checked before anything reads them (a "false" string is not a bool, an
# rms_norm_eps of 0 is not an epsilon). kind: "int+" positive int, "int0" non-negative int, "float+" positive
# number, "float" any number, "bool", "strs" list of strings; None is accepted where HF accepts null.
_POS_INT = ("num_hidden_layers", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
            "n_routed_experts", "num_experts_per_tok", "index_n_heads", "index_head_dim", "index_topk", "index_kpool",
            "hc_mult", "hc_sinkhorn_iters", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim")
_TEXT_SCHEMA = {
    **{k: ("int+", False) for k in _POS_INT},
    **{k: ("int+", True) for k in ("q_lora_rank", "n_group", "topk_group")},
    **{k: ("int0", True) for k in ("n_shared_experts", "num_nextn_predict_layers", "pad_token_id",
                                   "index_topk_freq", "index_skip_topk_offset")},
    "qk_rope_head_dim": ("int0", False),
    **{k: ("float+", False) for k in ("rms_norm_eps", "hc_eps", "routed_scaling_factor", "swiglu_limit",
                                      "initializer_range")},
    "linear_lower_bound": ("float", True),
    **{k: ("bool", False) for k in ("tie_word_embeddings", "norm_topk_prob", "attention_bias",
                                    "index_kpool_always_select_tail")},
    **{k: ("strs", True) for k in ("layer_types", "mlp_layer_types", "indexer_types")},
}
_VISION_SCHEMA = {
    **{k: ("int+", False) for k in ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size",
                                    "projection_intermediate_size", "patch_size", "temporal_patch_size",
                                    "spatial_merge_size", "in_channels", "num_hidden_layers",
                                    "num_attention_heads")},
    **{k: ("float+", False) for k in ("rms_norm_eps", "swiglu_limit")},
    "attention_bias": ("bool", False),
}
_TOP_SCHEMA = {
    **{k: ("int0", True) for k in ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
                                   "video_start_token_id", "video_end_token_id")},
    "tie_word_embeddings": ("bool", False),
}


def _check_value(where: str, v, kind: str, nullable: bool) -> None:
    if v is None:
        if not nullable:
            raise Glm5ConfigError(f"{where}: null is not allowed")
        return
    is_int = isinstance(v, int) and not isinstance(v, bool)
    ok = {"int+": is_int and v > 0, "int0": is_int and v >= 0, "bool": isinstance(v, bool),
          "float+": (is_int or isinstance(v, float)) and v > 0 and v != float("inf"),
          "float": (is_int or isinstance(v, float)) and v == v and abs(v) != float("inf"),
          "strs": isinstance(v, list) and all(isinstance(x, str) for x in v)}[kind]
    if not ok:
        want = {"int+": "a positive integer", "int0": "a non-negative integer", "bool": "true or false",
                "float+": "a positive finite number", "float": "a finite number", "strs": "a list of strings"}[kind]
        raise Glm5ConfigError(f"{where}: must be {want}, got {json.dumps(v)[:80]}")


def check_hf_config_types(full) -> None:
    """Raise Glm5ConfigError naming the first HF config value of the wrong JSON type or out of range."""
    if not isinstance(full, dict):
        raise Glm5ConfigError(f"config.json: must be a JSON object, got {type(full).__name__}")
    for sub in ("text_config", "vision_config"):
        if full.get(sub) is not None and not isinstance(full[sub], dict):
            raise Glm5ConfigError(f"{sub}: must be a JSON object, got {type(full[sub]).__name__}")
    text = full.get("text_config")
    if text is None:
        text = full
    tprefix = ""  # text fields are named bare, as in every other config error
    checks = [(tprefix, text, _TEXT_SCHEMA), ("vision_config.", full.get("vision_config") or {}, _VISION_SCHEMA)]
    if text is not full:
        checks.append(("", full, _TOP_SCHEMA))
    for prefix, d, schema in checks:
        for k, (kind, nullable) in schema.items():
            if k in d:
                _check_value(prefix + k, d[k], kind, nullable)
    lac = text.get("linear_attn_config")
    if lac is not None and not isinstance(lac, dict):
        raise Glm5ConfigError(f"{tprefix}linear_attn_config: must be a JSON object")
    q = full.get("quantization_config")
    if q is not None and not isinstance(q, dict):
        raise Glm5ConfigError("quantization_config: must be a JSON object")


def _text_fields_from_hf(raw: dict) -> dict:
    """Map an HF text config dict onto Glm5Config keyword arguments (mirrors Glm5NextTextConfig.__post_init__); a
    key the dict leaves out takes ``Glm5NextTextConfig``'s default (:mod:`~megatron_glm5.config.hf_defaults`), except
    ``num_hidden_layers``: a config that names no depth is refused rather than built at the released 45 layers."""
    if "num_hidden_layers" not in raw:
        raise Glm5ConfigError("num_hidden_layers: missing from the text config")
    t = {**HF_TEXT_DEFAULTS, **raw}
    n = int(t["num_hidden_layers"])
    if raw.get("model_type") not in (None, "glm5_next_text", "glm5_next"):
        raise Glm5ConfigError(f"model_type: expected 'glm5_next_text', got {raw.get('model_type')!r}")
    if t["hidden_act"] != "silu":
        raise Glm5ConfigError(f"hidden_act: only 'silu' is supported, got {t['hidden_act']!r}")
    if t["attention_bias"]:
        raise Glm5ConfigError("attention_bias: True is not supported (the released model has no attention bias)")
    heads = int(t["num_attention_heads"])
    kv_heads = t["num_key_value_heads"] or heads
    if kv_heads != heads:
        raise Glm5ConfigError(f"num_key_value_heads: {kv_heads} must equal num_attention_heads {heads}")
    if int(t["qk_rope_head_dim"]) != 0:
        raise Glm5ConfigError(f"qk_rope_head_dim: GLM-5.3 DSA is NoPE; must be 0, got {t['qk_rope_head_dim']}")

    mlp_types = t["mlp_layer_types"] or (["dense"] * min(3, n) + ["sparse"] * (n - 3))
    layer_types = t["layer_types"] or [LINEAR_ATTENTION if i % 4 != 3 else INDEXED_ATTENTION for i in range(n)]
    layer_types = [INDEXED_ATTENTION if x == "full_attention" else x for x in layer_types]
    indexer_types = t["indexer_types"]
    if indexer_types is None:
        pattern = t.get("index_topk_pattern")
        if pattern is not None:
            if isinstance(pattern, str):
                bad = set(pattern) - {"F", "S"}
                if bad:
                    raise Glm5ConfigError(f"index_topk_pattern: unknown letters {sorted(bad)} (use F and S)")
                indexer_types = [{"F": "full", "S": "shared"}[c] for c in pattern]
            else:
                indexer_types = list(pattern)
        else:  # Glm5NextTextConfig.__post_init__'s schedule and its defaults (freq 1, offset 2)
            freq = max(int(t.get("index_topk_freq", 1)), 1)
            offset = int(t.get("index_skip_topk_offset", 2))
            indexer_types = ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n)]

    linear_head_dim = t["linear_head_dim"]
    linear_num_heads = t["linear_num_heads"]
    conv = t["linear_conv_kernel_dim"]
    lower = t["linear_lower_bound"]
    lac = t.get("linear_attn_config")
    if lac is not None:
        linear_head_dim = lac.get("head_dim", linear_head_dim)
        linear_num_heads = lac.get("num_heads", linear_num_heads)
        conv = lac.get("short_conv_kernel_size", conv)
        lower = lac.get("gate_lower_bound", lower)
        if lac.get("safe_gate", True) and lower is None:
            lower = HF_TEXT_DEFAULTS["linear_lower_bound"]

    n_group = int(t["n_group"] or 1)
    topk_group = int(t["topk_group"] or 1)
    num_experts = int(t["n_routed_experts"])
    moe_ffn = int(t["moe_intermediate_size"])
    n_shared = int(t["n_shared_experts"] or 0)
    mtp = int(t.get("num_nextn_predict_layers") or 0)
    has_moe = SPARSE_MLP in mlp_types
    kw = dict(
        num_layers=n,
        hidden_size=int(t["hidden_size"]),
        num_attention_heads=heads,
        num_query_groups=heads,
        ffn_hidden_size=int(t["intermediate_size"]),
        vocab_size=int(t["vocab_size"]),
        pad_token_id=raw.get("pad_token_id"),
        tie_word_embeddings=bool(t["tie_word_embeddings"]),
        layernorm_epsilon=float(t["rms_norm_eps"]),
        init_method_std=float(t["initializer_range"]),
        # MLA (NoPE)
        q_lora_rank=t["q_lora_rank"],
        kv_lora_rank=int(t["kv_lora_rank"]),
        qk_head_dim=int(t["qk_nope_head_dim"]),
        qk_pos_emb_head_dim=0,
        v_head_dim=int(t["v_head_dim"]),
        # MoE
        num_moe_experts=num_experts if has_moe else None,
        moe_ffn_hidden_size=moe_ffn if has_moe else None,
        moe_router_topk=int(t["num_experts_per_tok"]),
        moe_shared_expert_intermediate_size=(moe_ffn * n_shared) if (n_shared and has_moe) else None,
        n_shared_experts=n_shared,
        moe_layer_freq=[1 if x == SPARSE_MLP else 0 for x in mlp_types],
        moe_router_topk_scaling_factor=float(t["routed_scaling_factor"]),
        moe_router_num_groups=n_group if n_group > 1 else None,
        moe_router_group_topk=topk_group if n_group > 1 else None,
        norm_topk_prob=bool(t["norm_topk_prob"]),
        swiglu_limit=float(t["swiglu_limit"]),
        mtp_num_layers=mtp or None,
        # GLM schedules
        layer_types=list(layer_types),
        mlp_layer_types=list(mlp_types),
        indexer_types=list(indexer_types),
        linear_num_heads=int(linear_num_heads),
        linear_head_dim=int(linear_head_dim),
        linear_conv_kernel_dim=int(conv),
        linear_lower_bound=None if lower is None else float(lower),
        index_n_heads=int(t["index_n_heads"]),
        index_head_dim=int(t["index_head_dim"]),
        index_topk=int(t["index_topk"]),
        index_kpool=int(t["index_kpool"]),
        index_kpool_always_select_tail=bool(t["index_kpool_always_select_tail"]),
        hc_mult=int(t["hc_mult"]),
        hc_eps=float(t["hc_eps"]),
        hc_sinkhorn_iters=int(t["hc_sinkhorn_iters"]),
        hf_text_config=dict(raw),
    )
    return kw


def _megatron_defaults() -> dict:
    """Fixed megatron-core settings that GLM-5.3 needs (no biases, RMSNorm, clamped SwiGLU, sigmoid router...)."""
    return dict(
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        rope_type="rope",
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        transformer_impl="local",
        cuda_graph_modules=[],  # the whole layer, megatron-core's default "full" spelled as it asks (no warning)
    )
