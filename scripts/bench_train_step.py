#!/usr/bin/env python
"""One training step (bf16 forward + backward + AdamW) of transformers' Glm5Next and of our model, in one process.

    python scripts/bench_train_step.py [--seqs 2048,4096,8192,16384,32768] [--models hf,ours,trainer]
        [--profile-seq 4096] [--layers 4] [--experts 16] [--topk 8] [--recompute-from 16384] [--out FILE.json]
        [--tiny] [--trainer] [--trainer-iters 30] [--trainer-args "..."] [--micro-batches 1]

Both models are built from the same HF config dict: the released widths (``glm5_flash_hf_config``), ``--layers``
decoder layers (``linear_attention`` x (L-1) then ``indexed_attention``), every MLP an MoE with ``--experts`` experts
top-``--topk``, ``index_topk`` 2048 / ``index_kpool`` 4, vision depth 1 (no image in the batch), no MTP.
transformers' ``Glm5NextForConditionalGeneration`` is built with its defaults (grouped_mm experts, FLA kernels where
installed); ours by ``build_model`` with ``default_backends('cuda')`` unless ``--ours-backends`` says otherwise
(``kda_backend=fla_fused,dsa_backend=fused,moe_experts_backend=grouped,moe_cuda_graph=true``;
``--ours-backends moe_cuda_graph=false`` runs the MoE layers eagerly). A step whose loss is not finite is reported
as an error (exit 1). One document of ``s`` tokens per row, ``--micro-batches`` rows (forward and backward each,
gradients accumulated) per optimizer step: 1 by default, where the optimizer's share is largest; a training run's
global batch spreads it over many rows. Printed per length: tokens/s, 6N-MFU against the bf16
matmul rate measured at the start (``N`` = active parameters: everything but the embedding and the vision tower,
routed experts counted ``topk / experts``), peak memory, the ratio ours / transformers; then a CUDA-time profile (top
kernels) of our step at ``--profile-seq``. Lengths from ``--recompute-from`` on run with full activation recompute in
both models (transformers' gradient checkpointing, our ``recompute_granularity='full'``); an OOM is reported, not
fatal. ``--sync-sites`` also lists the call sites that make the host wait for the GPU during our step at
``--profile-seq`` (each one empties the launch queue). ``--trace`` traces that step
with Python stacks and reports the GPU's idle time charged to the frames that launched the kernel after each gap.
Every length also prints the last timed step's phases (forward, backward, optimizer), host time against GPU time.

``--trainer`` (or ``trainer`` in ``--models``) also runs the step as users run it: ``pretrain_glm5_vlm.py`` on the
same config (written to a JSON file, ``--hf-config``), Megatron-LM's trainer with ``--bf16
--use-distributed-optimizer --torch-fused-adam``, mock data, ``--micro-batches`` rows of ``s`` tokens a step
(``--global-batch-size``), ``--trainer-iters``
iterations logged every ``--trainer-log-interval``, in its own process after the in-process models. Its ms/step is
the mean of Megatron-LM's "elapsed time per iteration" over the logged intervals after the first full one (which
holds the compilation, autotuning and graph captures: 232 s for its first step on a fresh H100); MFU is given
both as 6N (``N`` counted as above on a meta-device build) and from the trainer's own "throughput per GPU" (this
project's FLOP count, attention terms included), each against the measured matmul rate.
The trainer's log is written next to ``--out`` (``_trainer_<s>.log``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import re
import sys
import time



def proxy_hf_config(layers: int, experts: int, topk: int, index_topk: int, kpool: int, vision_depth: int,
                    tiny: bool = False) -> dict:
    """The benchmark's HF config dict (see the module docstring)."""
    from megatron_glm5.config import INDEXED_ATTENTION, LINEAR_ATTENTION, glm5_flash_hf_config, tiny_hf_config

    cfg = copy.deepcopy(tiny_hf_config() if tiny else glm5_flash_hf_config())
    t = cfg["text_config"]
    t.update(num_hidden_layers=layers, layer_types=[LINEAR_ATTENTION] * (layers - 1) + [INDEXED_ATTENTION],
             mlp_layer_types=["sparse"] * layers, n_routed_experts=experts, num_experts_per_tok=topk,
             n_group=1, topk_group=1)
    if not tiny:
        t.update(index_topk=index_topk, index_kpool=kpool)
    t.pop("num_nextn_predict_layers", None)
    t.pop("indexer_types", None)
    cfg["vision_config"]["depth"] = vision_depth
    return cfg


def matmul_rate(dev: str, n: int = 8192, reps: int = 10) -> float:
    """Measured dense bf16 matmul rate (FLOP/s) on random data."""
    import torch

    if dev != "cuda":
        n, reps = 512, 3
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(dev)
    return 2.0 * n ** 3 * reps / (time.perf_counter() - t0)


def cuda_time(fn, iters: int = 5) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream (CUDA events; one warm-up call first)."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def _sync(dev):
    import torch

    if dev == "cuda":
        torch.cuda.synchronize()


def active_params(model, experts: int, topk: int) -> float:
    """Parameters a token passes through, without the embedding and the vision tower."""
    n = 0.0
    for name, p in model.named_parameters():
        if "embed" in name or "vision" in name or "visual" in name:
            continue
        frac = topk / experts if (".experts." in name and "shared" not in name) else 1.0
        n += p.numel() * frac
    return n


def build_hf(cfg: dict, dev: str, dtype):
    import torch
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    hf_cfg = Glm5NextConfig(**copy.deepcopy(cfg))
    with torch.device(dev):
        model = Glm5NextForConditionalGeneration._from_config(hf_cfg, dtype=dtype)
    return model.train()


def build_ours(cfg: dict, dev: str, dtype, backends: dict):
    import torch

    from megatron_glm5.config import Glm5Config
    from megatron_glm5.models.builder import build_model

    kw = dict(backends)
    kw.update(params_dtype=torch.float32, use_cpu_initialization=dev != "cuda", perform_initialization=True)
    if dtype == torch.bfloat16:
        kw["bf16"] = True
    config = Glm5Config.from_hf(cfg, **kw)
    model = build_model(config, parallel_output=True)
    if dev != "meta":
        from megatron_glm5.models.builder import describe_backends

        print(describe_backends(config, dev), flush=True)
    model.to_dtype(dtype)
    model.to(dev)
    return model.train()


def make_step(kind: str, model, ids, dev):
    """A closure running one AdamW step over the rows of ``ids`` [rows, s] (a fwd + bwd each, gradients
    accumulated); returns the last row's loss."""
    import torch

    from megatron_glm5.models.packing import make_packed_seq_params

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0, fused=dev == "cuda")
    s = ids.shape[1]
    rows = [ids[i:i + 1] for i in range(ids.shape[0])]
    labels = [torch.roll(r, -1, dims=1) for r in rows]
    psp = make_packed_seq_params(torch.tensor([0, s], dtype=torch.int32, device=ids.device))

    phases = PhaseTimes(dev)

    def step():
        phases.mark("start")
        for row, lab in zip(rows, labels):
            if kind == "hf":
                loss = model(input_ids=row, labels=row).loss
            else:
                loss = model(row, labels=lab, packed_seq_params=psp).float().mean()
            phases.mark("forward")
            (loss / len(rows)).backward()
            phases.mark("backward")
        opt.step()
        opt.zero_grad(set_to_none=True)
        phases.mark("optimizer")
        return loss

    step.phases = phases
    return step, opt


class PhaseTimes:
    """Host and GPU time of the step's phases (forward, backward, optimizer) of the last step: the host's
    ``perf_counter`` when it reached each boundary and a CUDA event recorded there. A phase whose host time is close
    to its GPU time, with the GPU idle in between, is bound by launching (read after a synchronize)."""

    def __init__(self, dev: str):
        self.dev = dev
        self.marks = []

    def mark(self, name: str):
        import torch

        if name == "start":
            self.marks = []
        event = None
        if self.dev == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append((name, time.perf_counter(), event))

    def report(self) -> str:
        parts = []
        for (_, h0, e0), (name, h1, e1) in zip(self.marks[:-1], self.marks[1:]):
            gpu = f", GPU {e0.elapsed_time(e1):6.1f} ms" if e0 is not None else ""
            parts.append(f"{name} host {1e3 * (h1 - h0):6.1f} ms{gpu}")
        return "; ".join(parts)


def set_recompute(kind: str, model, on: bool):
    if kind == "hf":
        if on:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
    else:
        model.config.recompute_granularity = "full" if on else None


def time_steps(step, dev: str, warmup: int, iters: int):
    import torch

    first = None
    for _ in range(warmup):
        loss = step()
        if first is None:
            first = float(loss.detach())  # during warm-up: a NaN from the first step on is told from a later one
    _sync(dev)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        loss = step()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if dev == "cuda" else float("nan")
    times.sort()
    return times[len(times) // 2], peak, float(loss.detach()), first


def profile_step(step, dev: str, top: int, out_path: str = None) -> str:
    """CUDA-time table (top kernels by self device time) of one step."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        _sync(dev)
    key = "self_cuda_time_total" if dev == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=90)
    if out_path:
        with open(out_path, "w") as fh:
            fh.write(prof.key_averages().table(sort_by=key, row_limit=200, max_name_column_width=140))
    return table


def gpu_idle_report(trace: dict, top: int = 25) -> str:
    """Where the GPU waits for the host in one profiled step (a chrome trace dict of ``torch.profiler`` taken with
    ``with_stack=True``). The step's window runs from its first kernel's start to its last kernel's end; the idle
    time is that window minus the union of the kernels' intervals. Each idle gap is charged to what was launching
    the kernel that ended it: the innermost Python frame in this repository (``megatron_glm5/`` or ``scripts/``),
    the innermost Python frame of all, the innermost operator (``cpu_op``: the autograd engine's backward nodes
    show there) and the kernel itself, each ranked by idle milliseconds."""
    import collections

    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kernels:
        return "no GPU kernels in the trace"
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}

    gaps = []  # (idle microseconds, kernel, its launch event or None)
    busy_end = kernels[0]["ts"] + kernels[0]["dur"]
    for k in kernels[1:]:
        if k["ts"] - busy_end > 1.0:
            gaps.append((k["ts"] - busy_end, k, launches.get(k.get("args", {}).get("correlation"))))
        busy_end = max(busy_end, k["ts"] + k["dur"])
    span = max(k["ts"] + k["dur"] for k in kernels) - kernels[0]["ts"]
    idle = sum(g for g, _, _ in gaps)

    def stacks(cat):
        """launch event id -> the ``cat`` events enclosing it on its thread, outermost first (a sweep per thread:
        the events of one thread nest)."""
        by_tid = collections.defaultdict(list)
        for e in events:
            if e.get("cat") == cat:
                by_tid[e["tid"]].append((e["ts"], 0, -e["dur"], e))
        for _, _, launch in gaps:
            if launch is not None:
                by_tid[launch["tid"]].append((launch["ts"], 1, 0, launch))
        out = {}
        for items in by_tid.values():
            items.sort(key=lambda x: x[:3])
            open_ = []
            for ts, is_query, _, e in items:
                while open_ and open_[-1]["ts"] + open_[-1]["dur"] < ts:
                    open_.pop()
                if is_query:
                    out[id(e)] = [f["name"] for f in open_]
                else:
                    open_.append(e)
        return out

    py, ops = stacks("python_function"), stacks("cpu_op")
    by = {key: collections.Counter() for key in ("own", "inner", "op", "kernel")}
    for gap, k, launch in gaps:
        frames = py.get(id(launch), []) if launch is not None else []
        mine = [f for f in frames if "megatron_glm5/" in f or "scripts/" in f]
        by["own"][mine[-1] if mine else "(no frame of this repository)"] += gap
        by["inner"][frames[-1] if frames else "(no Python frame)"] += gap
        op = ops.get(id(launch), []) if launch is not None else []
        by["op"][op[-1] if op else "(no operator)"] += gap
        by["kernel"][k["name"][:100]] += gap
    lines = [f"kernels {len(kernels)}; window {span / 1e3:.2f} ms; GPU idle {idle / 1e3:.2f} ms in {len(gaps)} gaps "
             f"over 1 us ({100 * idle / span:.1f} %)"]
    for key, title in (("own", "innermost frame of this repository"), ("inner", "innermost Python frame"),
                       ("op", "innermost operator"), ("kernel", "kernel after the gap")):
        lines.append(f"idle ms by {title}:")
        lines += [f"  {t / 1e3:8.3f}  {name}" for name, t in by[key].most_common(top)]
    return "\n".join(lines)


def kernel_table(trace: dict, steps: int = 1, top: int = 40) -> str:
    """GPU time by kernel name in a chrome trace of ``torch.profiler`` (``steps`` profiled steps): per step, the
    busy time (union of the kernels' intervals), then the ``top`` kernel names by total time with their count and
    share; kernel names are cut at 110 characters (template arguments make one kernel many names otherwise)."""
    import collections

    kernels = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "kernel"]
    if not kernels:
        return "no GPU kernels in the trace"
    total, count = collections.Counter(), collections.Counter()
    for k in kernels:
        name = k["name"][:110]
        total[name] += k["dur"]
        count[name] += 1
    busy, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda e: e["ts"]):
        start, stop = k["ts"], k["ts"] + k["dur"]
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - min(k["ts"] for k in kernels)
    allk = sum(total.values())
    lines = [f"per step: window {span / steps / 1e3:.2f} ms, GPU busy {busy / steps / 1e3:.2f} ms, kernel time "
             f"{allk / steps / 1e3:.2f} ms in {len(kernels) / steps:.0f} kernels",
             f"{'ms/step':>9} {'calls':>6} {'share':>6}  kernel"]
    lines += [f"{t / steps / 1e3:9.3f} {count[n] / steps:6.0f} {100 * t / allk:5.1f}%  {n}"
              for n, t in total.most_common(top)]
    return "\n".join(lines)


def traced_step(step, with_stack: bool) -> dict:
    """The chrome trace (a dict) of one CUDA step under ``torch.profiler`` (CPU and CUDA activity; Python stacks
    when ``with_stack``: those slow the host about twofold, so the gaps they show are the traced step's)."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=with_stack) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw) as fh:
            return json.load(fh)


def trace_step(step, path: str, with_stack: bool = True) -> str:
    """:func:`traced_step` written to ``path`` (gzip); returns :func:`gpu_idle_report` of it."""
    import gzip

    trace = traced_step(step, with_stack)
    with gzip.open(path, "wt") as fh:
        json.dump(trace, fh)
    return gpu_idle_report(trace)


def sync_sites(step, top: int = 25) -> str:
    """One step under ``torch.cuda.set_sync_debug_mode('warn')``: the Python call sites of every operation that
    made the host wait for the GPU (each one drains the launch queue, leaving the GPU idle while the host catches
    up), most frequent first."""
    import collections
    import warnings

    import torch

    sites = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "called a synchronizing CUDA operation" in str(w.message):
            sites[f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:80]}"] += 1
    lines = [f"{n:5d}  {site}" for site, n in sites.most_common(top)]
    return f"{sum(sites.values())} synchronizing operations in one step\n" + "\n".join(lines)


TRAINER_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)"
                          r"(?:.*?throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+))?.*?lm loss: ([0-9.E+-]+|nan|inf)")
TRAINER_MEMORY = re.compile(r"memory \(MB\) \| allocated: [0-9.]+ \| max allocated: ([0-9.]+)")


def parse_trainer_log(text: str, log_interval: int) -> dict:
    """Megatron-LM's per-interval log lines of a training run -> ``{"intervals": [(iteration, ms/step, TFLOP/s or
    None, lm loss)], "seconds", "tflops", "loss", "first_loss", "peak_gib"}``. ``seconds`` / ``tflops`` average the
    intervals that end after iteration ``log_interval``: Megatron-LM logs iteration 1 on its own, then every
    ``log_interval`` iterations, and the first interval still holds the kernels' compilation, autotuning and graph
    captures (the last interval when no later one exists). Raises ``ValueError`` when no line is found."""
    rows = [(int(m.group(1)), float(m.group(2)), float(m.group(3)) if m.group(3) else None, float(m.group(4)))
            for m in TRAINER_LINE.finditer(text)]
    if not rows:
        raise ValueError("no 'elapsed time per iteration' line in the trainer's output")
    timed = [r for r in rows if r[0] > log_interval] or rows[-1:]
    tflops = [r[2] for r in timed if r[2] is not None]
    peaks = [float(x) for x in TRAINER_MEMORY.findall(text)]
    return {"intervals": rows, "seconds": sum(r[1] for r in timed) / len(timed) / 1e3,
            "tflops": (sum(tflops) / len(tflops)) if tflops else None, "loss": rows[-1][3], "first_loss": rows[0][3],
            "peak_gib": max(peaks) / 1024 if peaks else float("nan")}


def trainer_command(cfg_path: str, s: int, iters: int, log_interval: int, recompute: bool, extra: list,
                    micro_batches: int = 1) -> list:
    """The ``pretrain_glm5_vlm.py`` command line of one ``--trainer`` run (see the module docstring)."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pretrain_glm5_vlm.py")
    cmd = [sys.executable, script, "--hf-config", cfg_path, "--mock-data", "--seq-length", str(s),
           "--micro-batch-size", "1", "--global-batch-size", str(micro_batches), "--train-iters", str(iters), "--lr", "1e-6",
           "--min-lr", "1e-6", "--log-interval", str(log_interval), "--eval-iters", "0", "--log-throughput",
           "--use-distributed-optimizer"]
    import torch

    if torch.cuda.is_available():
        cmd += ["--bf16", "--torch-fused-adam"]
    if recompute:
        cmd += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    return cmd + list(extra)


def run_trainer(cfg: dict, s: int, iters: int, log_interval: int, recompute: bool, extra: list,
                log_path: str = None, profile: bool = False, micro_batches: int = 1) -> dict:
    """One ``--trainer`` run of ``s`` tokens a step: :func:`parse_trainer_log` of its output plus ``returncode``;
    ``error`` (the last stderr line) when it failed, ``oom`` when that was an out-of-memory error. ``profile``:
    Megatron-LM's ``--profile --use-pytorch-profiler`` over the two iterations before the last (with Python
    stacks), and ``profile`` = :func:`kernel_table` and :func:`gpu_idle_report` of that trace."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path, "w") as fh:
            json.dump(cfg, fh)
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # this process's world
            env.pop(var, None)
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        out_path = os.path.join(tmp, "out.log")
        err_path = os.path.join(tmp, "err.log")
        if profile:
            extra = list(extra) + ["--profile", "--use-pytorch-profiler", "--pytorch-profiler-collect-callstack",
                                   "--profile-step-start", str(iters - 3), "--profile-step-end", str(iters - 1),
                                   "--tensorboard-dir", os.path.join(tmp, "tb")]
        # the output goes to files as it comes (a run cut short by a time limit leaves its log behind)
        with open(log_path or out_path, "w") as out, open(err_path, "w") as err:
            proc = subprocess.run(trainer_command(cfg_path, s, iters, log_interval, recompute, extra, micro_batches), cwd=tmp,
                                  env=env, stdout=out, stderr=err, text=True)
        with open(log_path or out_path) as fh:
            stdout = fh.read()
        with open(err_path) as fh:
            stderr = fh.read()
        trace_path = os.path.join(tmp, "torch_profile", "rank-0.json.gz")
        if profile and os.path.exists(trace_path):
            import gzip

            with gzip.open(trace_path, "rt") as fh:
                trace = json.load(fh)
            profile_report = kernel_table(trace, steps=2) + "\n" + gpu_idle_report(trace)
            if log_path:
                import shutil

                shutil.copy(trace_path, os.path.splitext(log_path)[0] + "_trace.json.gz")
        else:
            profile_report = None
    if log_path:
        with open(log_path, "a") as fh:
            fh.write("\n--- stderr ---\n" + stderr)
    rec = {"returncode": proc.returncode}
    if profile_report is not None:
        rec["profile"] = profile_report
    try:
        rec.update(parse_trainer_log(stdout, log_interval))
    except ValueError as e:
        rec["error"] = str(e)
    if proc.returncode != 0:
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        rec["error"] = f"exit {proc.returncode}: {lines[-1][-300:] if lines else 'no stderr'}"
        if "OutOfMemoryError" in stderr:
            rec["oom"] = True
    return rec


def meta_active_params(cfg: dict, experts: int, topk: int) -> float:
    """:func:`active_params` of our model of ``cfg``, built on the meta device (no memory, no initialisation)."""
    import torch

    from megatron_glm5.models.builder import default_backends

    with torch.device("meta"):
        model = build_ours(cfg, "meta", torch.bfloat16, default_backends("cpu"))
    return active_params(model, experts, topk)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="2048,4096,8192,16384,32768")
    p.add_argument("--models", default="hf,ours")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--index-topk", type=int, default=2048)
    p.add_argument("--kpool", type=int, default=4)
    p.add_argument("--vision-depth", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--recompute-from", type=int, default=16384)
    p.add_argument("--profile-seq", type=int, default=4096, help="0: no profile")
    p.add_argument("--profile-top", type=int, default=30)
    p.add_argument("--sync-sites", action="store_true", help="list the host-synchronizing call sites of our step at "
                   "--profile-seq (torch.cuda.set_sync_debug_mode)")
    p.add_argument("--trace", action="store_true", help="also trace our step at --profile-seq with Python stacks: "
                   "the chrome trace (gzip) next to --out and a report of where the GPU waits for the host")
    p.add_argument("--trace-without-stacks", action="store_true", help="--trace (implied) without Python stacks: "
                   "the host runs at nearly its untraced speed, the report names operators and kernels only")
    p.add_argument("--ours-backends", default="", help="e.g. kda_backend=fla,dsa_backend=torch (default: "
                                                         "default_backends('cuda'))")
    p.add_argument("--out", default="", help="write the results as JSON here (profile table next to it)")
    p.add_argument("--tiny", action="store_true", help="tiny widths on the CPU (smoke run)")
    p.add_argument("--trainer", action="store_true", help="also time pretrain_glm5_vlm.py (Megatron-LM's trainer) on "
                   "the same config, in its own process (same as 'trainer' in --models)")
    p.add_argument("--trainer-iters", type=int, default=30)
    p.add_argument("--trainer-log-interval", type=int, default=10)
    p.add_argument("--micro-batches", type=int, default=1, help="rows of s tokens per optimizer step (gradients "
                   "accumulated; the trainer's --global-batch-size)")
    p.add_argument("--trainer-args", default="", help="extra pretrain_glm5_vlm.py flags, e.g. '--no-moe-cuda-graph'")
    a = p.parse_args(argv)
    kinds = [k for k in a.models.split(",") if k]
    if a.trainer and "trainer" not in kinds:
        kinds.append("trainer")
    bad = [k for k in kinds if k not in ("hf", "ours", "trainer")]
    if bad:
        p.error(f"--models: unknown model {bad[0]!r} (hf, ours, trainer)")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)

    import torch

    from megatron_glm5.initialize import initialize_megatron
    from megatron_glm5.models.builder import default_backends
    from megatron_glm5.models.cuda_graphs import graphed_modules

    dev = "cuda" if torch.cuda.is_available() and not a.tiny else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    initialize_megatron()
    torch.manual_seed(0)
    cfg = proxy_hf_config(a.layers, a.experts, a.topk, a.index_topk, a.kpool, a.vision_depth, tiny=a.tiny)
    experts, topk = cfg["text_config"]["n_routed_experts"], cfg["text_config"]["num_experts_per_tok"]
    backends = default_backends(dev)
    for item in filter(None, a.ours_backends.split(",")):
        k, v = item.split("=")
        backends[k] = {"true": True, "false": False}.get(v.lower(), v)
    rate = matmul_rate(dev)
    print(f"device {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"measured bf16 matmul rate {rate / 1e12:.0f} TFLOP/s; ours: {backends}", flush=True)
    seqs = [int(x) for x in a.seqs.split(",")]
    nb = a.micro_batches
    if nb < 1:
        p.error("--micro-batches must be >= 1")
    vocab = cfg["text_config"]["vocab_size"]
    results = {"matmul_tflops": rate / 1e12, "backends": backends, "config": cfg, "micro_batches": nb, "runs": {}}
    profile_table = None
    n_active = None
    nonfinite = []  # runs whose last step's loss was NaN / inf: their timings measured a broken step
    for kind in sorted(kinds, key=lambda k: k == "trainer"):  # the trainer's process last: the GPU is free then
        if kind == "trainer":
            n_trainer = n_active if n_active is not None else meta_active_params(cfg, experts, topk)
            for s in seqs:
                recompute = s >= a.recompute_from
                log_path = (os.path.splitext(a.out)[0] + f"_trainer_{s}.log") if a.out else None
                rec = {"recompute": recompute}
                rec.update(run_trainer(cfg, s, a.trainer_iters, a.trainer_log_interval, recompute,
                                       a.trainer_args.split(), log_path, profile=s == a.profile_seq,
                                       micro_batches=a.micro_batches))
                if rec.get("profile"):
                    print(f"[trainer] s={s:6d} profile of 2 steps:\n{rec['profile']}", flush=True)
                if "seconds" in rec and "error" not in rec:
                    t = rec["seconds"]
                    rec.update(tokens_per_s=nb * s / t, mfu=6.0 * n_trainer * nb * s / t / rate,
                               mfu_flops=(rec["tflops"] * 1e12 / rate) if rec["tflops"] else None)
                    if not math.isfinite(rec["loss"]):
                        nonfinite.append(f"trainer s={s}")
                    flops_mfu = "-" if rec["mfu_flops"] is None else f"{rec['mfu_flops'] * 100:5.1f} %"
                    print(f"[trainer] s={s:6d}{' (recompute)' if recompute else ''}: {t * 1e3:9.1f} ms/step  "
                          f"{nb * s / t:9.0f} tok/s  6N-MFU {rec['mfu'] * 100:5.1f} %  MFU (trainer FLOPs) {flops_mfu}  "
                          f"peak {rec['peak_gib']:6.1f} GiB  loss {rec['loss']:.3f} (first logged "
                          f"{rec['first_loss']:.3f})", flush=True)
                else:
                    print(f"[trainer] s={s:6d}: {'OOM' if rec.get('oom') else 'ERROR'} {rec.get('error', '')}",
                          flush=True)
                    rec.setdefault("error", "failed")
                results["runs"][f"trainer_{s}"] = rec
            continue
        model = build_hf(cfg, dev, dtype) if kind == "hf" else build_ours(cfg, dev, dtype, backends)
        n_kind = active_params(model, experts, topk)
        if kind == "ours":
            n_active = n_kind
        print(f"[{kind}] built: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, "
              f"{n_kind / 1e9:.3f}B active (6N counts these)", flush=True)
        for s in seqs:
            g = torch.Generator().manual_seed(s)
            ids = torch.randint(1, min(vocab, 150000) - 1, (nb, s), generator=g).to(dev)
            recompute = s >= a.recompute_from
            set_recompute(kind, model, recompute)
            rec = {"recompute": recompute}
            try:
                step, opt = make_step(kind, model, ids, dev)
                t, peak, loss, first_loss = time_steps(step, dev, a.warmup, a.iters)
                rec.update(seconds=t, tokens_per_s=nb * s / t, peak_gib=peak, loss=loss, first_loss=first_loss,
                           mfu=6.0 * n_kind * nb * s / t / rate)
                if not math.isfinite(loss):
                    nonfinite.append(f"{kind} s={s}")
                print(f"[{kind}] s={s:6d}{' (recompute)' if recompute else ''}: {t * 1e3:9.1f} ms/step  "
                      f"{nb * s / t:9.0f} tok/s  6N-MFU {rec['mfu'] * 100:5.1f} %  peak {peak:6.1f} GiB  "
                      f"loss {loss:.3f}" + ("" if first_loss is None else f" (first step {first_loss:.3f})"),
                      flush=True)
                rec["phases"] = step.phases.report()
                print(f"[{kind}] s={s:6d} last step: {rec['phases']}", flush=True)
                if kind == "ours" and s == a.profile_seq:
                    path = (os.path.splitext(a.out)[0] + f"_profile_{s}.txt") if a.out else None
                    profile_table = profile_step(step, dev, a.profile_top, path)
                    if (a.trace or a.trace_without_stacks) and dev == "cuda":
                        tpath = (os.path.splitext(a.out)[0] if a.out else "bench_train_step") + f"_trace_{s}.json.gz"
                        print(f"[ours] s={s:6d}: {trace_step(step, tpath, not a.trace_without_stacks)}", flush=True)
                    if "trainer" in kinds and dev == "cuda":  # the same table as the trainer's profile
                        print(f"[ours] s={s:6d} kernels of 1 step:\n{kernel_table(traced_step(step, False))}", flush=True)
                    if a.sync_sites and dev == "cuda":
                        print(f"[ours] s={s:6d}: {sync_sites(step)}", flush=True)
            except torch.OutOfMemoryError:
                rec["oom"] = True
                print(f"[{kind}] s={s:6d}: OOM", flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on with the next length
                rec["error"] = f"{type(e).__name__}: {e}"[:500]
                print(f"[{kind}] s={s:6d}: ERROR {rec['error']}", flush=True)
            results["runs"][f"{kind}_{s}"] = rec
            step = opt = None
            for graphs in graphed_modules([model]):  # the MoE graphs of this length hold its activations' memory
                graphs.reset()
            gc.collect()
            if dev == "cuda":
                torch.cuda.empty_cache()
        del model
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()

    results["active_params"] = n_active
    print("\n| tokens | transformers tok/s | ours tok/s | ours / transformers | ours 6N-MFU | transformers 6N-MFU "
          "| ours peak GiB | transformers peak GiB |" + (" trainer tok/s | trainer / ours | trainer / transformers | "
                                                        "trainer 6N-MFU | trainer MFU (its FLOPs) | trainer peak GiB |"
                                                        if "trainer" in kinds else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|---|---|---|---|---|" if "trainer" in kinds else ""))

    def fmt(r, key, f):
        if r is None:
            return "-"
        if "oom" in r:
            return "OOM"
        if "error" in r:
            return "error"
        return f.format(r[key])

    def ratio(x, y):
        ok = x and y and "tokens_per_s" in x and "tokens_per_s" in y and "error" not in x and "error" not in y
        return f"{x['tokens_per_s'] / y['tokens_per_s']:.2f}" if ok else "-"

    for s in seqs:
        h, o, tr = (results["runs"].get(f"{k}_{s}") for k in ("hf", "ours", "trainer"))
        tag = " (recompute)" if s >= a.recompute_from else ""
        label = f"{s // 1024}K" if s % 1024 == 0 else str(s)
        row = (f"| {label}{tag} | {fmt(h, 'tokens_per_s', '{:,.0f}')} | {fmt(o, 'tokens_per_s', '{:,.0f}')} | "
               f"{ratio(o, h)} | {fmt(o, 'mfu', '{:.1%}')} | {fmt(h, 'mfu', '{:.1%}')} | "
               f"{fmt(o, 'peak_gib', '{:.1f}')} | {fmt(h, 'peak_gib', '{:.1f}')} |")
        if "trainer" in kinds:
            flops_mfu = "-" if not tr or tr.get("mfu_flops") is None else f"{tr['mfu_flops']:.1%}"
            row += (f" {fmt(tr, 'tokens_per_s', '{:,.0f}')} | {ratio(tr, o)} | {ratio(tr, h)} | "
                    f"{fmt(tr, 'mfu', '{:.1%}')} | {flops_mfu} | {fmt(tr, 'peak_gib', '{:.1f}')} |")
        print(row)
    if profile_table:
        print(f"\nCUDA-time profile of our step at s={a.profile_seq} (top kernels):\n{profile_table}")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(results, fh, indent=2, default=str)
    if nonfinite:
        print(f"bench_train_step.py: error: non-finite loss in {', '.join(nonfinite)}: those timings are of a broken "
              f"step", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
