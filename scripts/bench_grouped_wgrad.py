#!/usr/bin/env python
"""Time the routed experts' weight gradient accumulated into fp32 main gradients, two ways, on one GPU:

* ``grouped_mm + add``: ``torch._grouped_mm(dy^T, x, offs)`` (bf16 result) then ``main_grad.add_(it)``, what DDP's
  hook does without gradient-accumulation fusion;
* ``fused``: ``megatron_glm5.kernels.grouped_wgrad`` (fp32 sums added into ``main_grad`` in the kernel), for the
  tilings of ``--sweep``.

    python scripts/bench_grouped_wgrad.py [--tokens 16384] [--experts 8] [--hidden 4096] [--ffn 2048] [--sweep]

Shapes: the fc1 (``N = 2 ffn``, ``K = hidden``) and fc2 (``N = hidden``, ``K = ffn``) weight gradients of one MoE
layer, ``tokens`` routed rows split evenly over the experts (``--skew`` puts half the rows on expert 0). Prints ms,
TFLOP/s of the GEMM (2 T N K) and the largest difference of the fused result from the fp32 one.
"""

from __future__ import annotations

import argparse

import torch

SWEEP = [dict(BLOCK_N=128, BLOCK_K=128, BLOCK_T=32, NUM_WARPS=4, NUM_STAGES=4),  # the kernel's tiles
         dict(BLOCK_N=128, BLOCK_K=128, BLOCK_T=64, NUM_WARPS=8, NUM_STAGES=3),
         dict(BLOCK_N=128, BLOCK_K=128, BLOCK_T=32, NUM_WARPS=4, NUM_STAGES=5),
         dict(BLOCK_N=256, BLOCK_K=128, BLOCK_T=64, NUM_WARPS=8, NUM_STAGES=3),
         dict(BLOCK_N=128, BLOCK_K=128, BLOCK_T=16, NUM_WARPS=4, NUM_STAGES=5),
         dict(BLOCK_N=128, BLOCK_K=256, BLOCK_T=32, NUM_WARPS=8, NUM_STAGES=4)]


def _time(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--skew", action="store_true")
    p.add_argument("--sweep", action="store_true")
    a = p.parse_args()
    from megatron_glm5.kernels import grouped_wgrad as k

    dev = "cuda"
    E, T = a.experts, a.tokens
    counts = torch.full((E,), T // E, dtype=torch.int64)
    if a.skew:
        counts = torch.full((E,), T // (2 * (E - 1)), dtype=torch.int64)
        counts[0] = T - counts[1:].sum()
    counts[-1] += T - counts.sum()
    offs = torch.cumsum(counts, 0).to(torch.int32).to(dev)
    configs = SWEEP if a.sweep else SWEEP[:1]
    for name, n, kk in (("fc1", 2 * a.ffn, a.hidden), ("fc2", a.hidden, a.ffn)):
        x = torch.randn(T, kk, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(T, n, device=dev, dtype=torch.bfloat16)
        main_grad = torch.zeros(E, n, kk, device=dev, dtype=torch.float32)
        flop = 2.0 * T * n * kk

        def unfused():
            main_grad.add_(torch._grouped_mm(dy.t(), x, offs=offs))

        ms = _time(unfused)
        print(f"{name} [E={E}, N={n}, K={kk}, T={T}] grouped_mm + add: {ms:7.3f} ms  "
              f"{flop / ms / 1e9:6.1f} TFLOP/s", flush=True)
        want = torch.zeros_like(main_grad)
        k.grouped_wgrad_accum_reference(x, dy, offs.cpu(), want)
        for cfg in configs:
            for key, val in cfg.items():
                setattr(k, key, val)
            got = torch.zeros_like(main_grad)
            try:
                k._launch(x, dy, offs, got)
            except Exception as e:  # a tiling that does not fit shared memory
                print(f"{name} fused {cfg}: failed: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
                continue
            err = ((got - want).abs().max() / want.abs().max()).item()
            ms = _time(lambda: k._launch(x, dy, offs, main_grad))
            print(f"{name} fused {cfg}: {ms:7.3f} ms  {flop / ms / 1e9:6.1f} TFLOP/s  max rel diff {err:.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
