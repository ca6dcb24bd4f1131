#!/usr/bin/env python
"""Time one KPool-DSA layer (fwd+bwd, bf16, released widths by default) against sequence length.

    python scripts/bench_dsa.py [--seqs 4096,16384,32768,65536] [--backends fused,torch] [--max-seq torch=16384]
        [--tiny]

Prints ms per fwd+bwd and peak memory for each backend and length; a backend that runs out of memory is reported
as OOM. The indexer runs as in training: frozen, or with ``--indexer-loss sparse|dense`` trained by its loss, whose
share of the layer's time is printed.
"""

from __future__ import annotations

import argparse
import sys



def _time_indexer(indexer, x, psp, cfg, s: int, iters: int, tiles: str = "") -> None:
    """The layer's indexer alone (it has no backward): fused Triton pool scores, the same with the masking and sort
    keys in the kernel (the plan's ``indexer_fuse_topk_keys``; the selections compared), and the PyTorch ops; then
    both fused forms at each scores-kernel tiling of ``tiles`` (``BMxBNxWARPS,...``; a trailing ``b`` adds ``bf16x3``)."""
    import torch

    from bench_train_step import cuda_time
    from megatron_glm5.kernels.indexer_scores import INDEXER_SCORES_CONFIG

    q_resid = torch.randn(s, 1, cfg.q_lora_rank, device=x.device, dtype=x.dtype)
    res, picks = {}, {}
    plan = indexer.plan
    for name, fused, keys in (("fused scores", True, False), ("fused keys", True, True),
                              ("PyTorch scores", False, False)):
        if not fused and s > 16384:
            continue
        indexer.plan = plan.replace(indexer_fused_scores=fused, indexer_fuse_topk_keys=keys)
        picks[name] = indexer(x.detach(), q_resid, packed_seq_params=psp)
        res[name] = cuda_time(lambda: indexer(x.detach(), q_resid, packed_seq_params=psp), iters)
    indexer.plan = plan
    same = torch.equal(picks["fused keys"].sort(-1).values, picks["fused scores"].sort(-1).values)
    print(f"    indexer alone seq={s:6d}: " + " | ".join(f"{n} {t:8.1f} ms" for n, t in res.items())
          + f" (fused keys select the same positions: {same})")
    default = dict(INDEXER_SCORES_CONFIG)
    for tile in filter(None, tiles.split(",")):
        split = tile.endswith("b")                  # a trailing b: bf16x3 products for the bf16 queries
        bm, bn, nw = (int(v) for v in tile.rstrip("b").split("x"))
        INDEXER_SCORES_CONFIG.update(BM=bm, BN=bn, num_warps=nw, bf16x3=split)
        line = []
        for name, keys in (("fused scores", False), ("fused keys", True)):
            indexer.plan = plan.replace(indexer_fuse_topk_keys=keys)
            got = indexer(x.detach(), q_resid, packed_seq_params=psp)
            ok = torch.equal(got.sort(-1).values, picks[name].sort(-1).values)
            line.append(f"{name} {cuda_time(lambda: indexer(x.detach(), q_resid, packed_seq_params=psp), iters):8.1f}"
                        f" ms{'' if ok else ' (OTHER SELECTION)'}")
        print(f"    indexer alone seq={s:6d} tiles {tile:10s}: " + " | ".join(line))
    INDEXER_SCORES_CONFIG.update(default)
    indexer.plan = plan


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", default="4096,16384,32768,65536")
    p.add_argument("--backends", default="fused,torch")
    p.add_argument("--max-seq", default="torch=16384,sparse=16384",
                   help="longest length per backend (the dense reference is quadratic)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="tiny widths (CPU smoke run)")
    p.add_argument("--indexer-loss", choices=("off", "sparse", "dense"), default="off",
                   help="train the indexer by its loss (--dsa-indexer-loss-coeff 1, sparse or dense target) and print "
                        "the loss's share of the layer's fwd+bwd time (the same layer timed with the loss off)")
    p.add_argument("--profile", type=int, default=0, help="at this length also print the GPU kernel table and the "
                   "host-bound gaps (by Python frame) of one fwd+bwd (with the indexer loss when it is on)")
    p.add_argument("--indexer-tiles", default="", help="also time the indexer's scores kernel at these tilings: "
                   "BMxBNxWARPS[b],... (b: bf16x3 products; e.g. 32x64x8,64x64x8b)")
    a = p.parse_args(argv)

    import torch

    from megatron_glm5.config import Glm5Config, glm5_flash_hf_config, tiny_hf_config
    from megatron_glm5.initialize import initialize_megatron
    from megatron_glm5.models.kpool_dsa import Glm5DSAttention, get_dsa_module_spec
    from megatron_glm5.models.packing import make_packed_seq_params

    initialize_megatron()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hf = tiny_hf_config() if a.tiny else glm5_flash_hf_config()
    hf["text_config"]["num_hidden_layers"] = 4
    hf["text_config"]["layer_types"] = ["linear_attention"] * 3 + ["indexed_attention"]
    hf["text_config"]["mlp_layer_types"] = ["dense"] * 4
    hf["text_config"].pop("num_nextn_predict_layers", None)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    max_seq = {k: int(v) for k, v in (item.split("=") for item in filter(None, a.max_seq.split(",")))}
    for backend in a.backends.split(","):
        loss = {} if a.indexer_loss == "off" else dict(dsa_indexer_loss_coeff=1.0,
                                                        dsa_indexer_use_sparse_loss=a.indexer_loss == "sparse")
        cfg = Glm5Config.from_hf(hf, dsa_backend=backend, params_dtype=dtype, use_cpu_initialization=True, **loss)
        spec = get_dsa_module_spec()
        layer = Glm5DSAttention(cfg, spec.submodules, layer_number=4).to(dev)
        for s in [int(x) for x in a.seqs.split(",")]:
            if s > max_seq.get(backend, 1 << 30):
                continue
            x = torch.randn(s, 1, cfg.hidden_size, device=dev, dtype=dtype, requires_grad=True)
            psp = make_packed_seq_params(torch.tensor([0, s], dtype=torch.int32, device=dev))
            try:
                if dev == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                times = _time_layer(layer, x, psp, a.iters, dev)
                peak = torch.cuda.max_memory_allocated() / 2 ** 30 if dev == "cuda" else float("nan")
                print(f"dsa backend={backend:6s} seq={s:6d}: fwd+bwd {min(times):8.1f} ms  peak {peak:6.1f} GiB")
                if a.indexer_loss != "off":
                    cfg.dsa_indexer_loss_coeff = 0.0                       # the same layer, loss off
                    without = min(_time_layer(layer, x, psp, a.iters, dev))
                    cfg.dsa_indexer_loss_coeff = 1.0
                    share = (min(times) - without) / min(times)
                    print(f"    indexer loss ({a.indexer_loss}) share of the layer's fwd+bwd: {100 * share:5.1f} % "
                          f"({min(times):.1f} ms with, {without:.1f} ms without; target <= 15 %)")
                if dev == "cuda" and s == a.profile:
                    _profile_layer(layer, x, psp)
                if dev == "cuda" and getattr(layer, "indexer", None) is not None:
                    _time_indexer(layer.indexer, x, psp, cfg, s, a.iters, a.indexer_tiles)
            except torch.OutOfMemoryError:
                print(f"dsa backend={backend:6s} seq={s:6d}: OOM")
            x.grad = None
            layer.zero_grad(set_to_none=True)
            if dev == "cuda":
                torch.cuda.empty_cache()
    return 0


def _profile_layer(layer, x, psp) -> None:
    """Print the kernel table and the GPU's host-bound gaps (``bench_train_step.kernel_table`` /
    ``gpu_idle_report``) of one fwd+bwd of ``layer``."""
    from bench_train_step import gpu_idle_report, kernel_table, traced_step

    def step():
        out, _ = layer(x, packed_seq_params=psp)
        out.float().square().mean().backward()

    step()
    print(kernel_table(traced_step(step, False), top=30))
    print(gpu_idle_report(traced_step(step, True), top=15))


def _time_layer(layer, x, psp, iters: int, dev: str) -> list:
    """ms of each of ``iters`` fwd+bwd passes of ``layer`` (after one untimed pass)."""
    import time

    import torch

    times = []
    for i in range(iters + 1):
        if dev == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out, _ = layer(x, packed_seq_params=psp)
        out.float().square().mean().backward()
        if dev == "cuda":
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - t0) * 1e3
        if i:
            times.append(ms)
    return times


if __name__ == "__main__":
    sys.exit(main())
