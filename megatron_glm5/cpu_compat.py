"""The one place that lets megatron-core run on a CPU-only machine (tests and the CPU quickstart).

megatron-core calls a few CUDA-only APIs unconditionally: ``torch.cuda.current_device()`` as an allocation device,
``torch.cuda.Stream``/``Event`` objects in the MoE dispatcher, the CUDA RNG state in its RNG tracker, and literal
``device="cuda"`` tensors in the pipeline schedules. ``enable_cpu_compat()`` redirects exactly these to the CPU:

* ``torch.cuda.current_device`` -> ``"cpu"`` (so ``torch.empty(..., device=current_device())`` lands on the CPU);
* ``torch.cuda.Stream`` / ``Event`` / ``current_stream`` / ``default_stream`` / ``stream(...)`` -> inert objects;
* ``synchronize`` / ``set_device`` / ``empty_cache`` / nvtx push/pop -> no-ops;
* ``get_rng_state`` / ``set_rng_state`` / ``manual_seed`` -> the CPU generator's (megatron's RNG tracker forks
  these for tensor-parallel dropout regions);
* megatron-core's ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` returns a numpy array when the tensor already
  is on the CPU, as upstream does for a CUDA tensor (upstream returns the CPU tensor itself, which gloo's
  ``all_to_all_single`` rejects as split sizes; the dispatcher also calls ``.tolist()`` on some of them);
* literal ``device="cuda"`` tensor factories (``torch.zeros(..., device="cuda")`` and friends) in the megatron-core
  modules of the training path (optimizer, grad clipping, DDP buffers, pipeline schedules, MoE / MTP trackers)
  create the tensor on the CPU: those modules see a ``torch`` whose factories map a CUDA device to the CPU;
* ``Tensor.cuda()`` returns the tensor itself (it stays on the CPU);
* ``Tensor.type()`` (no arguments) of a CPU tensor names the CUDA type (``torch.cuda.FloatTensor``): megatron's
  optimizers dispatch on these names (fp32 vs bf16 params, asserting fp32 grads); dtype checks stay exact;
* megatron-core's uneven all-gather / reduce-scatter along the first dim (``output_split_sizes`` /
  ``input_split_sizes``: the MoE dispatcher's expert-tensor-parallel exchange) use list collectives that gloo only
  supports with equal sizes: they run as an all-gather of row-padded equal blocks (then trimmed) and as an
  all-reduce followed by this rank's slice (the same sums);
* ``Tensor.cuda()`` of a CPU tensor returns the tensor itself (megatron's ``LanguageModule`` moves the embedding
  copy of the first / last pipeline stage with ``.cuda()`` before all-reducing it).

No math is touched: collectives, kernels and numerics stay the real ones. It is a no-op when CUDA is available,
and is never called by the GPU training path: its callers (the training entry, ``initialize_megatron``, the tests)
enable it only where ``torch.cuda.is_available()`` is False. Each redirect is bound through
:func:`megatron_glm5.extensions.apply` (records ``cpu_cuda_redirects`` and ``cpu_megatron``).
"""

from __future__ import annotations

import collections
import contextlib
import os
import logging

import torch

_ENABLED = False

# megatron-core modules of the training path that create tensors with a literal device="cuda" (their ``torch`` is
# in the cpu_megatron record of megatron_glm5.extensions)
from megatron_glm5.extensions import CUDA_LITERAL_MODULES as _CUDA_LITERAL_MODULES  # noqa: E402
from megatron_glm5.extensions import TRAINING_CUDA_LITERAL_MODULES as _TRAINING_CUDA_LITERAL_MODULES  # noqa: E402

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor")


def _bind(record: str, owner, attr: str, new) -> None:
    """``owner.attr = new`` through :func:`megatron_glm5.extensions.apply` (``record``: the registry record)."""
    from megatron_glm5 import extensions

    extensions.apply(extensions.BY_NAME[record], new, owner=owner, attr=attr)


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return "cpu"
    if str(device).startswith("cuda"):
        return "cpu"
    return device


class _CpuFactoryTorch:
    """``torch`` as seen by a megatron-core module on a CPU machine: every attribute is torch's own, except the
    tensor factories, whose CUDA ``device`` argument becomes the CPU."""

    def __init__(self, torch_module):
        self._torch = torch_module

    def __getattr__(self, name):
        attr = getattr(self._torch, name)
        if name in _FACTORIES:
            def factory(*args, _f=attr, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _cpu_device(kwargs["device"])
                return _f(*args, **kwargs)
            return factory
        return attr


def _install_cpu_factories() -> None:
    import importlib

    proxy = _CpuFactoryTorch(torch)
    for name in _CUDA_LITERAL_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is torch:
            _bind("cpu_megatron", module, "torch", proxy)


def _install_cuda_type_names() -> None:
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    _bind("cpu_cuda_redirects", torch.Tensor, "type", type_)


def _install_tensor_cuda_stays() -> None:
    """``Tensor.cuda()`` returns the tensor itself: it stays where it is (the CPU; the distributed optimizer's
    checkpoint gather, the embedding copy of ``LanguageModule``)."""

    def cuda(self, *args, **kwargs):
        return self

    _bind("cpu_cuda_redirects", torch.Tensor, "cuda", cuda)


def _install_uneven_first_dim_collectives() -> None:
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        rows = max(int(n) for n in output_split_sizes)
        padded = input_.new_zeros((rows,) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        blocks = [torch.empty_like(padded) for _ in range(group.size())]
        torch.distributed.all_gather(blocks, padded.contiguous(), group=group)
        return torch.cat([b[: int(n)] for b, n in zip(blocks, output_split_sizes)], dim=0)

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(int(n) for n in input_split_sizes[: group.rank()])
        return total[start:start + int(input_split_sizes[group.rank()])].contiguous()

    _bind("cpu_megatron", mappings, "_gather_along_first_dim", gather_along_first_dim)
    _bind("cpu_megatron", mappings, "_reduce_scatter_along_first_dim", reduce_scatter_along_first_dim)


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
    """Redirect megatron-core's CUDA-only calls to the CPU. Idempotent; does nothing if CUDA is available. Refuses
    (one line, :class:`~megatron_glm5.mcore_version.UnsupportedMegatronCore`) a megatron-core outside
    :data:`~megatron_glm5.mcore_version.TRAINER_VERSIONS`."""
    global _ENABLED
    if _ENABLED or torch.cuda.is_available():
        return
    from megatron_glm5 import extensions

    extensions.guard(extensions.BY_NAME["cpu_cuda_redirects"])
    cuda = torch.cuda
    _bind("cpu_cuda_redirects", cuda, "current_device", lambda: "cpu")
    _bind("cpu_cuda_redirects", cuda, "Stream", _InertStream)
    _bind("cpu_cuda_redirects", cuda, "Event", _InertEvent)
    _bind("cpu_cuda_redirects", cuda, "current_stream", lambda *a, **k: _InertStream())
    _bind("cpu_cuda_redirects", cuda, "default_stream", lambda *a, **k: _InertStream())
    _bind("cpu_cuda_redirects", cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    _bind("cpu_cuda_redirects", cuda, "synchronize", lambda *a, **k: None)
    _bind("cpu_cuda_redirects", cuda, "set_device", lambda *a, **k: None)
    _bind("cpu_cuda_redirects", cuda, "empty_cache", lambda *a, **k: None)
    _bind("cpu_cuda_redirects", cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    _bind("cpu_cuda_redirects", cuda, "set_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    _bind("cpu_cuda_redirects", cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)))
    _bind("cpu_cuda_redirects", cuda.nvtx, "range_push", lambda *a, **k: None)
    _bind("cpu_cuda_redirects", cuda.nvtx, "range_pop", lambda *a, **k: None)
    _bind("cpu_cuda_redirects", cuda.nvtx, "range", lambda *a, **k: contextlib.nullcontext())

    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def _set_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def _get_rng_state(*args, **kwargs):
        return torch.get_rng_state()

    _bind("cpu_megatron", mrandom, "_set_cuda_rng_state", _set_rng_state)
    if hasattr(mrandom, "_get_cuda_rng_state"):
        _bind("cpu_megatron", mrandom, "_get_cuda_rng_state", _get_rng_state)

    upstream = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if tensor is not None and as_numpy and tensor.device.type == "cpu":
            return tensor.numpy()
        return upstream(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _bind("cpu_megatron", moe_utils, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    # with the redirect the "CUDA" generator *is* the CPU generator, so megatron's RNG tracker always sees the CPU
    # state change inside a fork and logs a warning that means nothing here
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)
    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        _bind("cpu_megatron", token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    _install_cpu_factories()
    _install_cuda_type_names()
    _install_tensor_cuda_stays()
    _install_uneven_first_dim_collectives()
    _install_megatron_training()
    _ENABLED = True


# ---------------------------------------------------------------------------- megatron.training (Megatron-LM's trainer)
# _TRAINING_CUDA_LITERAL_MODULES: its modules that create tensors with a literal device="cuda" (start-time and loss
# all-reduces, the data-loader flags broadcast, RNG / rerun state gathers of the checkpoint)


class _CpuAsOneDevice:
    """``torch.cuda`` as seen by ``megatron.training.initialize``, which builds the model-parallel groups only when
    it counts a device: the CPU counts as one; everything else is ``torch.cuda``'s own (redirected above)."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def device_count() -> int:
        return 1


class _InitializeTorch(_CpuFactoryTorch):
    cuda = _CpuAsOneDevice()


def _install_megatron_training() -> None:
    """Megatron-LM's trainer on the CPU: ``pretrain`` initialises with ``allow_no_cuda=True`` (gloo comes from
    ``--distributed-backend``) and builds the model-parallel groups, its literal CUDA tensors are created on the
    CPU, the warm-up of its CUDA fusion kernels is skipped, its argument checks see no GPU architecture, and the CUDA
    memory statistics it logs read 0 (no CUDA memory is in use)."""
    import importlib
    import sys

    try:
        from megatron.training import training
    except ImportError:  # megatron-core without megatron.training
        return
    from functools import partial

    from megatron.training import initialize

    from megatron_glm5 import extensions

    if not extensions.installed(training, "initialize_megatron"):
        no_cuda = partial(initialize.initialize_megatron, allow_no_cuda=True)
        _bind("cpu_megatron", training, "initialize_megatron", no_cuda)
    proxy = _CpuFactoryTorch(torch)
    for name in _TRAINING_CUDA_LITERAL_MODULES:
        module = sys.modules.get(name)
        if module is None:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
        if getattr(module, "torch", None) is torch:
            _bind("cpu_megatron", module, "torch", proxy)
    _bind("cpu_megatron", initialize, "torch", _InitializeTorch(torch))
    # its argument checks read the GPU's architecture (CUDA_DEVICE_MAX_CONNECTIONS=1 is required below Blackwell
    # with TP / CP, for CUDA stream ordering): a CPU has no architecture and no CUDA streams to order
    from megatron.training import arguments as megatron_arguments

    _bind("cpu_megatron", megatron_arguments, "get_device_arch_version", lambda: 0)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # the warm-up of megatron's CUDA fusion kernels (bias-GeLU, bias-dropout-add) on CUDA tensors: nothing to warm
    _bind("cpu_megatron", training, "set_jit_fusion_options", lambda *a, **k: None)
    cuda = torch.cuda
    for stat in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        _bind("cpu_cuda_redirects", cuda, stat, lambda *a, **k: 0)
    _bind("cpu_cuda_redirects", cuda, "reset_peak_memory_stats", lambda *a, **k: None)
    _bind("cpu_cuda_redirects", cuda, "memory_stats", lambda *a, **k: collections.defaultdict(int))
