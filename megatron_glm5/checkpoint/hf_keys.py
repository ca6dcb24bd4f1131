"""The one key table between HF GLM-5.3 checkpoint names and megatron_glm5 module names.

Canonical megatron names use *global* layer and expert indices (``decoder.layers.{i}`` with i the 0-based global
decoder layer, ``local_experts.{e}`` with e the global expert id); :func:`canonical_name` turns the local names of
a model built for a PP/VPP stage or an EP rank into them. The single-process loader, the converters and the
exporter all go through :func:`mcore_to_hf` / :func:`hf_to_mcore`; none keeps its own copy.

Mapping rules (HF prefix ``model.language_model.`` = LM):
    embedding.word_embeddings.weight            <-> LM embed_tokens.weight
    final_layernorm.weight                      <-> LM norm.weight
    output_layer.weight                         <-> lm_head.weight
    vision_model.<rest>                         <-> model.visual.<rest>
    decoder.layers.{i}.attn_hc.{fn,base,scale}  <-> LM layers.{i}.hc_attn_{fn,base,scale}   (ffn_hc -> hc_ffn_*)
    decoder.layers.{i}.input_layernorm.weight   <-> LM layers.{i}.input_layernorm.weight
    decoder.layers.{i}.pre_mlp_layernorm.weight <-> LM layers.{i}.post_attention_layernorm.weight
    decoder.layers.{i}.self_attention.<rest>    <-> LM layers.{i}.self_attn.<rest>           (KDA and DSA)
    decoder.layers.{i}.self_attention.q_conv1d  <-> LM layers.{i}.self_attn.q_conv1d.weight   (k, v alike)
    decoder.layers.{i}.mlp.linear_fc1.weight    <-> [LM layers.{i}.mlp.gate_proj.weight; ...up_proj.weight] (dim 0)
    decoder.layers.{i}.mlp.linear_fc2.weight    <-> LM layers.{i}.mlp.down_proj.weight
    ...mlp.router.weight / router.expert_bias   <-> ...mlp.gate.weight / gate.e_score_correction_bias
    ...mlp.experts.local_experts.{e}.linear_fc{1,2}.weight <-> ...mlp.experts.{e}.{gate+up, down}_proj.weight
    ...mlp.shared_experts.linear_fc{1,2}.weight <-> ...mlp.shared_experts.{gate+up, down}_proj.weight
    mtp.layers.{k}.{enorm,hnorm,eh_proj}.weight <-> LM layers.{L+k}.{enorm,hnorm,eh_proj}.weight  (L = num_layers)
    mtp.layers.{k}.final_layernorm.weight       <-> LM layers.{L+k}.shared_head.norm.weight
    mtp.layers.{k}.transformer_layer.<layer>    <-> LM layers.{L+k}.<layer, mapped as a decoder layer>
"""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

LM = "model.language_model."

_LAYER_RULES = [
    # (megatron suffix regex, HF suffix template(s)); templates may use \1.. groups
    (r"attn_hc\.(fn|base|scale)", ["hc_attn_{0}"]),
    (r"ffn_hc\.(fn|base|scale)", ["hc_ffn_{0}"]),
    (r"input_layernorm\.weight", ["input_layernorm.weight"]),
    (r"pre_mlp_layernorm\.weight", ["post_attention_layernorm.weight"]),
    (r"self_attention\.([qkv]_conv1d)", ["self_attn.{0}.weight"]),  # KDA conv: bare parameter [C, 1, W]
    (r"self_attention\.(.+)", ["self_attn.{0}"]),
    (r"mlp\.linear_fc1\.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"]),
    (r"mlp\.linear_fc2\.weight", ["mlp.down_proj.weight"]),
    (r"mlp\.router\.weight", ["mlp.gate.weight"]),
    (r"mlp\.router\.expert_bias", ["mlp.gate.e_score_correction_bias"]),
    (r"mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.weight",
     ["mlp.experts.{0}.gate_proj.weight", "mlp.experts.{0}.up_proj.weight"]),
    (r"mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.weight", ["mlp.experts.{0}.down_proj.weight"]),
    (r"mlp\.shared_experts\.linear_fc1\.weight", ["mlp.shared_experts.gate_proj.weight",
                                                  "mlp.shared_experts.up_proj.weight"]),
    (r"mlp\.shared_experts\.linear_fc2\.weight", ["mlp.shared_experts.down_proj.weight"]),
]

_MTP_RULES = [
    (r"(enorm|hnorm|eh_proj)\.weight", ["{0}.weight"]),
    (r"final_layernorm\.weight", ["shared_head.norm.weight"]),
]

# megatron-side state that has no HF counterpart (runtime statistics, not weights)
NON_PERSISTENT_MCORE = (re.compile(r".*mlp\.router\.local_tokens_per_expert$"), re.compile(r".*\._extra_state$"))
# HF keys that belong to the MTP layer but are shared with the main model (DeepSeek-style duplicates)
MTP_SHARED_HF = re.compile(r"^model\.language_model\.layers\.\d+\.(shared_head\.head\.weight|embed_tokens\.weight)$")


def _map_layer(rest: str) -> Optional[List[str]]:
    for pat, tmpl in _LAYER_RULES:
        m = re.fullmatch(pat, rest)
        if m:
            return [t.format(*m.groups()) for t in tmpl]
    return None


def mcore_to_hf(name: str, num_layers: int) -> List[str]:
    """Canonical megatron name -> HF key(s). Two keys mean [gate; up] concatenated along dim 0."""
    fixed = {
        "embedding.word_embeddings.weight": [LM + "embed_tokens.weight"],
        "final_layernorm.weight": [LM + "norm.weight"],
        "output_layer.weight": ["lm_head.weight"],
    }
    if name in fixed:
        return fixed[name]
    if name.startswith("vision_model."):
        return ["model.visual." + name[len("vision_model."):]]
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if m:
        hf = _map_layer(m.group(2))
        if hf is not None:
            return [f"{LM}layers.{m.group(1)}.{h}" for h in hf]
    m = re.fullmatch(r"mtp\.layers\.(\d+)\.(.+)", name)
    if m:
        idx = num_layers + int(m.group(1))
        rest = m.group(2)
        if rest.startswith("transformer_layer."):
            hf = _map_layer(rest[len("transformer_layer."):])
        else:
            hf = None
            for pat, tmpl in _MTP_RULES:
                mm = re.fullmatch(pat, rest)
                if mm:
                    hf = [t.format(*mm.groups()) for t in tmpl]
        if hf is not None:
            return [f"{LM}layers.{idx}.{h}" for h in hf]
    raise KeyError(f"no HF key for megatron parameter {name!r}")


def hf_to_mcore(hf_name: str, num_layers: int, mtp_layers: int = 0) -> Optional[Tuple[str, int, int]]:
    """HF key -> (canonical megatron name, part index, number of parts) or None for keys the model does not use
    (MTP weights when the config has no MTP layer, MTP duplicates of shared weights, FP8 scales)."""
    if hf_name.endswith("weight_scale_inv") or MTP_SHARED_HF.match(hf_name):
        return None
    m = re.fullmatch(r"model\.language_model\.layers\.(\d+)\.(.+)", hf_name)
    if m and int(m.group(1)) >= num_layers:
        k = int(m.group(1)) - num_layers
        if k >= mtp_layers:
            return None
    for cand in _candidate_mcore_names(hf_name, num_layers):
        hf = mcore_to_hf(cand, num_layers)
        if hf_name in hf:
            return cand, hf.index(hf_name), len(hf)
    raise KeyError(f"no megatron parameter for HF key {hf_name!r}")


def _candidate_mcore_names(hf_name: str, num_layers: int) -> List[str]:
    simple = {LM + "embed_tokens.weight": "embedding.word_embeddings.weight", LM + "norm.weight": "final_layernorm.weight",
              "lm_head.weight": "output_layer.weight"}
    if hf_name in simple:
        return [simple[hf_name]]
    if hf_name.startswith("model.visual."):
        return ["vision_model." + hf_name[len("model.visual."):]]
    m = re.fullmatch(r"model\.language_model\.layers\.(\d+)\.(.+)", hf_name)
    if not m:
        return []
    i, rest = int(m.group(1)), m.group(2)
    inverse = [
        (r"hc_attn_(fn|base|scale)", "attn_hc.{0}"), (r"hc_ffn_(fn|base|scale)", "ffn_hc.{0}"),
        (r"input_layernorm\.weight", "input_layernorm.weight"),
        (r"post_attention_layernorm\.weight", "pre_mlp_layernorm.weight"),
        (r"self_attn\.([qkv]_conv1d)\.weight", "self_attention.{0}"),
        (r"self_attn\.(.+)", "self_attention.{0}"),
        (r"mlp\.(?:gate|up)_proj\.weight", "mlp.linear_fc1.weight"), (r"mlp\.down_proj\.weight", "mlp.linear_fc2.weight"),
        (r"mlp\.gate\.weight", "mlp.router.weight"), (r"mlp\.gate\.e_score_correction_bias", "mlp.router.expert_bias"),
        (r"mlp\.experts\.(\d+)\.(?:gate|up)_proj\.weight", "mlp.experts.local_experts.{0}.linear_fc1.weight"),
        (r"mlp\.experts\.(\d+)\.down_proj\.weight", "mlp.experts.local_experts.{0}.linear_fc2.weight"),
        (r"mlp\.shared_experts\.(?:gate|up)_proj\.weight", "mlp.shared_experts.linear_fc1.weight"),
        (r"mlp\.shared_experts\.down_proj\.weight", "mlp.shared_experts.linear_fc2.weight"),
    ]
    layer_rest = None
    for pat, tmpl in inverse:
        mm = re.fullmatch(pat, rest)
        if mm:
            layer_rest = tmpl.format(*mm.groups())
            break
    if i < num_layers:
        return [f"decoder.layers.{i}.{layer_rest}"] if layer_rest else []
    k = i - num_layers
    out = []
    if layer_rest:
        out.append(f"mtp.layers.{k}.transformer_layer.{layer_rest}")
    mm = re.fullmatch(r"(enorm|hnorm|eh_proj)\.weight", rest)
    if mm:
        out.append(f"mtp.layers.{k}.{mm.group(1)}.weight")
    if rest == "shared_head.norm.weight":
        out.append(f"mtp.layers.{k}.final_layernorm.weight")
    return out


# HF keys the reference keeps in fp32 in every checkpoint it writes (transformers' _keep_in_fp32_modules_strict)
HF_FP32_KEYS = re.compile(r"(hc_(attn|ffn)_(base|scale)|self_attn\.(A_log|dt_bias|[qkv]_conv1d\.weight)|"
                          r"e_score_correction_bias)$")


def is_fp32_island_hf(hf_name: str) -> bool:
    """Whether an HF checkpoint stores ``hf_name`` in fp32 even in a bf16 / FP8 checkpoint."""
    return bool(HF_FP32_KEYS.search(hf_name))


def is_non_persistent(name: str) -> bool:
    return any(p.match(name) for p in NON_PERSISTENT_MCORE)


def canonical_name(local_name: str, model) -> str:
    """Local state-dict name of ``model`` (one PP/VPP stage, one EP rank) -> canonical global name: decoder layers
    by global index, routed experts (decoder and MTP layers) by global expert id."""
    layer = None
    m = re.match(r"(.*?)decoder\.layers\.(\d+)\.(.*)", local_name)
    if m:
        layer = model.decoder.layers[int(m.group(2))] if hasattr(model, "decoder") else None
        gidx = layer.layer_number - 1 if layer is not None else int(m.group(2))
        local_name = f"{m.group(1)}decoder.layers.{gidx}.{m.group(3)}"
    else:
        m = re.match(r"mtp\.layers\.(\d+)\.transformer_layer\.", local_name)
        if m and hasattr(model, "mtp"):
            layer = model.mtp.layers[int(m.group(1))].transformer_layer
    mm = re.match(r"(.*mlp\.experts\.local_experts\.)(\d+)(\..*)", local_name)
    if mm and layer is not None:
        gexp = layer.mlp.local_expert_indices[int(mm.group(2))]
        local_name = f"{mm.group(1)}{gexp}{mm.group(3)}"
    return local_name
