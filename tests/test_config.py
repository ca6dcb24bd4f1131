"""Glm5Config from HF config.json: every math-changing field read, presets, and one clear error per bad field."""

import copy
import json

import pytest

from megatron_glm5.config import (
    INDEXED_ATTENTION,
    LINEAR_ATTENTION,
    Glm5Config,
    Glm5ConfigError,
    glm5_flash_config,
    tiny_hf_config,
)


def test_released_preset():
    c = glm5_flash_config()
    assert c.num_layers == 45 and c.hidden_size == 4096 and c.vocab_size == 154880
    dsa = [i for i, t in enumerate(c.layer_types) if t == INDEXED_ATTENTION]
    assert dsa == list(range(3, 45, 4)) and len(dsa) == 11
    assert c.mlp_layer_types[:3] == ["dense"] * 3 and set(c.mlp_layer_types[3:]) == {"sparse"}
    assert c.index_kpool == 4 and c.index_topk == 2048 and c.index_kpool_always_select_tail
    assert c.num_moe_experts == 288 and c.moe_router_topk == 8 and c.moe_shared_expert_intermediate_size == 2048
    assert c.moe_router_topk_scaling_factor == 2.5 and c.moe_router_score_function == "sigmoid"
    assert c.moe_router_enable_expert_bias and c.activation_func_clamp_value == 10.0
    assert c.hc_mult == 4 and c.hc_sinkhorn_iters == 20 and c.hc_eps == 1e-6
    assert c.linear_num_heads == 64 and c.linear_head_dim == 128 and c.linear_lower_bound == -5.0
    assert c.q_lora_rank == 1536 and c.kv_lora_rank == 512 and c.qk_head_dim == 256 and c.v_head_dim == 256
    assert c.mtp_num_layers == 1 and c.vision.depth == 24 and not c.tie_word_embeddings


def test_reads_transformers_saved_config(tmp_path):
    from transformers import Glm5NextConfig

    hf = tiny_hf_config()
    Glm5NextConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")}).save_pretrained(tmp_path)
    c = Glm5Config.from_hf(str(tmp_path))
    t = hf["text_config"]
    assert c.num_layers == t["num_hidden_layers"] and c.layer_types == t["layer_types"]
    assert c.index_kpool == t["index_kpool"] and c.index_topk == t["index_topk"]
    assert c.hc_mult == t["hc_mult"] and c.linear_num_heads == t["linear_num_heads"]
    assert c.vision.hidden_size == hf["vision_config"]["hidden_size"]
    assert c.image_token_id == hf["image_token_id"]


def test_flat_text_only_config_and_hf_conventions():
    t = copy.deepcopy(tiny_hf_config(with_vision=False)["text_config"])
    for k in ("layer_types", "mlp_layer_types"):
        t.pop(k)
    t["num_hidden_layers"] = 8
    t["index_topk_pattern"] = "FFFFFFFS"
    t["linear_attn_config"] = {"head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 3, "gate_lower_bound": None,
                               "safe_gate": True}
    c = Glm5Config.from_hf(t)
    assert c.vision is None
    assert c.layer_types == [LINEAR_ATTENTION if i % 4 != 3 else INDEXED_ATTENTION for i in range(8)]
    assert c.mlp_layer_types == ["dense"] * 3 + ["sparse"] * 5
    assert c.indexer_types[7] == "shared" and c.indexer_types.count("shared") == 1
    assert (c.linear_head_dim, c.linear_num_heads, c.linear_conv_kernel_dim) == (8, 2, 3)
    assert c.linear_lower_bound == -5.0  # safe_gate with a null bound -> -5, as transformers does


def test_hf_round_trip():
    from transformers import Glm5NextConfig

    c = Glm5Config.from_hf(tiny_hf_config(mtp=True))
    d = c.to_hf_dict()
    c2 = Glm5Config.from_hf(json.loads(json.dumps(d)))
    for f in ("num_layers", "layer_types", "mlp_layer_types", "indexer_types", "index_kpool", "hc_mult",
              "linear_lower_bound", "moe_router_topk_scaling_factor", "mtp_num_layers", "vision"):
        assert getattr(c, f) == getattr(c2, f), f
    Glm5NextConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})


def _bad(mutate):
    hf = tiny_hf_config()
    mutate(hf)
    with pytest.raises(Glm5ConfigError) as e:
        Glm5Config.from_hf(hf)
    return str(e.value)


@pytest.mark.parametrize("field,mutate", [
    ("index_topk", lambda h: h["text_config"].update(index_topk=6)),
    ("layer_types", lambda h: h["text_config"].update(layer_types=["linear_attention"] * 3)),
    ("layer_types", lambda h: h["text_config"].update(layer_types=["linear_attention", "mamba"] * 2)),
    ("mlp_layer_types", lambda h: h["text_config"].update(mlp_layer_types=["dense", "moe", "sparse", "sparse"])),
    ("indexer_types", lambda h: h["text_config"].update(indexer_types=["full", "shared", "full", "full"])),
    ("qk_rope_head_dim", lambda h: h["text_config"].update(qk_rope_head_dim=8)),
    ("num_key_value_heads", lambda h: h["text_config"].update(num_key_value_heads=2)),
    ("norm_topk_prob", lambda h: h["text_config"].update(norm_topk_prob=False)),
    ("index_kpool", lambda h: h["text_config"].update(index_kpool=0)),
    ("vision_config.out_hidden_size", lambda h: h["vision_config"].update(out_hidden_size=32)),
    ("vision_config.num_heads", lambda h: h["vision_config"].update(num_heads=3)),
    ("hidden_act", lambda h: h["text_config"].update(hidden_act="gelu")),
    ("hc_sinkhorn_iters", lambda h: h["text_config"].update(hc_sinkhorn_iters=10 ** 9)),
])
def test_bad_fields_raise_one_clear_error(field, mutate):
    msg = _bad(mutate)
    assert msg.startswith(field + ":"), msg
    assert "\n" not in msg


def test_sizes_come_from_the_config():
    """Other head/stream/expert counts build a valid config (nothing assumes the released sizes)."""
    hf = tiny_hf_config(num_layers=6, hc_mult=2)
    hf["text_config"].update(num_attention_heads=2, num_key_value_heads=2, linear_num_heads=3, index_n_heads=4,
                             n_routed_experts=6, num_experts_per_tok=3, index_kpool=2, index_topk=6)
    c = Glm5Config.from_hf(hf)
    assert (c.num_attention_heads, c.linear_num_heads, c.index_n_heads, c.hc_mult) == (2, 3, 4, 2)
    assert (c.num_moe_experts, c.moe_router_topk, c.index_kpool) == (6, 3, 2)


# every size-like text key of Glm5NextTextConfig that the tiny config gives; the test leaves them all out
_TEXT_SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "kv_lora_rank",
                   "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "index_topk", "index_head_dim", "index_kpool",
                   "linear_head_dim", "linear_conv_kernel_dim", "n_shared_experts", "hc_sinkhorn_iters")


def test_absent_sizes_mean_what_transformers_means(tmp_path):
    """A config.json lacking the width keys builds the widths transformers' Glm5NextConfig builds from the same file;
    the head, expert, layer and stream counts it gives are used as given."""
    from transformers import Glm5NextConfig

    hf = tiny_hf_config()
    text = hf["text_config"]
    for k in _TEXT_SIZE_KEYS:
        del text[k]
    vision = hf["vision_config"] = {"num_heads": 2, "out_hidden_size": 4096}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    c = Glm5Config.from_hf(str(tmp_path))
    ref = Glm5NextConfig.from_pretrained(str(tmp_path))
    rt, rv = ref.text_config, ref.vision_config
    assert (c.vocab_size, c.hidden_size, c.ffn_hidden_size, c.moe_ffn_hidden_size) == (
        rt.vocab_size, rt.hidden_size, rt.intermediate_size, rt.moe_intermediate_size) == (154880, 4096, 12288, 2048)
    assert (c.kv_lora_rank, c.q_lora_rank, c.qk_head_dim, c.v_head_dim) == (
        rt.kv_lora_rank, rt.q_lora_rank, rt.qk_nope_head_dim, rt.v_head_dim)
    assert (c.index_topk, c.index_head_dim, c.index_kpool, c.linear_head_dim, c.linear_conv_kernel_dim) == (
        rt.index_topk, rt.index_head_dim, rt.index_kpool, rt.linear_head_dim, rt.linear_conv_kernel_dim)
    assert (c.n_shared_experts, c.hc_sinkhorn_iters) == (rt.n_shared_experts, rt.hc_sinkhorn_iters)
    assert c.moe_shared_expert_intermediate_size == rt.moe_intermediate_size * rt.n_shared_experts
    # given in the file: used as given, not the released 45 layers / 64 heads / 288 experts / 4 streams
    assert (c.num_layers, c.num_attention_heads, c.linear_num_heads, c.index_n_heads) == (4, 4, 4, 8)
    assert (c.num_moe_experts, c.moe_router_topk, c.hc_mult) == (8, 2, 3)
    assert (rt.num_hidden_layers, rt.num_attention_heads, rt.n_routed_experts, rt.hc_mult) == (4, 4, 8, 3)
    v = c.vision
    assert (v.depth, v.hidden_size, v.intermediate_size, v.projection_intermediate_size, v.patch_size) == (
        rv.depth, rv.hidden_size, rv.intermediate_size, rv.projection_intermediate_size, rv.patch_size)
    assert (v.temporal_patch_size, v.spatial_merge_size, v.in_channels, v.rope_theta) == (
        rv.temporal_patch_size, rv.spatial_merge_size, rv.in_channels, rv.rope_parameters["rope_theta"])
    assert (v.num_heads, v.out_hidden_size) == (rv.num_heads, rv.out_hidden_size) == (vision["num_heads"], 4096)


def test_to_hf_dict_writes_only_what_the_model_has():
    """A dense-only model exports no routed experts or expert width (nothing invented); an MoE model its own; the
    FP8 block of the source's quantization_config travels with the config (the export quantises with it)."""
    hf = tiny_hf_config(with_vision=False)
    text = hf["text_config"]
    text["mlp_layer_types"] = ["dense"] * text["num_hidden_layers"]
    for k in ("n_routed_experts", "moe_intermediate_size"):
        del text[k]
    d = Glm5Config.from_hf(hf).to_hf_dict()
    assert "n_routed_experts" not in d["text_config"] and "moe_intermediate_size" not in d["text_config"]
    assert "quantization_config" not in d
    moe = Glm5Config.from_hf(tiny_hf_config()).to_hf_dict()["text_config"]
    assert (moe["n_routed_experts"], moe["moe_intermediate_size"]) == (8, 32)
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [64, 32]}
    d = Glm5Config.from_hf({**tiny_hf_config(), "quantization_config": q}).to_hf_dict()
    assert d["quantization_config"] == q


def test_export_quantises_with_the_configs_fp8_block():
    from megatron_glm5.checkpoint.hf_export import FP8_BLOCK, fp8_block, hf_output_config

    assert fp8_block(tiny_hf_config()) == FP8_BLOCK == (128, 128)
    cfg = {**tiny_hf_config(), "quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 32]}}
    assert fp8_block(cfg) == (64, 32)
    assert hf_output_config(cfg, True, fp8_block(cfg))["quantization_config"]["weight_block_size"] == [64, 32]
    assert "quantization_config" not in hf_output_config(cfg, False, fp8_block(cfg))


def test_weight_bytes_lower_bounds_equal_the_built_models_at_tp_pp_1(mcore):
    """At TP = PP = EP = 1 each bound is exactly the bytes of the weights it counts in the built model."""
    from megatron_glm5.models.builder import build_model

    cfg = Glm5Config.from_hf(tiny_hf_config(num_layers=4), use_cpu_initialization=True)
    bounds = cfg.rank_weight_bytes_lower_bounds()
    got = {"vocab_size": 0, "n_routed_experts x moe_intermediate_size": 0, "intermediate_size": 0}
    for name, p in build_model(cfg).named_parameters():
        key = ("vocab_size" if name in ("embedding.word_embeddings.weight", "output_layer.weight") else
               "n_routed_experts x moe_intermediate_size" if ".mlp.experts." in name and name.startswith("decoder.")
               else "intermediate_size" if name.startswith("decoder.") and ".mlp.linear_fc" in name else None)
        if key:
            got[key] += p.numel() * p.element_size()
    assert bounds == got and all(got.values()), (bounds, got)


@pytest.mark.parametrize("update, key", [
    ({"vocab_size": 10 ** 12}, "vocab_size"),
    ({"n_routed_experts": 10 ** 7}, "n_routed_experts x moe_intermediate_size"),
    ({"intermediate_size": 10 ** 11}, "intermediate_size")])
def test_sizes_no_machine_holds_are_refused_before_allocating(update, key):
    hf = tiny_hf_config(num_layers=4)
    hf["text_config"].update(update)
    cfg = Glm5Config.from_hf(hf)
    with pytest.raises(Glm5ConfigError) as e:
        cfg.check_fits_memory("cpu")
    msg = str(e.value)
    assert msg.startswith(f"{key}: the model's weights need at least ") and "this machine's memory" in msg, msg
    need = sum(cfg.rank_weight_bytes_lower_bounds().values())
    cfg.check_fits_memory("cpu", available=need)  # exactly enough passes
    with pytest.raises(Glm5ConfigError, match=f"^{key}: "):
        cfg.check_fits_memory("cpu", available=need - 1)


def test_weight_bytes_lower_bounds_divide_over_the_layout():
    hf = tiny_hf_config(num_layers=4)
    one = Glm5Config.from_hf(hf).rank_weight_bytes_lower_bounds()
    split = Glm5Config.from_hf(hf, tensor_model_parallel_size=2, expert_model_parallel_size=4,
                               sequence_parallel=True).rank_weight_bytes_lower_bounds()
    assert split["vocab_size"] == one["vocab_size"] // 2 and split["intermediate_size"] == one["intermediate_size"] // 2
    experts = "n_routed_experts x moe_intermediate_size"
    assert split[experts] == one[experts] // (4 * 2)  # EP x ETP (ETP defaults to TP)
