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
    mtp.layers.{k}.mtp_model_layer.<layer>      <-> LM layers.{L+k}.<layer, mapped as a decoder layer>
"""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

LM = "model.language_model."

# One table for both directions: (megatron template, HF template(s), {placeholder: regex}). Two HF templates mean
# the megatron tensor is [first; second] concatenated along dim 0. Rules are tried in order (first match wins), in
# both directions; the inverse (HF -> megatron) is compiled from the same rows, never written separately.
_LAYER_TABLE = [
    ("attn_hc.{x}", ["hc_attn_{x}"], {"x": "fn|base|scale"}),
    ("ffn_hc.{x}", ["hc_ffn_{x}"], {"x": "fn|base|scale"}),
    ("input_layernorm.weight", ["input_layernorm.weight"], {}),
    ("pre_mlp_layernorm.weight", ["post_attention_layernorm.weight"], {}),
    ("self_attention.{conv}", ["self_attn.{conv}.weight"], {"conv": "[qkv]_conv1d"}),  # KDA conv: bare [C, 1, W]
    ("self_attention.{rest}", ["self_attn.{rest}"], {"rest": ".+"}),
    ("mlp.linear_fc1.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], {}),
    ("mlp.linear_fc2.weight", ["mlp.down_proj.weight"], {}),
    ("mlp.router.weight", ["mlp.gate.weight"], {}),
    ("mlp.router.expert_bias", ["mlp.gate.e_score_correction_bias"], {}),
    ("mlp.experts.local_experts.{e}.linear_fc1.weight",
     ["mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"], {"e": r"\d+"}),
    ("mlp.experts.local_experts.{e}.linear_fc2.weight", ["mlp.experts.{e}.down_proj.weight"], {"e": r"\d+"}),
    ("mlp.shared_experts.linear_fc1.weight", ["mlp.shared_experts.gate_proj.weight",
                                               "mlp.shared_experts.up_proj.weight"], {}),
    ("mlp.shared_experts.linear_fc2.weight", ["mlp.shared_experts.down_proj.weight"], {}),
]
_MTP_TABLE = [  # the MTP layer's own modules (its transformer layer maps like a decoder layer)
    ("{n}.weight", ["{n}.weight"], {"n": "enorm|hnorm|eh_proj"}),
    ("final_layernorm.weight", ["shared_head.norm.weight"], {}),
]
_FIXED = {
    "embedding.word_embeddings.weight": LM + "embed_tokens.weight",
    "final_layernorm.weight": LM + "norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def _regex(template: str, groups: dict) -> "re.Pattern":
    r"""``"mlp.experts.{e}.x"`` + ``{"e": r"\d+"}`` -> ``mlp\.experts\.(?P<e>\d+)\.x`` (literal parts escaped)."""
    out, pos = [], 0
    for m in re.finditer(r"\{(\w+)\}", template):
        out.append(re.escape(template[pos:m.start()]))
        out.append(f"(?P<{m.group(1)}>{groups[m.group(1)]})")
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("".join(out))


def _compile(table):
    """(forward rules [(megatron regex, HF templates)], inverse rules [(HF regex, megatron template, part, parts)])."""
    fwd = [(_regex(mc, g), hf) for mc, hf, g in table]
    inv = [(_regex(h, g), mc, j, len(hf)) for mc, hf, g in table for j, h in enumerate(hf)]
    return fwd, inv


_LAYER_FWD, _LAYER_INV = _compile(_LAYER_TABLE)
_MTP_FWD, _MTP_INV = _compile(_MTP_TABLE)
_FIXED_INV = {v: k for k, v in _FIXED.items()}

# megatron-side state that has no HF counterpart (runtime statistics, not weights)
NON_PERSISTENT_MCORE = (re.compile(r".*mlp\.router\.local_tokens_per_expert$"), re.compile(r".*\._extra_state$"))
# HF keys that belong to the MTP layer but are shared with the main model (DeepSeek-style duplicates)
MTP_SHARED_HF = re.compile(r"^model\.language_model\.layers\.\d+\.(shared_head\.head\.weight|embed_tokens\.weight)$")


def _forward(rules, rest: str) -> Optional[List[str]]:
    for pat, tmpl in rules:
        m = pat.fullmatch(rest)
        if m:
            return [t.format(**m.groupdict()) for t in tmpl]
    return None


def _inverse(rules, rest: str) -> Optional[Tuple[str, int, int]]:
    for pat, tmpl, part, parts in rules:
        m = pat.fullmatch(rest)
        if m:
            return tmpl.format(**m.groupdict()), part, parts
    return None


def mcore_to_hf(name: str, num_layers: int) -> List[str]:
    """Canonical megatron name -> HF key(s). Two keys mean [gate; up] concatenated along dim 0."""
    if name in _FIXED:
        return [_FIXED[name]]
    if name.startswith("vision_model."):
        return ["model.visual." + name[len("vision_model."):]]
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if m:
        hf = _forward(_LAYER_FWD, m.group(2))
        if hf is not None:
            return [f"{LM}layers.{m.group(1)}.{h}" for h in hf]
    m = re.fullmatch(r"mtp\.layers\.(\d+)\.(.+)", name)
    if m:
        rest = m.group(2)
        if rest.startswith("mtp_model_layer."):
            hf = _forward(_LAYER_FWD, rest[len("mtp_model_layer."):])
        else:
            hf = _forward(_MTP_FWD, rest)
        if hf is not None:
            return [f"{LM}layers.{num_layers + int(m.group(1))}.{h}" for h in hf]
    raise KeyError(f"no HF key for megatron parameter {name!r}")


def hf_to_mcore(hf_name: str, num_layers: int, mtp_layers: int = 0) -> Optional[Tuple[str, int, int]]:
    """HF key -> (canonical megatron name, part index, number of parts) or None for keys the model does not use
    (MTP weights when the config has no MTP layer, MTP duplicates of shared weights, FP8 scales). The inverse of
    :func:`mcore_to_hf`, compiled from the same table."""
    if hf_name.endswith("weight_scale_inv") or MTP_SHARED_HF.match(hf_name):
        return None
    found = None
    if hf_name in _FIXED_INV:
        found = (_FIXED_INV[hf_name], 0, 1)
    elif hf_name.startswith("model.visual."):
        found = ("vision_model." + hf_name[len("model.visual."):], 0, 1)
    else:
        m = re.fullmatch(r"model\.language_model\.layers\.(\d+)\.(.+)", hf_name)
        if m:
            i, rest = int(m.group(1)), m.group(2)
            if i < num_layers:
                inv = _inverse(_LAYER_INV, rest)
                found = inv and (f"decoder.layers.{i}.{inv[0]}", inv[1], inv[2])
            elif i - num_layers >= mtp_layers:
                return None
            else:
                k = i - num_layers
                inv = _inverse(_MTP_INV, rest)
                if inv is not None:
                    found = (f"mtp.layers.{k}.{inv[0]}", inv[1], inv[2])
                else:
                    inv = _inverse(_LAYER_INV, rest)
                    found = inv and (f"mtp.layers.{k}.mtp_model_layer.{inv[0]}", inv[1], inv[2])
    if not found:
        raise KeyError(f"no megatron parameter for HF key {hf_name!r}")
    return found


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
        m = re.match(r"mtp\.layers\.(\d+)\.mtp_model_layer\.", local_name)
        if m and hasattr(model, "mtp"):
            layer = model.mtp.layers[int(m.group(1))].mtp_model_layer
    mm = re.match(r"(.*mlp\.experts\.local_experts\.)(\d+)(\..*)", local_name)
    if mm and layer is not None:
        gexp = layer.mlp.local_expert_indices[int(mm.group(2))]
        local_name = f"{mm.group(1)}{gexp}{mm.group(3)}"
    return local_name
