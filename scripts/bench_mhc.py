#!/usr/bin/env python
"""Time one mHC site (HyperConnection + apply_hyper_connection_output, fwd + bwd, bf16, released widths): the fused
Triton kernels against the PyTorch ops, and each fused kernel alone against the bytes it must move.

    python scripts/bench_mhc.py [--seqs 4096,16384] [--iters 10]

A decoder layer has two such sites. The block between them is left out (``y`` is an input), so the numbers are the
mHC arithmetic alone. Printed per length: the site's fwd+bwd time and peak extra memory for both paths; then each
fused forward kernel's time and achieved bandwidth (bytes: each input read once, each output written once).
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", default="4096,16384")
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args(argv)

    import torch

    from bench_train_step import cuda_time
    from megatron_glm5.config import Glm5Config, glm5_flash_hf_config
    from megatron_glm5.kernels import mhc as K
    from megatron_glm5.models.mhc import HyperConnection, apply_hyper_connection_output

    dev, dtype = "cuda", torch.bfloat16
    cfg = Glm5Config.from_hf(glm5_flash_hf_config(), params_dtype=torch.float32, use_cpu_initialization=True)
    hc = HyperConnection(cfg, layer_number=1).to(dev)
    hc.fn.data = hc.fn.data.to(dtype)
    n, h = cfg.hc_mult, cfg.hidden_size
    for s in [int(x) for x in a.seqs.split(",")]:
        streams = torch.randn(s, 1, n, h, device=dev, dtype=dtype)
        y = torch.randn(s, 1, h, device=dev, dtype=dtype)
        g_new = torch.randn(s, 1, n, h, device=dev, dtype=dtype)
        g_col = torch.randn(s, 1, h, device=dev, dtype=dtype)
        res = {}
        plan = hc.plan
        for fused in (True, False):
            hc.plan = plan.replace(mhc_fused=fused)

            def site():
                st = streams.detach().requires_grad_(True)
                yy = y.detach().requires_grad_(True)
                post, comb, col = hc(st)
                new = apply_hyper_connection_output(yy, st, post, comb, fused=fused)
                torch.autograd.backward([new, col], [g_new, g_col])

            site()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t = cuda_time(site, a.iters)
            res[fused] = (t, (torch.cuda.max_memory_allocated() - base) / 2 ** 30)
        hc.plan = plan
        print(f"s={s:6d} mHC site fwd+bwd (n={n}, h={h}): fused {res[True][0]:7.3f} ms / {res[True][1]:5.2f} GiB | "
              f"torch {res[False][0]:7.3f} ms / {res[False][1]:5.2f} GiB | x{res[False][0] / res[True][0]:.1f}",
              flush=True)
        sb = streams.numel() * streams.element_size()
        yb = y.numel() * y.element_size()
        flat = streams.view(s, n, h)
        post = torch.rand(s, n, device=dev)
        comb = torch.rand(s, n, n, device=dev)
        kernels = {
            "proj fwd (norm + x @ fn^T)": (lambda: K._proj_fwd(flat.view(s, n * h), hc.fn, 1e-5), sb),
            "apply fwd (post*y + comb^T@s)": (lambda: K.apply_output(y.view(s, h), flat, post, comb), 2 * sb + yb),
        }
        yg = y.view(s, h).detach().requires_grad_(True)
        sg = flat.detach().requires_grad_(True)
        pg = post.detach().requires_grad_(True)
        cg = comb.detach().requires_grad_(True)
        kernels["apply fwd+bwd"] = (lambda: K.apply_output(yg, sg, pg, cg).backward(g_new.view(s, n, h)),
                                    5 * sb + 3 * yb)
        for name, (fn, nbytes) in kernels.items():
            t = cuda_time(fn, a.iters)
            print(f"s={s:6d}   {name:32s} {t:7.3f} ms  {nbytes / t / 1e6:6.0f} GB/s", flush=True)
        x2 = flat.view(s, n * h)
        dz = torch.randn(s, K._np2((2 + n) * n, 16), device=dev)
        c = torch.randn(s, device=dev)
        pre = torch.rand(s, n, device=dev)
        dcol = g_col.view(s, h)
        proj_bwd = (lambda: K._proj_bwd(x2, hc.fn, dz, c, pre, dcol, n, h), 2 * sb + yb)
        sweeps = (  # (module knob, values, what it is, the timed function and its bytes)
            ("APPLY_BWD_ROWS", (32, 64, 128), "apply fwd+bwd, bwd stream rows per program", kernels["apply fwd+bwd"]),
            ("APPLY_BWD_COLUMNS", (32, 64, 128), "apply fwd+bwd, bwd columns per step", kernels["apply fwd+bwd"]),
            ("APPLY_BWD_WARPS", (4, 8), "apply fwd+bwd, bwd warps", kernels["apply fwd+bwd"]),
            ("APPLY_BWD_PROGRAMS_PER_SM", (2, 4, 8), "apply fwd+bwd, bwd programs per SM", kernels["apply fwd+bwd"]),
            ("PROJ_FWD_PROGRAMS_PER_SM", (2, 4, 8), "proj fwd, programs per SM", kernels["proj fwd (norm + x @ fn^T)"]),
            ("PROJ_BWD_TOKENS", (16, 32, 64), "proj bwd, tokens per step", proj_bwd),
            ("PROJ_BWD_WARPS", (4, 8), "proj bwd, warps", proj_bwd),
            ("PROJ_BWD_PROGRAMS_PER_SM", (4, 8, 16), "proj bwd, programs per SM", proj_bwd),
        )
        for knob, values, what, (fn, nbytes) in sweeps:
            default = getattr(K, knob)
            for value in values:
                setattr(K, knob, value)
                t = cuda_time(fn, a.iters)
                print(f"s={s:6d}   {what} {value:5d}  {t:7.3f} ms  {nbytes / t / 1e6:6.0f} GB/s", flush=True)
            setattr(K, knob, default)
    return 0


if __name__ == "__main__":
    sys.exit(main())
