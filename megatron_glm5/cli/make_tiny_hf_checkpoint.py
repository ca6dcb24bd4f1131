"""Write a tiny random GLM-5.3 checkpoint in the released HF layout, for tests and the CPU quickstart.

    python tools/make_tiny_hf_checkpoint.py --out DIR [--format fp8|bf16|fp32] [--mtp] [--layers N] [--hc-mult N]
        [--no-vision] [--shard-mb MB] [--seed S]

transformers' own ``Glm5NextForConditionalGeneration`` builds and saves the model (so key names, shapes and the
config are exactly what transformers writes and reads), beside a generated tokenizer with GLM's multimodal tokens at
the config's ids, a chat template and the image processor's config (as the release ships them); every parameter is
then given non-trivial random values (mHC base/scale, A_log, router bias, KPool ape/gate and norms are not left at
their constant inits). Options:
  --format fp8   the released layout: block-FP8 e4m3 (128x128 ``weight_scale_inv``) for DSA q_a/q_b/kv_a/o_proj,
                 dense MLPs, routed and shared experts (and the MTP layer's), BF16 elsewhere, fp32 for the fp32
                 islands, with ``quantization_config`` in config.json
  --mtp          adds one MTP layer as ``model.language_model.layers.{L}.*`` (enorm, hnorm, eh_proj,
                 shared_head.norm + a DSA/MoE decoder layer) and sets ``num_nextn_predict_layers: 1``
  --shard-mb     splits the safetensors into shards with ``model.safetensors.index.json``
  --overwrite    replace an existing --out (only once the new checkpoint is complete)
The output is published atomically under a lock (see megatron_glm5.checkpoint.atomic).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

from megatron_glm5.cli.common import OneLineArgumentParser, quiet_library_warnings, run_cli, stderr_line

PROG = "make_tiny_hf_checkpoint"


def randomize_(model, seed: int = 0):
    """Give every parameter of an HF Glm5Next model non-trivial random values (deterministic in ``seed``)."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def rn(t, std, mean=0.0):
        return torch.randn(t.shape, generator=g) * std + mean

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("attn_hc.base", "ffn_hc.base")):
                v = rn(p, 0.5)
            elif name.endswith(("attn_hc.scale", "ffn_hc.scale")):
                v = torch.rand(p.shape, generator=g) + 0.5
            elif name.endswith(("attn_hc.fn", "ffn_hc.fn")):
                v = rn(p, 0.05)
            elif name.endswith("A_log"):
                v = rn(p, 0.5)
            elif name.endswith("dt_bias"):
                v = rn(p, 0.5, -2.0)
            elif "indexer.index_kpool_compress_ape" in name:
                v = rn(p, 1.0)
            elif "indexer.index_kpool_compress_gate" in name:
                v = rn(p, 0.2)
            elif "indexer.wq_b" in name or "indexer.wk" in name:
                v = rn(p, 0.3)
            elif "indexer.weights_proj" in name:
                v = rn(p, 0.3)
            elif "conv1d" in name:
                v = rn(p, 0.3)
            elif p.dim() == 1 or name.endswith("norm.weight"):
                v = rn(p, 0.1, 1.0 if name.endswith("weight") and "bias" not in name else 0.0)
            elif "embed_tokens" in name:
                v = rn(p, 1.0)
            else:
                fan_in = p.shape[-1] if p.dim() == 2 else max(1, p[0].numel())
                v = rn(p, 1.0 / math.sqrt(fan_in))
            p.copy_(v.to(p.dtype))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(rn(b, 0.1))


def _mtp_tensors(sd: dict, text_cfg: dict, seed: int):
    """Random MTP layer keys in the released layout (a DSA + MoE decoder layer plus the MTP heads)."""
    import torch

    g = torch.Generator().manual_seed(seed + 7)
    n = text_cfg["num_hidden_layers"]
    h = text_cfg["hidden_size"]
    lm = "model.language_model.layers."
    # template: the last DSA layer and the last MoE layer of the main model
    dsa = max(i for i, t in enumerate(text_cfg["layer_types"]) if t == "indexed_attention")
    moe = max(i for i, t in enumerate(text_cfg["mlp_layer_types"]) if t == "sparse")
    out = {}
    for k, v in sd.items():
        m = re.match(rf"{re.escape(lm)}(\d+)\.(.+)", k)
        if not m:
            continue
        i, rest = int(m.group(1)), m.group(2)
        take = (rest.startswith("self_attn.") and i == dsa) or (rest.startswith("mlp.") and i == moe) or (
            not rest.startswith(("self_attn.", "mlp.")) and i == dsa)
        if take:
            out[f"{lm}{n}.{rest}"] = v.clone() + (torch.randn(v.shape, generator=g) * 0.01).to(v.dtype)
    out[f"{lm}{n}.enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    out[f"{lm}{n}.hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    out[f"{lm}{n}.eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) / math.sqrt(2 * h)
    out[f"{lm}{n}.shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    return out


def write_checkpoint(out_dir: str, hf_config: dict, fmt: str = "fp32", mtp: bool = False, seed: int = 0,
                     shard_mb: float = 0.0, overwrite: bool = False, log=None) -> str:
    """Build, randomise and save the model; returns ``out_dir``. The directory appears only when complete; an
    existing one is refused unless ``overwrite``."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    from megatron_glm5.checkpoint.atomic import atomic_output_dir, check_output_path
    from megatron_glm5.checkpoint.fp8 import is_fp8_in_release, quantize_fp8_blockwise
    from megatron_glm5.checkpoint.hf_keys import is_fp32_island_hf
    from megatron_glm5.data.tiny_data import MULTIMODAL_TOKENS, write_tiny_hf_assets

    check_output_path(out_dir, overwrite=overwrite)  # refuse before building anything
    kw = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")}
    if "vision_config" not in kw:  # a throw-away minimal tower instead of transformers' default-sized one
        h = hf_config["text_config"]["hidden_size"]
        kw["vision_config"] = dict(depth=1, hidden_size=8, num_heads=1, intermediate_size=8, out_hidden_size=h,
                                   projection_intermediate_size=8)
    cfg = Glm5NextConfig(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(cfg)
    randomize_(model, seed)
    with atomic_output_dir(out_dir, overwrite=overwrite, log=log) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        files = sorted(f for f in os.listdir(tmp) if f.endswith(".safetensors"))
        sd = {}
        for f in files:
            sd.update(load_file(os.path.join(tmp, f)))
            os.remove(os.path.join(tmp, f))
        idx = os.path.join(tmp, "model.safetensors.index.json")
        if os.path.exists(idx):
            os.remove(idx)
        with open(os.path.join(tmp, "config.json")) as fh:
            config_json = json.load(fh)
        text = config_json["text_config"]
        if "vision_config" not in hf_config:
            # transformers always builds a (default-sized) vision tower; a text-only checkpoint carries none
            sd = {k: v for k, v in sd.items() if not k.startswith("model.visual.")}
            config_json.pop("vision_config", None)
        if mtp:
            sd.update(_mtp_tensors(sd, text, seed))
            text["num_nextn_predict_layers"] = 1
        if fmt in ("bf16", "fp8"):
            for k in list(sd):
                sd[k] = sd[k].float() if is_fp32_island_hf(k) else sd[k].to(torch.bfloat16)
            config_json["dtype"] = "bfloat16"
        if fmt == "fp8":
            for k in list(sd):
                if is_fp8_in_release(k, text):
                    q, s = quantize_fp8_blockwise(sd[k].float())
                    sd[k] = q
                    sd[k + "_scale_inv"] = s
            config_json["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                  "weight_block_size": [128, 128]}
        with open(os.path.join(tmp, "config.json"), "w") as fh:
            json.dump(config_json, fh, indent=2)
        _save_sharded(sd, tmp, shard_mb, save_file)
        if all(field in config_json for _, field in MULTIMODAL_TOKENS):
            write_tiny_hf_assets(tmp, config_json)
    return out_dir


def _save_sharded(sd, out_dir, shard_mb, save_file):
    from megatron_glm5.checkpoint.safetensors_io import nbytes

    keys = sorted(sd)
    if not shard_mb:
        save_file({k: sd[k].contiguous() for k in keys}, os.path.join(out_dir, "model.safetensors"),
                  metadata={"format": "pt"})
        return
    limit = shard_mb * 2 ** 20
    shards, cur, size = [], [], 0
    for k in keys:
        n = nbytes(sd[k].shape, sd[k].dtype)
        if cur and size + n > limit:
            shards.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += n
    shards.append(cur)
    weight_map = {}
    for i, ks in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: sd[k].contiguous() for k in ks}, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in ks})
    total = sum(nbytes(sd[k].shape, sd[k].dtype) for k in keys)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)


def parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--format", choices=["fp8", "bf16", "fp32"], default="fp8")
    p.add_argument("--mtp", action="store_true")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hc-mult", type=int, default=3)
    p.add_argument("--no-vision", action="store_true")
    p.add_argument("--shard-mb", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out once the new one is complete")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    bad = ("--layers must be >= 2 (one KDA and one DSA layer)" if a.layers < 2 else
           "--hc-mult must be >= 1 and --shard-mb >= 0" if a.hc_mult < 1 or a.shard_mb < 0 else "")
    if bad:  # before torch is imported
        stderr_line(f"{PROG}: error: {bad}")
        return 2
    quiet_library_warnings()

    def body():
        from megatron_glm5.config import tiny_hf_config

        cfg = tiny_hf_config(num_layers=a.layers, hc_mult=a.hc_mult, with_vision=not a.no_vision)
        write_checkpoint(a.out, cfg, fmt=a.format, mtp=a.mtp, seed=a.seed, shard_mb=a.shard_mb,
                         overwrite=a.overwrite, log=stderr_line)
        print(f"{PROG}: wrote {a.format} checkpoint to {a.out}")

    return run_cli(PROG, body, lean=True)  # transformers' model, none of megatron-core's


if __name__ == "__main__":
    sys.exit(main())
