#!/usr/bin/env python
"""Throughput and peak memory of tools/convert_hf_to_mcore.py on a synthetic multi-GB FP8 checkpoint.

    python scripts/bench_convert.py [--size-gb 2.2] [--layers 8] [--hidden 1024] [--moe-intermediate 512]
        [--shard-mb 256] [--workers 1] [--threads 2] [--dtype bf16] [--dir DIR] [--keep] [--reuse]

1. Writes a random GLM-5.3 checkpoint in the released layout (block-FP8 e4m3 + ``weight_scale_inv`` for DSA
   projections, dense MLPs and experts, fp32 islands, BF16 elsewhere; sharded safetensors + index) for a text-only
   config with hidden ``--hidden`` (1024) and routed experts of ``--moe-intermediate`` (512) rows, ``--layers``
   layers and as many routed experts as it takes to reach ``--size-gb`` (at least 8). The defaults make many small
   tensors (0.5 MB of FP8 per expert matrix); GLM-5.3-Flash's are 8 MB (``--hidden 4096
   --moe-intermediate 2048``), which costs less Python per byte.
   Shards are generated in parallel threads, each streamed to disk tensor by tensor; FP8 weights are random e4m3
   codes (NaN codes excluded) with random positive block scales. Key names and shapes come from the shared key
   table (``hf_keys.mcore_to_hf`` over the meta-built model), the same table every loader uses.
2. Runs the converter CLI in a child process, sampling the resident memory of its whole process tree, and prints
   e.g. ``convert: 2.4 GB in 31 s = 79 MB/s ...`` (wall time of the whole command, start-up included, its CPU time
   and peak RSS)
   and the converter's own figures: the whole conversion (validation, planning, writing, publishing) and its
   write phase alone (first tensor read to the last file synced), each as MB/s of FP8 input and GB/s of output
   (torch_dist bytes written: twice the FP8 bytes for bf16). An output of an earlier run in ``--dir`` is removed
   before the converter starts (not inside its timer).

``--dir`` is a scratch folder the bench creates (a fresh temporary one by default); an existing folder is used only
if an earlier run of the bench made it (``--reuse`` then keeps its synthetic checkpoint, ``--keep`` keeps it all).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench_hf_config(n_experts: int, num_layers: int = 8, hidden: int = 1024, moe_intermediate: int = 512) -> dict:
    from megatron_glm5.config import tiny_hf_config

    cfg = tiny_hf_config(num_layers=num_layers, hc_mult=4, with_vision=False)
    cfg["text_config"].update(
        vocab_size=32768, hidden_size=hidden, intermediate_size=2816, moe_intermediate_size=moe_intermediate,
        n_routed_experts=n_experts, num_experts_per_tok=8, num_attention_heads=16, num_key_value_heads=16,
        qk_nope_head_dim=64, v_head_dim=64, q_lora_rank=384, kv_lora_rank=256, linear_num_heads=16,
        linear_head_dim=64, index_n_heads=8, index_head_dim=64, index_topk=64, index_kpool=4)
    cfg["dtype"] = "bfloat16"
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    return cfg


def hf_tensor_specs(hf_cfg: dict):
    """[(hf key, shape)] of the checkpoint the model of ``hf_cfg`` expects (meta build, no memory)."""
    import torch

    from megatron_glm5.checkpoint.lazy_sources import model_sources
    from megatron_glm5.models.builder import build_meta_model

    model = build_meta_model(hf_cfg, torch.bfloat16)
    specs = []
    for s in model_sources(model, torch.bfloat16).values():
        n = len(s.hf_keys)
        part = s.shape if n == 1 else (s.shape[0] // n, *s.shape[1:])
        specs.extend((k, tuple(part)) for k in s.hf_keys)
    return sorted(specs)


def _stored_bytes(key, shape, text):
    from megatron_glm5.checkpoint.fp8 import is_fp8_in_release
    from megatron_glm5.checkpoint.hf_keys import is_fp32_island_hf

    n = math.prod(shape)
    if len(shape) == 2 and is_fp8_in_release(key, text):
        return n + 4 * math.ceil(shape[0] / 128) * math.ceil(shape[1] / 128)
    return n * (4 if is_fp32_island_hf(key) else 2)


def _synthetic_tensor(key, shape, text, g):
    """{name: tensor} for one HF key: FP8 codes + scale grid where the release stores FP8, else float data."""
    import torch

    from megatron_glm5.checkpoint.fp8 import FP8_DTYPE, is_fp8_in_release
    from megatron_glm5.checkpoint.hf_keys import is_fp32_island_hf

    if len(shape) == 2 and is_fp8_in_release(key, text):
        codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        codes[(codes & 0x7F) == 0x7F] ^= 1  # no NaN codes
        grid = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
        scale = (0.5 + torch.rand(grid, generator=g)) / (448.0 * math.sqrt(shape[1]))
        return {key: codes.view(FP8_DTYPE), key + "_scale_inv": scale}
    if key.endswith("norm.weight") or len(shape) == 1:
        t = 1 + 0.1 * torch.randn(shape, generator=g)
    else:
        t = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
    return {key: t if is_fp32_island_hf(key) else t.to(torch.bfloat16)}


def write_synthetic_checkpoint(out_dir: str, hf_cfg: dict, shard_mb: float, seed: int = 0) -> int:
    """Write the checkpoint, shards in parallel threads, each streamed tensor by tensor; returns its size in bytes."""
    import concurrent.futures as cf

    import torch

    from megatron_glm5.checkpoint.fp8 import FP8_DTYPE, is_fp8_in_release
    from megatron_glm5.checkpoint.hf_keys import is_fp32_island_hf
    from megatron_glm5.checkpoint.safetensors_io import SafetensorsStreamWriter

    text = hf_cfg["text_config"]
    specs = hf_tensor_specs(hf_cfg)
    limit = shard_mb * 2 ** 20
    shards, cur, size = [], [], 0
    for key, shape in specs:
        b = _stored_bytes(key, shape, text)
        if cur and size + b > limit:
            shards.append(cur)
            cur, size = [], 0
        cur.append((key, shape))
        size += b
    shards.append(cur)
    os.makedirs(out_dir)
    t0 = time.time()
    fnames = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    def one(i):
        g = torch.Generator().manual_seed(seed * 100003 + i)
        order = []  # (name, shape, dtype) in write order: each weight, then its scale
        for key, shape in shards[i]:
            if len(shape) == 2 and is_fp8_in_release(key, text):
                grid = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
                order += [(key, shape, FP8_DTYPE), (key + "_scale_inv", grid, torch.float32)]
            else:
                order.append((key, shape, torch.float32 if is_fp32_island_hf(key) else torch.bfloat16))
        w = SafetensorsStreamWriter(os.path.join(out_dir, fnames[i]), order, metadata={"format": "pt"})
        try:
            for key, shape in shards[i]:
                for name, t in _synthetic_tensor(key, shape, text, g).items():
                    w.write(name, t)
            w.close()
        except BaseException:
            w.abort()
            raise
        return [name for name, _, _ in order], w.data_bytes

    weight_map, total = {}, 0
    threads = max(1, min(len(shards), os.cpu_count() or 1))
    torch.set_num_threads(1)  # the shards are the parallelism
    with cf.ThreadPoolExecutor(threads) as ex:
        for i, (names, nbytes_) in enumerate(ex.map(one, range(len(shards)))):
            weight_map.update({k: fnames[i] for k in names})
            total += nbytes_
            print(f"  shard {i + 1}/{len(shards)} written ({total / 1e9:.2f} GB, {time.time() - t0:.0f} s)",
                  flush=True)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(hf_cfg, fh, indent=2)
    return total


def experts_for(size_gb: float, num_layers: int = 8, hidden: int = 1024, moe_intermediate: int = 512) -> int:
    """Routed experts per MoE layer for a checkpoint of about ``size_gb``."""
    base = bench_hf_config(8, num_layers, hidden, moe_intermediate)
    t = base["text_config"]
    per_expert = 3 * t["hidden_size"] * t["moe_intermediate_size"]  # FP8: one byte per weight
    moe_layers = sum(1 for x in t["mlp_layer_types"] if x == "sparse")
    rest = 2 * t["vocab_size"] * t["hidden_size"] * 2 + num_layers * 12 * 2 ** 20  # embeddings + attention, roughly
    n = math.ceil((size_gb * 1e9 - rest) / (per_expert * moe_layers))
    return max(8, 8 * math.ceil(n / 8))


def run_converter(hf_dir: str, out_dir: str, workers: int, dtype: str, threads: int):
    """Run the CLI; returns (wall seconds, peak RSS of its process tree in bytes, exit code, CPU seconds (user,
    sys) of its process tree)."""
    import resource

    import psutil

    cmd = [sys.executable, os.path.join(ROOT, "tools", "convert_hf_to_mcore.py"), "--hf-dir", hf_dir, "--out",
           out_dir, "--workers", str(workers), "--threads", str(threads), "--dtype", dtype, "--overwrite", "--no-progress"]
    # the generator initialised torch.distributed in this process; the child must make its own group
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    t0 = time.time()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, env=env)
    ps_proc = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            procs = [ps_proc] + ps_proc.children(recursive=True)
            rss = 0
            for p in procs:
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
            peak = max(peak, rss)
        except psutil.Error:
            pass
        time.sleep(0.05)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # (the child and its reaped workers)
    cpu = (after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime)
    return time.time() - t0, peak, proc.returncode, cpu


MARKER = ".bench_convert_scratch"


def main(argv=None) -> int:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=2.2, help="approximate source checkpoint size (default 2.2)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024; GLM-5.3-Flash: 4096)")
    p.add_argument("--moe-intermediate", type=int, default=512,
                   help="rows of each routed expert's gate/up matrix (default 512; the release: 2048)")
    p.add_argument("--shard-mb", type=float, default=256)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="writer threads per converter process (default 2)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--dir", default=None, help="scratch directory (default: a new temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument("--reuse", action="store_true", help="reuse the synthetic checkpoint of an earlier run in --dir")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore", module=r"megatron\.")

    if a.dir is None:
        a.dir = tempfile.mkdtemp(prefix="glm5_bench_convert_")
    elif os.path.exists(a.dir) and os.listdir(a.dir) and not os.path.exists(os.path.join(a.dir, MARKER)):
        print(f"bench_convert: error: --dir {a.dir} exists and was not made by this bench; refusing to use it",
              file=sys.stderr)
        return 2
    os.makedirs(a.dir, exist_ok=True)
    open(os.path.join(a.dir, MARKER), "w").close()
    hf_dir, out_dir = os.path.join(a.dir, "hf_fp8"), os.path.join(a.dir, "mcore")
    try:
        if a.reuse and os.path.exists(os.path.join(hf_dir, "model.safetensors.index.json")):
            with open(os.path.join(hf_dir, "model.safetensors.index.json")) as fh:
                size = json.load(fh)["metadata"]["total_size"]
            print(f"reusing the synthetic FP8 checkpoint in {hf_dir} ({size / 1e9:.2f} GB)")
        else:
            shutil.rmtree(hf_dir, ignore_errors=True)
            cfg = bench_hf_config(experts_for(a.size_gb, a.layers, a.hidden, a.moe_intermediate), a.layers,
                                  a.hidden, a.moe_intermediate)
            print(f"writing a synthetic FP8 checkpoint ({cfg['text_config']['n_routed_experts']} experts x "
                  f"{cfg['text_config']['num_hidden_layers']} layers, hidden {cfg['text_config']['hidden_size']}) ...")
            size = write_synthetic_checkpoint(hf_dir, cfg, a.shard_mb)
        shutil.rmtree(out_dir, ignore_errors=True)  # an earlier run's output: not deleted inside the timer
        secs, peak, rc, cpu = run_converter(hf_dir, out_dir, a.workers, a.dtype, a.threads)
        if rc != 0:
            print(f"bench_convert: converter failed with exit code {rc}", file=sys.stderr)
            return 1
        with open(os.path.join(out_dir, "release", "conversion_info.json")) as fh:
            info = json.load(fh)
        out_b = info["checkpoint_bytes"]
        print(f"output: {out_b / 1e9:.2f} GB torch_dist ({a.dtype}), {info['num_tensors']} tensors, "
              f"{a.workers} worker(s) x {a.threads} writer thread(s); converter's own timer {info['seconds']:.1f} s "
              f"= {size / 1e6 / info['seconds']:.0f} MB/s of FP8 input, {out_b / 1e9 / info['seconds']:.2f} GB/s "
              f"written; write phase {info['write_seconds']:.1f} s = {size / 1e6 / info['write_seconds']:.0f} MB/s "
              f"of FP8 input, {info['tensor_bytes'] / 1e9 / info['write_seconds']:.2f} GB/s written")
        print(f"convert: {size / 1e9:.2f} GB in {secs:.1f} s = {size / 1e6 / secs:.0f} MB/s of FP8 input, "
              f"{out_b / 1e9 / secs:.2f} GB/s written (whole command, start-up included), CPU {cpu[0]:.1f} s user + "
              f"{cpu[1]:.1f} s sys, peak RSS {peak / 1e9:.2f} GB")
    finally:
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
