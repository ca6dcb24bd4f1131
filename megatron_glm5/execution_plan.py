"""What runs: every backend, kernel, CUDA-graph and fused switch of the model, decided in one place.

:func:`resolve_execution_plan` reads the config (its backend fields: ``None`` lets the plan choose, a value is kept
as given), the device (CUDA or not, its compute capability, triton and flash-linear-attention importable), the
dtype and the parallel layout, and returns an :class:`ExecutionPlan`. The modules read their switches from the
plan (``self.plan``, taken from ``config.execution_plan`` when they are built; :func:`plan_of`), never from class
attributes or the backend fields themselves; a per-call check that remains in a module is about the tensor in hand
(a CUDA tensor, its dtype and shape), not a choice. :meth:`ExecutionPlan.table` is the start-up table: one row per
switch, each fallback with its reason.

Choices where the config leaves them open (``None``):

* ``kda_backend``: ``'fla_fused'`` on CUDA with triton and FLA for a bf16 / fp16 model, else ``'torch'``; in fp32
  ``'torch'`` too: FLA's KDA kernels take their fp32 dots as TF32 products (~5e-4 relative; ``'fla_fused'``'s gate
  and norm kernels ~10x more), which moves the small gradients of the mHC scales by several percent against the fp32
  reference (``tests/test_gpu_model_parity.py``); ``kda_save_intermediates`` on with ``'fla_fused'``;
* ``dsa_backend``: ``'fused'`` (the Triton sparse MLA kernel) on sm_90 and later with triton, else ``'torch'``;
* ``moe_experts_backend``: ``'grouped'`` on CUDA where the experts fit grouped GEMMs (bf16, gated, no bias, expert
  TP 1, no FP8), else ``'sequential'``;
* ``moe_cuda_graph``: on for CUDA; the MoE layers then run as replayed graphs unless something blocks them
  (:func:`moe_graph_blockers`), in which case they run eagerly and the table says what blocks them;
* the Triton kernels of the per-token ops (RMSNorm, mHC, Sinkhorn, expert GLU, cross entropy, indexer scores,
  gather-sum) run on CUDA tensors when triton imports.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import List, Optional, Tuple

import torch

from megatron_glm5.errors import one_line

FAST_BACKENDS = {"kda_backend": "fla_fused", "dsa_backend": "fused", "moe_experts_backend": "grouped",
                 "moe_cuda_graph": True}
"""The CUDA fast path of each backend setting."""
HOPPER = (9, 0)
TRITON_KERNELS = "mHC, expert GLU, RMSNorm, cross entropy, short convolution, indexer scores"
INDEXER_SCORE_CHUNK_ELEMENTS = 1 << 25
"""Elements of one query chunk's indexer score block (bounds the indexer's memory at long sequence lengths)."""


def _is_cuda(device) -> bool:
    return str(device).split(":")[0] == "cuda"


def default_device() -> str:
    """The device this process builds its model for: ``'cuda'`` where a GPU is visible, else ``'cpu'``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _capability(device, capability: Optional[Tuple[int, int]]) -> Tuple[int, int]:
    if capability is not None:
        return tuple(capability)
    return tuple(torch.cuda.get_device_capability(device)) if torch.cuda.is_available() else HOPPER


def backend_fallbacks(device, capability: Optional[Tuple[int, int]] = None) -> dict:
    """Why a backend setting's fast path is not available on ``device``: ``{setting: one line}``, empty on a Hopper
    (sm_90) CUDA device with triton and FLA. Without CUDA every setting is the PyTorch reference; without ``triton``
    the sparse MLA kernel and FLA are out; without FLA's ``fla.ops.kda`` the KDA layer runs its PyTorch chunked form;
    below compute capability 9.0 DSA runs the masked dense reference (the sparse MLA kernel and its tilings are
    written for sm_90: vector reductions, ~200 KiB of shared memory a program). ``capability`` stands in for the
    device's (tests)."""
    if not _is_cuda(device):
        return {k: "no CUDA device: the PyTorch reference" for k in FAST_BACKENDS}
    out = {}
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure: say which
        why = f"'import triton' failed ({type(e).__name__}: {one_line(e, 160)}): the PyTorch reference"
        return {"dsa_backend": why, "kda_backend": why}
    major, minor = _capability(device, capability)
    if (major, minor) < HOPPER:
        out["dsa_backend"] = (f"{_device_name(device)} is sm_{major}{minor}; the sparse MLA kernel is "
                              f"tuned for sm_90 (Hopper): the masked dense reference, memory quadratic in length")
    try:
        import fla.ops.kda  # noqa: F401
    except Exception as e:  # noqa: BLE001
        out["kda_backend"] = (f"'import fla.ops.kda' failed ({type(e).__name__}: {one_line(e, 160)}); install "
                              f"flash-linear-attention==0.6.0 fla-core==0.6.0: the PyTorch chunked KDA")
    return out


def default_backends(device, capability: Optional[Tuple[int, int]] = None,
                     dtype: torch.dtype = torch.bfloat16) -> dict:
    """The backend settings (the keys of :data:`FAST_BACKENDS` and ``kda_save_intermediates``) that
    :func:`resolve_execution_plan` picks on ``device`` for a model computing in ``dtype`` whose config leaves them
    open: read off the plan itself, so they are what a config with ``None`` in those fields runs. bf16 on sm_90
    with triton and FLA: the fast paths; elsewhere the fallbacks the plan's table names."""
    plan = resolve_execution_plan(SimpleNamespace(bf16=dtype == torch.bfloat16, params_dtype=dtype), device,
                                  capability=capability)
    return {**{key: getattr(plan, key) for key in FAST_BACKENDS}, "kda_save_intermediates": plan.kda_save_intermediates}


def moe_graph_blockers(config, sizes: Optional[dict] = None) -> List[str]:
    """Why an MoE layer built from ``config`` cannot run as CUDA graphs (empty: it can). Graphs hold no
    collectives here (no EP / expert-TP / TP / CP communication inside the layer, nor the global aux loss's
    reduction over the data-parallel group), no host-side loop (sinkhorn routing), no token dropping (capacity) and
    no activation recompute (the recompute pass would capture inside autograd's backward). The per-batch aux loss,
    the sequence aux loss and the z-loss are captured: their logging adds into megatron-core's metrics tracker in
    place, and the backward reads ``MoEAuxLossAutoScaler``'s loss scale in place (``models/cuda_graphs.py``).
    ``sizes``: the parallel sizes of the process groups (``{config field: size}``) where they are known, else the
    config's."""
    out = []
    for name in ("expert_model_parallel_size", "expert_tensor_parallel_size", "tensor_model_parallel_size",
                 "context_parallel_size"):
        size = (sizes or {}).get(name, getattr(config, name, 1))
        if (size or 1) != 1:
            out.append(f"{name}={size}")
    if "global_aux_loss" in aux_loss_types(config):
        out.append("the global aux loss (it reduces over the data-parallel group inside the layer)")
    if "sinkhorn" in _load_balancing_types(config):
        out.append("sinkhorn routing (its convergence loop runs on the host)")
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        out.append("token dropping (moe_expert_capacity_factor)")
    if getattr(config, "moe_router_force_load_balancing", False) or getattr(config, "moe_input_jitter_eps", None):
        out.append("random routing")
    if getattr(config, "recompute_granularity", None) is not None:
        out.append(f"recompute_granularity={config.recompute_granularity}")
    if getattr(config, "moe_shared_expert_overlap", False):
        out.append("moe_shared_expert_overlap")
    return out


def _load_balancing_types(config) -> List[str]:
    """``moe_router_load_balancing_type`` as a list (megatron-core takes one name or a list of them)."""
    kind = getattr(config, "moe_router_load_balancing_type", None) or "none"
    return list(kind) if isinstance(kind, (list, tuple)) else [kind]


def aux_loss_types(config) -> List[str]:
    """The load-balancing losses the router adds (``aux_loss``, ``seq_aux_loss``, ``global_aux_loss``): the listed
    types whose ``moe_aux_loss_coeff`` (one number, or one per type) is non-zero."""
    types = _load_balancing_types(config)
    coeffs = getattr(config, "moe_aux_loss_coeff", 0.0) or 0.0
    coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(types)
    return [t for t, c in zip(types, coeffs) if t in ("aux_loss", "seq_aux_loss", "global_aux_loss") and c]


def grouped_experts_blockers(config, dtype: torch.dtype, sizes: Optional[dict] = None) -> List[str]:
    """Why the routed experts of ``config`` cannot run as grouped GEMMs on CUDA in ``dtype`` (empty: they can)."""
    out = []
    if not hasattr(torch, "_grouped_mm"):
        out.append(f"torch {torch.__version__} has no torch._grouped_mm")
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        out.append("FP8 / FP4 training")
    if getattr(config, "moe_apply_probs_on_input", False):
        out.append("moe_apply_probs_on_input")
    if not getattr(config, "gated_linear_unit", True):
        out.append("a non-gated expert MLP")
    if getattr(config, "add_bias_linear", False):
        out.append("expert biases")
    etp = (sizes or {}).get("expert_tensor_parallel_size", getattr(config, "expert_tensor_parallel_size", 1))
    if (etp or 1) > 1:
        out.append(f"expert_tensor_parallel_size={etp}")
    if dtype != torch.bfloat16:
        out.append(f"{_dtype_name(dtype)} (the grouped GEMMs run in bf16)")
    return out


def _device_name(device) -> str:
    return torch.cuda.get_device_name(device) if torch.cuda.is_available() else str(device)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


def model_dtype(config) -> torch.dtype:
    """The dtype the model computes in: bf16 under ``config.bf16``, else ``params_dtype``."""
    if getattr(config, "bf16", False):
        return torch.bfloat16
    return getattr(config, "params_dtype", None) or torch.float32


@dataclass(frozen=True)
class ExecutionPlan:
    """What runs, for one model config on one device (see the module docstring). Frozen: a variant is
    ``dataclasses.replace(plan, field=value)`` (the tests and benchmarks compare paths that way)."""

    device: str
    """``'cpu'`` or ``'cuda'``."""
    where: str
    """The device in words (``'CPU'`` or ``'NVIDIA H200, sm_90'``)."""
    dtype: torch.dtype
    """The dtype the model computes in."""
    kda_backend: str
    """KDA: ``'torch'``, ``'fla'`` or ``'fla_fused'``."""
    kda_conv_kernel: str
    """``'fla_fused'`` KDA's short convolution: ``'triton'`` (``kernels/short_conv.py``) or ``'fla'``."""
    kda_save_intermediates: bool
    """``'fla_fused'``: keep ``chunk_kda``'s forward intermediates for its backward."""
    dsa_backend: str
    """DSA: ``'torch'``, ``'sparse'`` or ``'fused'``."""
    moe_experts_backend: str
    """Routed experts: ``'sequential'`` or ``'grouped'``."""
    moe_cuda_graph: bool
    """The MoE layers are built with CUDA-graph wrappers."""
    moe_graph_blockers: Tuple[str, ...]
    """Why the wrappers run the layers eagerly (empty: they replay graphs on CUDA)."""
    mhc_stream_grad_fusion: bool
    """Fused mHC: the streams gradient of a site's output side added inside the input side's backward kernel."""
    triton_kernels: bool
    """The Triton kernels of the per-token ops run on CUDA tensors (RMSNorm, mHC, Sinkhorn, GLU, CE, gather-sum)."""
    rms_norm_fused: bool
    """RMSNorm through ``kernels/rms_norm.py`` on CUDA tensors it fits."""
    mhc_fused: bool
    """mHC sites through ``kernels/mhc.py`` / ``kernels/sinkhorn.py`` on CUDA tensors."""
    indexer_fused_scores: bool
    """The KPool indexer's scores through ``kernels/indexer_scores.py`` on CUDA tensors."""
    indexer_fuse_topk_keys: bool
    """The indexer's masking and top-k sort keys inside the score kernel."""
    indexer_score_chunk_elements: int
    """Elements of one query chunk's indexer score block."""
    grouped_experts_on_cpu: bool
    """Grouped experts take ``torch._grouped_mm`` on CPU tensors too (its CPU kernel; tests of the arithmetic)."""
    rows: Tuple[Tuple[str, str, str], ...] = ()
    """The table: ``(setting, value, state)``, state ``'fast path'``, ``'fallback: <why>'`` or ``'set by flag or
    config (fast path: <value>)'``."""

    def replace(self, **changes) -> "ExecutionPlan":
        """This plan with ``changes``."""
        return dataclasses.replace(self, **changes)

    def table(self) -> str:
        """The start-up table: ``megatron_glm5 backends (<device>):`` and one row per setting; where Triton kernels
        run, a last line on what the first step compiles and where Triton keeps it."""
        lines = [f"megatron_glm5 backends ({self.where}):"]
        lines += [f"  {key:<20} {value:<10} {state}" for key, value, state in self.rows]
        if self.triton_kernels:
            from megatron_glm5.kernels.triton_support import cache_dir

            lines.append(f"  the first step compiles the Triton kernels (and tunes FLA's) not yet in Triton's cache "
                         f"({cache_dir()}): minutes on a fresh machine")
        return "\n".join(lines)


def _sizes(process_groups) -> Optional[dict]:
    """``{config field: size}`` of a megatron-core ``ProcessGroupCollection`` (None: use the config's)."""
    if process_groups is None:
        return None
    out = {}
    for field, attr in (("tensor_model_parallel_size", "tp"), ("context_parallel_size", "cp"),
                        ("expert_model_parallel_size", "ep"), ("expert_tensor_parallel_size", "expt_tp")):
        group = getattr(process_groups, attr, None)
        if group is not None:
            out[field] = group.size()
    return out


def resolve_execution_plan(config, device=None, process_groups=None,
                           capability: Optional[Tuple[int, int]] = None) -> ExecutionPlan:
    """The :class:`ExecutionPlan` of ``config`` on ``device`` (default :func:`default_device`), with the parallel
    sizes of ``process_groups`` (a megatron-core ``ProcessGroupCollection``; None: the config's). ``capability``
    stands in for the CUDA device's compute capability (tests of the GPU plan on a CPU machine)."""
    from megatron_glm5.kernels.short_conv import MAX_TAPS
    from megatron_glm5.kernels.triton_support import HAVE_TRITON

    device = str(device if device is not None else default_device())
    cuda = _is_cuda(device)
    dtype = model_dtype(config)
    sizes = _sizes(process_groups)
    if cuda:
        major, minor = _capability(device, capability)
        where = f"{_device_name(device)}, sm_{major}{minor}"
    else:
        where = "CPU"
    fallbacks = backend_fallbacks(device, capability)
    has_moe = bool(getattr(config, "num_moe_experts", None))
    rows = []
    chosen = {}

    def pick(key: str, auto_value, auto_why: Optional[str], fast_runs_as: Optional[str] = None):
        """The config's value if it sets one, else ``auto_value``; its table row. ``fast_runs_as``: what the fast
        value, set by flag or config, falls back to where it cannot run here (None: it runs)."""
        fast = FAST_BACKENDS[key]
        value = getattr(config, key, None)
        if value is None:
            value = auto_value
            state = "fast path" if value == fast else f"fallback: {auto_why}"
        elif value == fast:
            state = "fast path" if fast_runs_as is None else f"fallback: {fast_runs_as}"
        elif key in fallbacks:
            state = f"fallback: {fallbacks[key]}"
        else:
            state = f"set by flag or config (fast path: {fast})"
        chosen[key] = value
        rows.append((key, str(value), state))
        return value

    # KDA
    if "kda_backend" in fallbacks:
        kda = pick("kda_backend", "torch", fallbacks["kda_backend"])
    elif dtype == torch.float32:
        kda = pick("kda_backend", "torch", "fp32: FLA's KDA kernels take TF32 products; the PyTorch chunked KDA "
                                           "keeps fp32")
    else:
        kda = pick("kda_backend", "fla_fused", None)
    conv = getattr(config, "kda_conv_kernel", None) or "triton"
    width = getattr(config, "linear_conv_kernel_dim", 4)
    if conv == "triton" and width > MAX_TAPS:
        conv_state = f"fallback: the convolution has {width} taps, the Triton kernel takes up to {MAX_TAPS}"
        conv = "fla"
    else:
        conv_state = "fast path" if conv == "triton" else "set by flag or config (fast path: triton)"
    save = getattr(config, "kda_save_intermediates", None)
    save = (kda == "fla_fused") if save is None else bool(save)
    if kda == "fla_fused":
        rows.append(("kda_conv_kernel", conv, conv_state))
        rows.append(("kda_save_intermediates", str(save), "fast path" if save else "set by flag or config (fast "
                                                                                   "path: True)"))
    # DSA
    dsa = pick("dsa_backend", "torch" if "dsa_backend" in fallbacks else "fused", fallbacks.get("dsa_backend"))
    # MoE experts
    blocked = grouped_experts_blockers(config, dtype, sizes) if cuda else []
    if not cuda:
        experts = pick("moe_experts_backend", "sequential", fallbacks["moe_experts_backend"])
    else:
        why = "grouped GEMMs are blocked by " + ", ".join(blocked)
        experts = pick("moe_experts_backend", "sequential" if blocked else "grouped",
                       "megatron-core's SequentialMLP: " + why,
                       "GroupedExperts runs megatron-core's SequentialMLP: " + why if blocked else None)
    # MoE CUDA graphs
    blockers = tuple(moe_graph_blockers(config, sizes))
    value = getattr(config, "moe_cuda_graph", None)
    graphs = cuda if value is None else bool(value)
    # experts that run megatron-core's SequentialMLP (chosen, or 'grouped' where GroupedExperts falls back to it)
    # read the token counts on the host, which no capture takes; fixed by the build, unlike the config's blockers
    # (asked again each step): no graphs at all
    sequential = has_moe and cuda and graphs and (experts != "grouped" or bool(blocked))
    if sequential:
        blockers += ("the sequential experts (megatron-core's SequentialMLP reads the token counts on the host)",)
        graphs = False
    if not has_moe:
        state = "no MoE layers"
    elif (graphs or sequential) and blockers:
        state = f"fallback: the MoE layers run eagerly: graphs are blocked by {', '.join(blockers)}"
    elif graphs:
        state = "fast path" if cuda else f"fallback: {fallbacks['moe_cuda_graph']}: the MoE layers run eagerly"
    elif value is None or not cuda:
        state = f"fallback: {fallbacks.get('moe_cuda_graph', 'no CUDA device')}"
    else:
        state = "set by flag or config (fast path: True)"
    rows.append(("moe_cuda_graph", str(graphs), state))
    # per-token Triton kernels
    triton_kernels = cuda and HAVE_TRITON
    if not cuda:
        state = "fallback: no CUDA device: the PyTorch references"
    elif not HAVE_TRITON:
        state = "fallback: 'import triton' failed: the PyTorch references"
    else:
        state = "fast path"
    rows.append(("triton kernels", str(triton_kernels), f"{state} ({TRITON_KERNELS})"))
    fusion = bool(getattr(config, "mhc_stream_grad_fusion", False))
    if fusion:
        rows.append(("mhc_stream_grad_fusion", str(fusion), "fast path" if triton_kernels else
                     "fallback: runs with the fused mHC kernels only"))
    rows.append(("dtype", _dtype_name(dtype), "bf16 model" if dtype == torch.bfloat16 else "fp32 model"))
    return ExecutionPlan(
        device="cuda" if cuda else "cpu", where=where, dtype=dtype, kda_backend=kda, kda_conv_kernel=conv,
        kda_save_intermediates=save, dsa_backend=dsa, moe_experts_backend=experts, moe_cuda_graph=graphs,
        moe_graph_blockers=blockers, mhc_stream_grad_fusion=fusion, triton_kernels=triton_kernels,
        rms_norm_fused=triton_kernels, mhc_fused=triton_kernels, indexer_fused_scores=triton_kernels,
        indexer_fuse_topk_keys=False, indexer_score_chunk_elements=INDEXER_SCORE_CHUNK_ELEMENTS,
        grouped_experts_on_cpu=False, rows=tuple(rows))


def plan_of(config) -> ExecutionPlan:
    """The plan the modules of ``config`` run: ``config.execution_plan`` (set by ``build_model``), resolved for
    :func:`default_device` and kept on the config when it has none yet; ``config=None`` (a module built without a
    config): the process's plan of the per-token kernels."""
    if config is None:
        if _PROCESS_PLAN.get(default_device()) is None:
            _PROCESS_PLAN[default_device()] = resolve_execution_plan(None)
        return _PROCESS_PLAN[default_device()]
    plan = getattr(config, "execution_plan", None)
    if plan is None:
        plan = config.execution_plan = resolve_execution_plan(config)
    return plan


_PROCESS_PLAN = {}  # device -> the plan of modules built without a config
