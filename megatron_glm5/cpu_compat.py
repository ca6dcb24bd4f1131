"""The one place that lets megatron-core 0.16.1 run on a CPU-only machine (tests and the CPU quickstart).

megatron-core calls a few CUDA-only APIs unconditionally: ``torch.cuda.current_device()`` as an allocation device,
``torch.cuda.Stream``/``Event`` objects in the MoE dispatcher, the CUDA RNG state in its RNG tracker, and literal
``device="cuda"`` tensors in the pipeline schedules. ``enable_cpu_compat()`` redirects exactly these to the CPU:

* ``torch.cuda.current_device`` -> ``"cpu"`` (so ``torch.empty(..., device=current_device())`` lands on the CPU);
* ``torch.cuda.Stream`` / ``Event`` / ``current_stream`` / ``default_stream`` / ``stream(...)`` -> inert objects;
* ``synchronize`` / ``set_device`` / ``empty_cache`` / nvtx push/pop -> no-ops;
* ``get_rng_state`` / ``set_rng_state`` / ``manual_seed`` -> the CPU generator's (megatron's RNG tracker forks
  these for tensor-parallel dropout regions);
* megatron-core's ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` returns a list when the tensor already is on
  the CPU (upstream returns a tensor, which gloo's ``all_to_all_single`` rejects as split sizes).

No math is touched: collectives, kernels and numerics stay the real ones. It is a no-op when CUDA is available,
and is never called by the GPU training path.
"""

from __future__ import annotations

import contextlib
import logging

import torch

_ENABLED = False


class _InertStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _InertEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _InertEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def cpu_compat_enabled() -> bool:
    return _ENABLED


def enable_cpu_compat() -> None:
    """Redirect megatron-core's CUDA-only calls to the CPU. Idempotent; does nothing if CUDA is available."""
    global _ENABLED
    if _ENABLED or torch.cuda.is_available():
        return
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.Stream = _InertStream
    cuda.Event = _InertEvent
    cuda.current_stream = lambda *a, **k: _InertStream()
    cuda.default_stream = lambda *a, **k: _InertStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.synchronize = lambda *a, **k: None
    cuda.set_device = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None
    cuda.nvtx.range = lambda *a, **k: contextlib.nullcontext()

    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def _set_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def _get_rng_state(*args, **kwargs):
        return torch.get_rng_state()

    mrandom._set_cuda_rng_state = _set_rng_state
    if hasattr(mrandom, "_get_cuda_rng_state"):
        mrandom._get_cuda_rng_state = _get_rng_state

    upstream = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if tensor is not None and as_numpy and tensor.device.type == "cpu":
            return tensor.numpy()
        return upstream(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    # with the redirect the "CUDA" generator *is* the CPU generator, so megatron's RNG tracker always sees the CPU
    # state change inside a fork and logs a warning that means nothing here
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)
    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    _ENABLED = True
