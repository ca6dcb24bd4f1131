#!/usr/bin/env python
"""Time the fused sparse MLA kernel alone (released widths: 64 heads, latent 512, top-k 2048 + 3 tail slots) on
KPool-like selections, for a few tilings; and its parts (forward, backward dq only, backward dkv only).

    python scripts/bench_sparse_mla.py [--seqs 4096,16384] [--heads 64] [--latent 512]
                                       [--sweep | --fwd-sweep 0,3 --bwd-sweep 0,4]

Selections: per query, min(index_topk / kpool, visible pools) random complete pools of its (single) document plus
the always-selected tail (tail slots first, as the DSA layer passes them). Prints ms and the useful TFLOP/s
(4 H R per selected pair forward, 10 H R backward).
"""

from __future__ import annotations

import argparse
import sys


FWD_SWEEP = [dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2),
             dict(BLOCK_H=64, BLOCK_N=16, num_warps=8, num_stages=2),
             dict(BLOCK_H=32, BLOCK_N=32, num_warps=8, num_stages=2),
             # not timed yet: 64 gathered rows a step, a third stage, 4 warps
             dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=1),
             dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=3),
             dict(BLOCK_H=64, BLOCK_N=32, num_warps=4, num_stages=2),
             # 6-9 (not timed yet): 64 rows at 2 stages, 128 rows, 16 warps
             dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2),
             dict(BLOCK_H=64, BLOCK_N=128, num_warps=8, num_stages=1),
             dict(BLOCK_H=64, BLOCK_N=64, num_warps=16, num_stages=1),
             dict(BLOCK_H=64, BLOCK_N=128, num_warps=16, num_stages=1),
             # 10-13 (not timed yet): the next step's rows gathered into registers during this step (prefetch)
             dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2, prefetch=1),
             dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=1, prefetch=1),
             dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2, prefetch=1),
             dict(BLOCK_H=64, BLOCK_N=64, num_warps=16, num_stages=1, prefetch=1)]
BWD_SWEEP = [  # 0-10: the fused kernel's study (entry 0: the default before the transposed-form dkv kernel, fp32's)
             dict(BLOCK_H=32, BLOCK_N=32, num_warps=8, num_stages=1, split=False, vec_red=1),
             dict(BLOCK_H=32, BLOCK_N=32, num_warps=8, num_stages=1, split=False, vec_red=0),
             dict(BLOCK_H=32, BLOCK_N=16, num_warps=8, num_stages=1, split=False, vec_red=1),
             dict(BLOCK_H=32, BLOCK_N=32, num_warps=8, num_stages=1, split=True, vec_red=1),
             dict(BLOCK_H=64, BLOCK_N=16, num_warps=8, num_stages=1, split=False, vec_red=1),
             dict(BLOCK_H=64, BLOCK_N=16, num_warps=16, num_stages=1, split=False, vec_red=1),
             dict(BLOCK_H=64, BLOCK_N=32, num_warps=16, num_stages=1, split=False, vec_red=1),
             # 7: dq at 64 heads per program (wgmma; fits once the dkv products are gone), dkv at 32
             dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=1, split=True, vec_red=1, dkv=dict(BLOCK_H=32)),
             # 8-10: the default with 4 warps, or 2 / 3 stages for the gathered rows
             dict(BLOCK_H=32, BLOCK_N=32, num_warps=4, num_stages=1, split=False, vec_red=1),
             dict(BLOCK_H=32, BLOCK_N=32, num_warps=8, num_stages=2, split=False, vec_red=1),
             dict(BLOCK_H=32, BLOCK_N=32, num_warps=8, num_stages=3, split=False, vec_red=1),
             # 11-12: the default split (dq at 64 heads + transposed-form dkv) with 32 rows per dkv step, 4 programs/SM
             dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=1, split=True, vec_red=1,
                  dkv=dict(form="dkv_t", BLOCK_N=32, programs_per_sm=8)),
             dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=1, split=True, vec_red=1,
                  dkv=dict(form="dkv_t", BLOCK_N=64, programs_per_sm=4)),
             # 13-15 (not timed yet): the default with its dq kernel at 64 rows a step, at 2 stages, at 4 warps
             dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=1, split=True, vec_red=1, dq=dict(BLOCK_N=64),
                  dkv=dict(form="dkv_t", BLOCK_N=64, programs_per_sm=8)),
             dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=1, split=True, vec_red=1, dq=dict(num_stages=2),
                  dkv=dict(form="dkv_t", BLOCK_N=64, programs_per_sm=8)),
             dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=1, split=True, vec_red=1, dq=dict(num_warps=4),
                  dkv=dict(form="dkv_t", BLOCK_N=64, programs_per_sm=8)),
             # 16-18 (not timed yet): dq at 64 rows with 16 warps; dkv at 16 warps; dq at 64 rows and 2 stages
             dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=1, split=True, vec_red=1,
                  dq=dict(BLOCK_N=64, num_warps=16), dkv=dict(form="dkv_t", BLOCK_N=64, programs_per_sm=8)),
             dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=1, split=True, vec_red=1, dq=dict(BLOCK_N=64),
                  dkv=dict(form="dkv_t", BLOCK_N=64, programs_per_sm=8, num_warps=16)),
             dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=1, split=True, vec_red=1,
                  dq=dict(BLOCK_N=64, num_stages=2), dkv=dict(form="dkv_t", BLOCK_N=64, programs_per_sm=8)),
             # 19-21 (not timed yet): the default with the next step's rows prefetched into registers in both
             # passes; in dq alone; in dkv alone at 32 rows a step (fewer registers held across the step)
             dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=1, split=True, vec_red=1, prefetch=1,
                  dq=dict(BLOCK_N=64), dkv=dict(form="dkv_t", BLOCK_N=64, programs_per_sm=8)),
             dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=1, split=True, vec_red=1,
                  dq=dict(BLOCK_N=64, prefetch=1), dkv=dict(form="dkv_t", BLOCK_N=64, programs_per_sm=8)),
             dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=1, split=True, vec_red=1, dq=dict(BLOCK_N=64),
                  dkv=dict(form="dkv_t", BLOCK_N=32, programs_per_sm=8, prefetch=1))]


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def kpool_like_indices(s: int, topk: int, kpool: int, device, seed: int = 0):
    """[1, s, kpool - 1 + topk] int32: tail slots, then the tokens of random visible complete pools."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    n_pools = s // kpool
    sel = topk // kpool
    out = torch.full((s, kpool - 1 + topk), -1, dtype=torch.int32, device=device)
    pos = torch.arange(s, device=device)
    tail_n = (pos + 1) % kpool
    offs = torch.arange(kpool - 1, device=device)
    tail = (pos + 1 - tail_n)[:, None] + offs
    out[:, : kpool - 1] = torch.where(offs[None] < tail_n[:, None], tail, -1).to(torch.int32)
    pool_end = torch.arange(n_pools, device=device) * kpool + kpool - 1
    chunk = max(1, (1 << 26) // max(n_pools, 1))
    for a in range(0, s, chunk):
        e = min(s, a + chunk)
        score = torch.rand(e - a, n_pools, device=device, generator=g)
        vis = pool_end[None] <= pos[a:e, None]
        score = score.masked_fill(~vis, -1.0)
        k = min(sel, n_pools)
        top = score.topk(k, dim=-1)
        ok = top.values >= 0
        toks = top.indices[..., None] * kpool + torch.arange(kpool, device=device)
        toks = toks.masked_fill(~ok[..., None], -1).flatten(1)
        out[a:e, kpool - 1: kpool - 1 + k * kpool] = toks.to(torch.int32)
    return out[None]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", default="4096,16384")
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--latent", type=int, default=512)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--kpool", type=int, default=4)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--bwd-sweep", default=None, help="comma list of BWD_SWEEP entries to time (default: all)")
    p.add_argument("--fwd-sweep", default=None, help="comma list of FWD_SWEEP entries to time")
    a = p.parse_args(argv)

    import torch

    from bench_train_step import cuda_time
    from megatron_glm5.kernels import sparse_mla as sm

    dev = "cuda"
    H, R = a.heads, a.latent
    default_fwd, default_bwd = dict(sm.FWD_CONFIG), dict(sm.BWD_CONFIG)
    fwd_list = FWD_SWEEP if a.sweep else [default_fwd]
    bwd_list = BWD_SWEEP if a.sweep else [default_bwd]
    if a.bwd_sweep or a.fwd_sweep:  # the listed entries after the default, which they are compared with
        fwd_list = [default_fwd] + ([FWD_SWEEP[int(i)] for i in a.fwd_sweep.split(",")] if a.fwd_sweep else [])
        bwd_list = [default_bwd] + ([BWD_SWEEP[int(i)] for i in a.bwd_sweep.split(",")] if a.bwd_sweep else [])
    for s in [int(x) for x in a.seqs.split(",")]:
        idx = kpool_like_indices(s, a.topk, a.kpool, dev)
        f_fwd, f_bwd = sm.sparse_mla_flops(idx, H, R)
        q = (torch.randn(1, s, H, R, device=dev) * 0.5).to(torch.bfloat16).requires_grad_(True)
        kv = torch.randn(1, s, R, device=dev, dtype=torch.bfloat16).requires_grad_(True)
        go = torch.randn(1, s, H, R, device=dev, dtype=torch.bfloat16)
        prep = sm.prepare_indices(idx, s)
        print(f"s={s}: {float((idx >= 0).sum()) / s:.0f} selected per query; fwd {f_fwd / 1e12:.2f} TFLOP, "
              f"bwd {f_bwd / 1e12:.2f} TFLOP", flush=True)
        with torch.no_grad():
            ref_o = sm.sparse_mla(q, kv, idx, 0.06, prepared=prep)            # the default tiling, for agreement
        for cfg in fwd_list:
            sm.FWD_CONFIG.clear()
            sm.FWD_CONFIG.update(cfg)
            try:
                with torch.no_grad():
                    err = _rel(sm.sparse_mla(q, kv, idx, 0.06, prepared=prep), ref_o)
                    t = cuda_time(lambda: sm.sparse_mla(q, kv, idx, 0.06, prepared=prep))
                print(f"  fwd {cfg}: {t:7.2f} ms  {f_fwd / t / 1e9:6.0f} TFLOP/s  (rel. diff to default: {err:.1e})",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  fwd {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        sm.FWD_CONFIG.clear()
        sm.FWD_CONFIG.update(default_fwd)
        with torch.no_grad():
            o, lse = sm._sparse_mla_fwd(q.view(s, H, R), kv.view(s, R), prep[0], prep[1], 0.06)

        def bwd(passes=None):
            return sm._sparse_mla_bwd(go.view(s, H, R), q.view(s, H, R), kv.view(s, R), o, lse, prep[0], prep[1],
                                      0.06, passes=passes)

        with torch.no_grad():
            ref_dq, ref_dkv = bwd()                                     # the default tiling, for agreement
        for cfg in bwd_list:
            sm.BWD_CONFIG.clear()
            sm.BWD_CONFIG.update(cfg)
            try:
                with torch.no_grad():
                    dq, dkv = bwd()
                err = f"dq {_rel(dq, ref_dq):.1e}, dkv {_rel(dkv, ref_dkv):.1e}"
                t = cuda_time(bwd)
                line = f"  bwd {cfg}: {t:7.2f} ms  {f_bwd / t / 1e9:6.0f} TFLOP/s  (rel. diff to default: {err})"
                if cfg.get("split"):
                    t_dq = cuda_time(lambda: bwd([(True, False)]))
                    t_dkv = cuda_time(lambda: bwd([(False, True)]))
                    line += f"; dq kernel {t_dq:.2f} ms, dkv kernel {t_dkv:.2f} ms"
                print(line, flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  bwd {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        sm.BWD_CONFIG.clear()
        sm.BWD_CONFIG.update(default_bwd)
        for name, passes in (("dq only", [(True, False)]), ("dkv only", [(False, True)])):
            t = cuda_time(lambda: bwd(passes))
            print(f"  default bwd, {name}: {t:7.2f} ms", flush=True)
        t = cuda_time(lambda: sm.sparse_mla(q, kv, idx, 0.06, prepared=prep).backward(go))
        print(f"  default fwd+bwd (autograd): {t:7.2f} ms", flush=True)
        del q, kv, go, idx, prep, o, lse, ref_o
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
