"""TensorBoard scalars under Megatron-LM's tags and Megatron-LM's console line.

TensorBoard (written by the last rank, which holds the losses, like Megatron-LM), x axis = iteration:
    lm loss, mtp_1 loss, load_balancing_loss / seq_load_balancing_loss (megatron-core's MoE tracker), learning-rate,
    grad-norm, params-norm, num-zeros, iteration-time (s), throughput (TFLOP/s/GPU, 6N estimate),
    throughput/tokens-per-sec-per-gpu, mem-allocated-bytes, mem-max-allocated-bytes (CUDA; process RSS on CPU),
    skipped-iterations, validation loss, validation ppl (also as 'lm loss validation' / 'lm loss validation ppl',
    Megatron-LM's own names), moe/expert-load-imbalance (max/mean tokens per expert, mean over layers) and
    moe/expert-load-imbalance/layer_{i}, packing-efficiency.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from typing import Dict, Optional

import torch
import torch.distributed as dist


def is_last_rank() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


def print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def print_rank_last(message: str) -> None:
    if not dist.is_initialized() or is_last_rank():
        print(message, flush=True)


def memory_bytes() -> tuple:
    """(allocated, max allocated) bytes: CUDA allocator figures, or the process RSS (current, peak) on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    try:
        with open("/proc/self/statm") as fh:
            current = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        current = peak
    return current, peak


def get_tensorboard_writer(args):
    """A SummaryWriter on the last rank when --tensorboard-dir is set, else None."""
    if not args.tensorboard_dir or not is_last_rank():
        return None
    from torch.utils.tensorboard import SummaryWriter

    os.makedirs(args.tensorboard_dir, exist_ok=True)
    return SummaryWriter(log_dir=args.tensorboard_dir, max_queue=1000)


class TrainingLogger:
    """Accumulates per-iteration figures between --log-interval lines; writes TensorBoard every
    --tensorboard-log-interval iterations."""

    def __init__(self, args, writer, flops_per_token: float):
        self.args = args
        self.writer = writer
        self.flops_per_token = flops_per_token
        self.sums: Dict[str, float] = {}
        self.counts: Dict[str, int] = {}
        self.interval_time = 0.0
        self.interval_iters = 0
        self.interval_tokens = 0
        self.skipped_total = 0

    def scalar(self, tag: str, value: float, iteration: int) -> None:
        if self.writer is not None:
            self.writer.add_scalar(tag, value, iteration)

    def log_iteration(self, iteration: int, losses: Dict[str, float], lr: float, grad_norm: Optional[float],
                      params_norm: Optional[float], num_zeros: Optional[float], skipped: bool, iter_time: float,
                      tokens: int, consumed_samples: int, extra: Dict[str, float]) -> None:
        args = self.args
        self.interval_time += iter_time
        self.interval_iters += 1
        self.interval_tokens += tokens
        self.skipped_total += int(skipped)
        for k, v in losses.items():
            if not skipped:
                self.sums[k] = self.sums.get(k, 0.0) + v
                self.counts[k] = self.counts.get(k, 0) + 1
        world = dist.get_world_size()
        tok_per_s_gpu = tokens / max(iter_time, 1e-9) / world
        tflops_gpu = tok_per_s_gpu * self.flops_per_token / 1e12
        if self.writer is not None and iteration % args.tensorboard_log_interval == 0:
            for k, v in losses.items():
                self.scalar(k, v, iteration)
            self.scalar("learning-rate", lr, iteration)
            self.scalar("batch-size", args.global_batch_size, iteration)
            if grad_norm is not None:
                self.scalar("grad-norm", grad_norm, iteration)
            if params_norm is not None:
                self.scalar("params-norm", params_norm, iteration)
            if num_zeros is not None:
                self.scalar("num-zeros", num_zeros, iteration)
            self.scalar("skipped-iterations", self.skipped_total, iteration)
            self.scalar("iteration-time", iter_time, iteration)
            self.scalar("throughput", tflops_gpu, iteration)
            self.scalar("throughput/tokens-per-sec-per-gpu", tok_per_s_gpu, iteration)
            alloc, peak = memory_bytes()
            self.scalar("mem-allocated-bytes", alloc, iteration)
            self.scalar("mem-max-allocated-bytes", peak, iteration)
            for k, v in extra.items():
                self.scalar(k, v, iteration)
        if iteration % args.log_interval == 0:
            n = max(self.interval_iters, 1)
            ms = self.interval_time / n * 1e3
            tps = self.interval_tokens / max(self.interval_time, 1e-9) / world
            line = (f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {iteration:8d}/{args.train_iters:8d} |"
                    f" consumed samples: {consumed_samples:12d} | elapsed time per iteration (ms): {ms:.1f} |"
                    f" throughput per GPU (TFLOP/s/GPU): {tps * self.flops_per_token / 1e12:.3f} |"
                    f" tokens/s/GPU: {tps:.1f} | learning rate: {lr:.6E} |"
                    f" global batch size: {args.global_batch_size:5d} |")
            for k in sorted(self.sums, key=lambda k: (k != "lm loss", k)):
                line += f" {k}: {self.sums[k] / max(self.counts[k], 1):.6E} |"
            if grad_norm is not None:
                line += f" grad norm: {grad_norm:.3f} |"
            if num_zeros is not None:
                line += f" num zeros: {int(num_zeros)} |"
            if params_norm is not None:
                line += f" params norm: {params_norm:.3f} |"
            line += f" number of skipped iterations: {self.skipped_total:3d} |"
            print_rank_last(line)
            self.sums, self.counts = {}, {}
            self.interval_time, self.interval_iters, self.interval_tokens = 0.0, 0, 0

    def log_validation(self, iteration: int, losses: Dict[str, float], label: str = "validation") -> None:
        parts = []
        for k, v in losses.items():
            ppl = math.exp(min(20.0, v))
            parts.append(f"{k} value: {v:.6E} | {k} PPL: {ppl:.6E}")
            self.scalar(f"{k} {label}", v, iteration)
            self.scalar(f"{k} {label} ppl", ppl, iteration)
            if k == "lm loss":
                self.scalar(f"{label} loss", v, iteration)
                self.scalar(f"{label} ppl", ppl, iteration)
        text = f" {label} loss at iteration {iteration} | " + " | ".join(parts)
        print_rank_last("-" * (len(text) + 1) + "\n" + text + "\n" + "-" * (len(text) + 1))

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
