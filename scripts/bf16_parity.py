#!/usr/bin/env python
"""bf16 GPU parity: our model (FLA KDA + sparse DSA, bf16, one packed row) against transformers' Glm5Next run per
document in fp32 and in bf16. Prints mean / max KL(ref || ours) over tokens, top-1 agreement and max |dlogit|.

    python scripts/bf16_parity.py [--docs 700,900,400] [--hidden 512] [--layers 4] [--out DIR] [--tune-configs 4]
        [--torch-index-scores] [--fp32-variant kda_backend=fla ...]

The checkpoint is a random one written by transformers (tools/make_tiny_hf_checkpoint.write_checkpoint) at the
sizes given; KDA heads use head_dim 128 (the FLA kernel's fast path), index_topk is far below the document
lengths so the indexer really drops positions. ``--tune-configs N`` lets each of FLA's Triton autotuners try at most
N of its configs (``kernels/fla_tuning.py``; 0 = all): tuning every config for these new shapes takes minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time



def parity_config(hidden: int, layers: int) -> dict:
    from megatron_glm5.config import tiny_hf_config

    cfg = tiny_hf_config(num_layers=layers, hc_mult=4, with_vision=False)
    t = cfg["text_config"]
    t.update(hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2, vocab_size=4096,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=hidden // 2, kv_lora_rank=128,
             qk_nope_head_dim=64, v_head_dim=64, index_n_heads=8, index_head_dim=64, index_topk=128, index_kpool=4,
             linear_num_heads=4, linear_head_dim=128, n_routed_experts=16, num_experts_per_tok=4,
             hc_sinkhorn_iters=20,
             layer_types=["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(layers)],
             mlp_layer_types=["dense"] + ["sparse"] * (layers - 1))
    return cfg


def kl_stats(ref_logits, logits):
    import torch

    lp = torch.log_softmax(ref_logits.float(), -1)
    lq = torch.log_softmax(logits.float(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    top1 = (ref_logits.argmax(-1) == logits.argmax(-1)).float().mean().item()
    return kl.mean().item(), kl.max().item(), top1, (ref_logits.float() - logits.float()).abs().max().item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--docs", default="700,900,400")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", default="outputs/bf16_parity")
    p.add_argument("--tune-configs", type=int, default=4,
                   help="at most this many configs per FLA autotuner (0 = all; see the module docstring)")
    p.add_argument("--torch-index-scores", action="store_true",
                   help="also run our fp32 model with the KPool indexer's PyTorch pool scores instead of its kernel")
    p.add_argument("--fp32-variant", action="append", default=[], metavar="FIELD=VALUE",
                   help="also run our fp32 model with this config field set (a string field, e.g. kda_backend=fla)")
    a = p.parse_args(argv)

    import torch
    from megatron_glm5.cli.make_tiny_hf_checkpoint import write_checkpoint
    from transformers import Glm5NextForConditionalGeneration

    from megatron_glm5.models.builder import build_model_from_hf
    from megatron_glm5.kernels.fla_tuning import limit_fla_autotuning
    from megatron_glm5.models.packing import make_packed_seq_params

    print(f"FLA autotuners trimmed to <= {a.tune_configs} configs: {limit_fla_autotuning(a.tune_configs)}")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = "cuda"
    ckpt = write_checkpoint(os.path.join(a.out, "ckpt"), parity_config(a.hidden, a.layers), fmt="fp32", seed=0,
                            overwrite=True)  # the script's own scratch checkpoint
    lens = [int(x) for x in a.docs.split(",")]
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 4000, (n,), generator=g) for n in lens]
    ids = torch.cat(docs)[None].to(dev)
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device=dev)

    results = {}
    refs = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        hf = Glm5NextForConditionalGeneration.from_pretrained(ckpt, dtype=dt, attn_implementation="eager").to(dev).eval()
        with torch.no_grad():
            refs[name] = torch.cat([hf(input_ids=d[None].to(dev)).logits[0].float() for d in docs]).cpu()
        del hf
        torch.cuda.empty_cache()
    runs = [("ours_fp32_fla", torch.float32, True, {}), ("ours_bf16_fla_sparse", torch.bfloat16, True, {})]
    if a.torch_index_scores:
        runs.insert(1, ("ours_fp32_fla_torch_index_scores", torch.float32, False, {}))
    for item in a.fp32_variant:
        key, _, value = item.partition("=")
        runs.insert(1, (f"ours_fp32_{key}={value}", torch.float32, True, {key: value}))
    for name, dt, fused_scores, overrides in runs:
        model = build_model_from_hf(ckpt, dtype=dt, device=dev, **overrides)
        for module in model.modules():
            if type(module).__name__ == "KPoolIndexer":
                module.plan = module.plan.replace(indexer_fused_scores=fused_scores)
        plan = model.config.execution_plan
        print(f"{name}: kda_backend={plan.kda_backend} dsa_backend={plan.dsa_backend}")
        with torch.no_grad():
            model(ids, packed_seq_params=make_packed_seq_params(cu))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(ids, packed_seq_params=make_packed_seq_params(cu))[0].float().cpu()
            torch.cuda.synchronize()
            dt_ms = (time.perf_counter() - t0) * 1e3
        for ref_name, ref in refs.items():
            mean_kl, max_kl, top1, maxd = kl_stats(ref, out)
            results[f"{name} vs hf_{ref_name}"] = dict(mean_kl=mean_kl, max_kl=max_kl, top1=top1, max_abs=maxd)
            print(f"{name} vs transformers {ref_name} (per document): mean KL {mean_kl:.3e}  max KL {max_kl:.3e}  "
                  f"top-1 {top1 * 100:.2f}%  max|dlogit| {maxd:.3e}  (max|logit| {ref.abs().max():.2f})  "
                  f"fwd {dt_ms:.1f} ms")
        del model
    mean_kl, max_kl, top1, maxd = kl_stats(refs["fp32"], refs["bf16"])
    print(f"transformers bf16 vs transformers fp32: mean KL {mean_kl:.3e}  max KL {max_kl:.3e}  top-1 {top1 * 100:.2f}%")
    results["hf_bf16 vs hf_fp32"] = dict(mean_kl=mean_kl, max_kl=max_kl, top1=top1, max_abs=maxd)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bf16_parity.json"), "w") as fh:
        json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
