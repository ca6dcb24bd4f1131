"""Megatron-LM's "theoretical memory" report for this model, from the tensors this rank holds.

Megatron-LM's ``report_theoretical_memory`` (printed with the first logged iterations) derives the parameter count
from the GPT / MLA / MoE flags (``--hidden-size``, ``--num-layers``, ...); it has no KDA, indexer, mHC, MTP-stream
or vision terms, so its figures for this model are wrong (1.51 B parameters for a 2.89 B model). Here the count is
this rank's own parameters (its model chunks, a tied weight once), and the bytes a parameter costs are read off
what the run allocated:

* the weight in its own dtype;
* a trained weight's gradient buffer (``main_grad``, DDP's dtype: fp32 with ``--accumulate-allreduce-grads-in-fp32``
  or the fp32 main gradients of ``--bf16``);
* its optimizer state in fp32: a master copy when the weight is not fp32, and the optimizer's moments (Adam two,
  Lion one, SGD one with momentum), divided over the data-parallel ranks under ``--use-distributed-optimizer`` (the
  expert-data-parallel ranks for the expert-parallel weights, those with ``allreduce = False``); not estimated for the others.

A frozen weight (``--freeze-vision``) costs its weight only. Activations have no formula for these layers and are not
estimated; Megatron-LM's ``report_memory`` line that follows gives the measured peak (on CPU the process's peak
resident memory, :func:`report_memory_cpu`). Megatron-LM asks for the report after the first two iterations; it is
printed once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from megatron_glm5.training.flops import model_chunks

_MB = 1024 * 1024


@dataclass
class RankMemory:
    """Parameters and the bytes of weights, gradient buffers and optimizer state on one rank."""

    parameters: int
    expert_parallel_parameters: int
    """Those reduced over the expert-data-parallel group (``allreduce = False``: experts under EP or ETP)."""
    frozen_parameters: int
    weight_bytes: float
    grad_bytes: float
    optimizer_bytes: Optional[float]
    """None: not estimated for this optimizer."""

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.grad_bytes + (self.optimizer_bytes or 0.0)


def rank_memory(chunks: Iterable[torch.nn.Module], optimizer: str, distributed_optimizer: bool,
                data_parallel_size: int, expert_data_parallel_size: int, sgd_momentum: float = 0.0) -> RankMemory:
    """:class:`RankMemory` of the parameters of ``chunks`` (each tensor once). ``optimizer``: Megatron-LM's
    ``--optimizer``."""
    states = {"adam": 2, "lion": 1, "sgd": 1 if sgd_momentum else 0}.get(optimizer)
    seen = set()
    out = RankMemory(0, 0, 0, 0.0, 0.0, 0.0)
    for chunk in chunks:
        for p in chunk.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            n = p.numel()
            out.parameters += n
            out.weight_bytes += n * p.element_size()
            if not p.requires_grad:
                out.frozen_parameters += n
                continue
            expert = not getattr(p, "allreduce", True)
            out.expert_parallel_parameters += n if expert else 0
            grad = getattr(p, "main_grad", None)
            out.grad_bytes += n * (grad.element_size() if grad is not None else p.element_size())
            if states is None:
                continue
            per = 4 * (states + (0 if p.dtype == torch.float32 else 1))
            if distributed_optimizer:
                per /= expert_data_parallel_size if expert else data_parallel_size
            out.optimizer_bytes += n * per
    if states is None:
        out.optimizer_bytes = None
    return out


def report_theoretical_memory(args, num_microbatches: Optional[int] = None, verbose: bool = False):
    """Megatron-LM's ``report_theoretical_memory(args, num_microbatches, verbose)`` for this model (rank 0 calls
    it, so it makes no collective call): this rank's parameters and their weights, gradient buffers and optimizer
    state; returns ``(weight and optimizer MB, None, same)``, activations not estimated."""
    from megatron.core import parallel_state

    mem = rank_memory(model_chunks(), args.optimizer, bool(args.use_distributed_optimizer),
                      parallel_state.get_data_parallel_world_size(),
                      parallel_state.get_expert_data_parallel_world_size(), getattr(args, "sgd_momentum", 0.0))
    total = mem.total_bytes / _MB
    state = (f"{mem.optimizer_bytes / _MB:.2f}" if mem.optimizer_bytes is not None
             else f"not estimated for --optimizer {args.optimizer}")
    lines = [f"Theoretical memory footprints: weight and optimizer={total:.2f} MB (weights {mem.weight_bytes / _MB:.2f}, "
             f"gradient buffers {mem.grad_bytes / _MB:.2f}, optimizer state {state}); activations not estimated for "
             f"this model (the measured peak follows)"]
    if verbose:
        lines.insert(0, f"Number of parameters on this rank in billions: {mem.parameters / 1e9:.4f} (expert-parallel "
                        f"{mem.expert_parallel_parameters / 1e9:.4f}, frozen {mem.frozen_parameters / 1e9:.4f})")
    text = "\n".join(lines)
    if text != _REPORTED["last"]:  # Megatron-LM asks after the first two iterations: the same figures once
        print(text, flush=True)
        _REPORTED["last"] = text
    return total, None, total


_REPORTED = {"last": None}


def report_memory_cpu(name, process_group=None):
    """Megatron-LM's ``report_memory(name, process_group)`` on a machine without CUDA, where its CUDA allocator
    figures are all 0: the peak resident memory of this process (``getrusage``), printed by data-parallel rank 0."""
    import resource

    from megatron.core import parallel_state

    rank = (torch.distributed.get_rank(process_group) if process_group is not None
            else parallel_state.get_data_parallel_rank())
    if rank == 0:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        print(f"[Rank {torch.distributed.get_rank()}] {name} memory (MB) | process peak resident: {peak:.2f}",
              flush=True)


def install() -> None:
    """Make :func:`report_theoretical_memory` the one Megatron-LM's trainer calls, and on a machine without CUDA
    :func:`report_memory_cpu` its ``report_memory``; version-guarded through :mod:`megatron_glm5.extensions`
    (another megatron-core release is refused with one line)."""
    from megatron_glm5 import extensions

    extensions.apply(extensions.BY_NAME["memory_report"], report_theoretical_memory)
    if not torch.cuda.is_available():
        extensions.apply(extensions.BY_NAME["memory_report_cpu"], report_memory_cpu)
