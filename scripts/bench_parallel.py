#!/usr/bin/env python
"""Parallel layouts on the GPUs of one host against one GPU: the same losses and the scaling efficiency.

    python scripts/bench_parallel.py [--layouts tp2_sp,ep2,pp2,cp2] [--seq-length 4096] [--iters 12]
        [--global-batch-size 2] [--layers 4] [--experts 16] [--topk 8] [--rtol 1e-3] [--workdir DIR] [--tiny]

Every run is ``pretrain_glm5_vlm.py`` as users start it (``torchrun --standalone`` for several processes) on the
harness's proxy config (``bench_train_step.proxy_hf_config``), from one set of initial weights: a random HF
checkpoint (``make_tiny_hf_checkpoint.write_checkpoint``) converted once by ``tools/convert_hf_to_mcore.py`` and
loaded with ``--pretrained-checkpoint``; mock data, one row of ``--seq-length`` tokens a micro-batch,
``--global-batch-size`` rows a step, bf16 with the distributed optimizer on CUDA (fp32 and gloo on the CPU,
``--tiny``), ``--log-interval 1``. Per layout it prints the largest relative difference of the per-iteration lm loss
from the one-GPU run (must be <= ``--rtol``), ms/step (mean after ``--warmup`` iterations), tokens/s and the
scaling efficiency: tokens/s / (GPUs x one GPU's tokens/s). Exit 1 if a layout fails or its losses differ.
NVLink multicast stays off (``NCCL_NVLS_ENABLE=0`` and friends are set when missing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

# name: (processes, flags)
LAYOUTS = {
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "ep2": (2, ["--expert-model-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "cp2": (2, ["--context-parallel-size", "2"]),
    "tp2_sp_ep2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size",
                       "2", "--expert-tensor-parallel-size", "1"]),
    "dp2": (2, []),
    "ep8": (8, ["--expert-model-parallel-size", "8"]),
}


def initial_checkpoint(workdir: str, cfg: dict, cuda: bool) -> tuple:
    """(HF checkpoint dir, Megatron-LM release checkpoint dir) of random weights for ``cfg``, written once."""
    from megatron_glm5.cli.make_tiny_hf_checkpoint import write_checkpoint

    hf_dir, init = os.path.join(workdir, "hf"), os.path.join(workdir, "init")
    if not os.path.isdir(hf_dir):
        write_checkpoint(hf_dir, cfg, fmt="bf16" if cuda else "fp32", seed=0)
    if not os.path.isdir(init):
        proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "convert_hf_to_mcore.py"), "--hf-dir",
                               hf_dir, "--out", init, "--dtype", "bf16" if cuda else "fp32"], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"conversion failed: {proc.stderr.strip().splitlines()[-1:]}")
    return hf_dir, init


def run_layout(name: str, nproc: int, flags: list, common: list, workdir: str, cuda: bool) -> dict:
    """One run; its log under ``workdir/<name>.log``; :func:`bench_train_step.parse_trainer_log` of it."""
    from bench_train_step import parse_trainer_log

    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=REPO + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1"), ("CUDA_DEVICE_MAX_CONNECTIONS", "1")):
        env.setdefault(var, value)
    if not cuda:
        env.setdefault("OMP_NUM_THREADS", "1")
    script = os.path.join(REPO, "pretrain_glm5_vlm.py")
    launch = ([sys.executable, script] if nproc == 1 else
              [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script])
    log = os.path.join(workdir, f"{name}.log")
    with open(log, "w") as out:
        proc = subprocess.run(launch + common + flags, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT)
    with open(log) as fh:
        text = fh.read()
    rec = {"returncode": proc.returncode, "log": log}
    try:
        rec.update(parse_trainer_log(text, 1))
    except ValueError as e:
        rec["error"] = str(e)
    if proc.returncode != 0:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        rec["error"] = f"exit {proc.returncode}: {lines[-1][-300:] if lines else 'no output'}"
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default="tp2_sp,ep2,pp2,cp2", help=f"from {', '.join(LAYOUTS)}")
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="iterations left out of the timing")
    p.add_argument("--global-batch-size", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--rtol", type=float, default=1e-3)
    p.add_argument("--workdir", default="outputs/bench_parallel")
    p.add_argument("--tiny", action="store_true", help="tiny widths on the CPU (gloo, fp32): a smoke run")
    a = p.parse_args(argv)
    names = [n for n in a.layouts.split(",") if n]
    bad = [n for n in names if n not in LAYOUTS]
    if bad:
        p.error(f"--layouts: unknown layout {bad[0]!r} (known: {', '.join(LAYOUTS)})")

    import torch

    from bench_train_step import proxy_hf_config

    cuda = torch.cuda.is_available() and not a.tiny
    if cuda and max(LAYOUTS[n][0] for n in names) > torch.cuda.device_count():
        p.error(f"--layouts: {max(LAYOUTS[n][0] for n in names)} GPUs needed, {torch.cuda.device_count()} visible")
    os.makedirs(a.workdir, exist_ok=True)
    workdir = os.path.abspath(a.workdir)
    cfg = proxy_hf_config(a.layers, a.experts, a.topk, 2048, 4, 1, tiny=a.tiny)
    hf_dir, init = initial_checkpoint(workdir, cfg, cuda)
    common = ["--hf-config", hf_dir, "--pretrained-checkpoint", init, "--mock-data", "--seq-length",
              str(a.seq_length), "--micro-batch-size", "1", "--global-batch-size", str(a.global_batch_size),
              "--train-iters", str(a.iters), "--lr", "1e-5", "--min-lr", "1e-5", "--lr-decay-style", "constant",
              "--log-interval", "1", "--eval-iters", "0", "--log-throughput", "--use-distributed-optimizer",
              "--seed", "1234"]
    if cuda:
        common += ["--bf16", "--torch-fused-adam"]
    tokens = a.seq_length * a.global_batch_size
    results = {"one": run_layout("one", 1, [], common, workdir, cuda)}
    for name in names:
        results[name] = run_layout(name, LAYOUTS[name][0], LAYOUTS[name][1], common, workdir, cuda)

    def step_seconds(rec):
        timed = [r[1] for r in rec["intervals"] if r[0] > a.warmup] or [rec["intervals"][-1][1]]
        return sum(timed) / len(timed) / 1e3

    failed = []
    base = results["one"]
    if "error" in base:
        print(f"one GPU: ERROR {base['error']} (log {base['log']})")
        return 1
    t1 = step_seconds(base)
    print("\n| layout | GPUs | max rel. loss difference | ms/step | tokens/s | scaling efficiency |")
    print("|---|---|---|---|---|---|")
    print(f"| one | 1 | - | {t1 * 1e3:.1f} | {tokens / t1:,.0f} | - |")
    for name in names:
        rec, n = results[name], LAYOUTS[name][0]
        if "error" in rec:
            failed.append(name)
            print(f"| {name} | {n} | ERROR {rec['error']} (log {rec['log']}) | - | - | - |")
            continue
        ref = {it: loss for it, _, _, loss in base["intervals"]}
        diffs = [abs(loss - ref[it]) / abs(ref[it]) for it, _, _, loss in rec["intervals"] if it in ref]
        worst = max(diffs) if len(diffs) == len(ref) else float("inf")
        rec["max_rel_loss_diff"] = worst
        t = step_seconds(rec)
        eff = (tokens / t) / (n * tokens / t1)
        rec.update(seconds=t, scaling_efficiency=eff)
        if not worst <= a.rtol:
            failed.append(name)
        print(f"| {name} | {n} | {worst:.2e}{'' if worst <= a.rtol else ' > rtol'} | {t * 1e3:.1f} | "
              f"{tokens / t:,.0f} | {eff:.0%} |")
    with open(os.path.join(workdir, "results.json"), "w") as fh:
        json.dump(results, fh, indent=2, default=str)
    if failed:
        print(f"bench_parallel.py: error: {', '.join(failed)} failed or differ from one GPU by more than "
              f"{a.rtol:g} (logs in {workdir})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
