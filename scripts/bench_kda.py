#!/usr/bin/env python
"""Time one KDA layer (fwd+bwd, bf16, released widths) per backend, against FLA's chunk_kda alone plus the
layer's GEMMs at the measured matmul rate.

    python scripts/bench_kda.py [--seqs 4096,16384] [--backends fla_fused,fla] [--iters 5]

Prints, per length: each backend's layer time and peak memory, ``chunk_kda`` alone (fwd+bwd on inputs of the
layer's shapes, gate and beta computed in-kernel, as the fused layer calls it), the projections' FLOPs (x3 for
fwd+bwd) over the bf16 matmul rate measured at the start, and the ratio layer / (kernel + GEMMs).

``--conv-only`` times only the short convolution + SiLU (fwd+bwd on ``[1, s, H D]`` bf16, fp32 weight): our
Triton kernel (``kernels/short_conv.py``) against FLA's ``causal_conv1d``, with the bytes a single pass moves.
"""

from __future__ import annotations

import argparse
import sys



def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", default="4096,16384")
    p.add_argument("--backends", default="fla_fused,fla")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--conv-only", action="store_true", help="time only the short convolution, ours against FLA's")
    p.add_argument("--conv-tiles", default="", help="with --conv-only, also time these backward tilings of ours: "
                   "ROWSxCHANNELSxWARPS,... (e.g. 64x256x2,128x1024x8)")
    a = p.parse_args(argv)
    if a.conv_only:
        return bench_short_conv([int(x) for x in a.seqs.split(",")], a.iters, a.conv_tiles)

    import torch
    from fla.ops.kda import chunk_kda

    from bench_train_step import cuda_time, matmul_rate
    from megatron_glm5.config import Glm5Config, glm5_flash_hf_config
    from megatron_glm5.initialize import initialize_megatron
    from megatron_glm5.models.kda import KimiDeltaAttention, get_kda_module_spec
    from megatron_glm5.models.packing import make_packed_seq_params

    initialize_megatron()
    dev, dtype = "cuda", torch.bfloat16
    rate = matmul_rate(dev)
    hf = glm5_flash_hf_config()
    print(f"bf16 matmul rate {rate / 1e12:.0f} TFLOP/s", flush=True)
    layers = {}
    for backend in a.backends.split(","):
        cfg = Glm5Config.from_hf(hf, kda_backend=backend, params_dtype=torch.float32, use_cpu_initialization=True)
        layers[backend] = KimiDeltaAttention(cfg, get_kda_module_spec().submodules, layer_number=1).to(dev).to(dtype)
    cfg = next(iter(layers.values())).config
    h, H, D = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim
    lb = cfg.linear_lower_bound
    rows = []
    for s in [int(x) for x in a.seqs.split(",")]:
        psp = make_packed_seq_params(torch.tensor([0, s], dtype=torch.int32, device=dev))
        x = torch.randn(s, 1, h, device=dev, dtype=dtype, requires_grad=True)
        gy = torch.randn(s, 1, h, device=dev, dtype=dtype)
        res = {}
        for backend, layer in layers.items():
            def run():
                out, _ = layer(x, packed_seq_params=psp)
                out.backward(gy)
            torch.cuda.reset_peak_memory_stats()
            res[backend] = (cuda_time(run, a.iters), torch.cuda.max_memory_allocated() / 2 ** 30)
            x.grad = None
            layer.zero_grad(set_to_none=True)
        q, k, v, g = (torch.randn(1, s, H, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(4))
        beta = torch.randn(1, s, H, device=dev, dtype=dtype, requires_grad=True)
        A_log = torch.zeros(H, device=dev, requires_grad=True)
        dt_bias = torch.zeros(H * D, device=dev, requires_grad=True)
        go = torch.randn(1, s, H, D, device=dev, dtype=dtype)
        cu = torch.tensor([0, s], dtype=torch.long)

        def kernel():
            o, _ = chunk_kda(q=q, k=k, v=v, g=g, beta=beta, scale=D ** -0.5, use_qk_l2norm_in_kernel=True,
                             use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=lb,
                             safe_gate=lb is not None, use_beta_sigmoid_in_kernel=True, cu_seqlens=cu.to(dev),
                             cu_seqlens_cpu=cu)
            o.backward(go)
        t_kernel = cuda_time(kernel, a.iters)
        HD = H * D
        gemm_flops = 3 * 2 * s * (4 * h * HD + 2 * h * D + 2 * D * HD + h * H)
        t_gemm = gemm_flops / rate * 1e3
        for backend, (t, peak) in res.items():
            line = (f"s={s:6d} kda backend={backend:9s}: layer fwd+bwd {t:7.1f} ms  peak {peak:5.1f} GiB | chunk_kda "
                    f"alone {t_kernel:6.1f} ms + GEMMs {gemm_flops / 1e12:.2f} TFLOP = {t_gemm:5.1f} ms at the "
                    f"matmul rate -> layer / (kernel + GEMMs) = {t / (t_kernel + t_gemm):.2f}")
            rows.append(line)
            print(line, flush=True)
    return 0


def bench_short_conv(seqs, iters: int, tiles: str = "") -> int:
    """fwd+bwd of silu(short conv) at the released KDA width, ours (its default tilings, then each backward tiling
    of ``tiles``) and FLA's, per length."""
    import torch
    from fla.modules.causal_conv1d import causal_conv1d

    from bench_train_step import cuda_time
    from megatron_glm5.config import glm5_flash_hf_config
    from megatron_glm5.kernels import short_conv
    from megatron_glm5.kernels.short_conv import short_conv_silu
    from megatron_glm5.models.packing import make_packed_seq_params, row_document_starts

    t = glm5_flash_hf_config()["text_config"]
    c, width = t["linear_num_heads"] * t["linear_head_dim"], t.get("linear_conv_kernel_dim", 4)
    for s in seqs:
        x = torch.randn(1, s, c, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(c, width, device="cuda", requires_grad=True)
        dy = torch.randn(1, s, c, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, s], dtype=torch.long)
        cu_dev = cu.cuda()
        starts = row_document_starts(make_packed_seq_params(cu.int()), s, "cuda")
        runs = {
            "ours": lambda: short_conv_silu(x, w, starts),
            "fla": lambda: causal_conv1d(x=x, weight=w, activation="silu", cu_seqlens=cu_dev, cu_seqlens_cpu=cu)[0],
        }
        default = dict(short_conv.SHORT_CONV_CONFIG)
        for tile in filter(None, tiles.split(",")):
            rows, bc, nw = (int(v) for v in tile.split("x"))
            runs[f"ours {tile}"] = ({**default, "bwd": dict(ROWS=rows, BC=bc, num_warps=nw)}, runs["ours"])
        mb = 4 * s * c * 2 / 1e6                  # x and dy read, y and dx written once: the floor of fwd + bwd
        for name, fn in runs.items():
            cfg, fn = fn if isinstance(fn, tuple) else (default, fn)
            short_conv.SHORT_CONV_CONFIG.update(cfg)
            if name.startswith("ours "):                   # another tiling: the same gradients as the default's
                grads = []
                for c_ in (default, cfg):
                    short_conv.SHORT_CONV_CONFIG.update(c_)
                    x.grad = w.grad = None
                    fn().backward(dy)
                    grads.append((x.grad.clone(), w.grad.clone()))
                dx_same = torch.equal(grads[0][0], grads[1][0])
                dw_rel = float((grads[0][1] - grads[1][1]).norm() / grads[0][1].norm())
                if not dx_same or dw_rel > 1e-5:
                    print(f"s={s:6d} short conv {name}: gradients differ from the default tiling's (dx equal "
                          f"{dx_same}, dw {dw_rel:.1e})", flush=True)
            t_fwd = cuda_time(fn, iters)
            t_all = cuda_time(lambda: fn().backward(dy), iters)
            print(f"s={s:6d} short conv {name:14s}: fwd {t_fwd * 1e3:7.1f} us, fwd+bwd {t_all * 1e3:7.1f} us "
                  f"({mb / t_all * 1e-3:.2f} TB/s of the {mb:.0f} MB a single pass moves)", flush=True)
        short_conv.SHORT_CONV_CONFIG.update(default)
    return 0


if __name__ == "__main__":
    sys.exit(main())
