"""Build a Glm5Model for the current process (its PP stage / TP / EP rank), optionally loaded from HF weights."""

from __future__ import annotations

from typing import Callable, List, Optional

import torch

from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

from megatron_glm5.config import Glm5Config
# imported here, not lazily: a first import under ``with torch.device("meta")`` would create megatron's module-level
# tensors (MTPLossAutoScaler.main_loss_backward_scale) on the meta device
from megatron_glm5.models.model import Glm5Model


FAST_BACKENDS = {"kda_backend": "fla_fused", "dsa_backend": "fused", "moe_experts_backend": "grouped",
                 "moe_cuda_graph": True}
"""The CUDA fast path of each backend setting (what :func:`default_backends` picks where nothing is missing)."""

HOPPER = (9, 0)


def backend_fallbacks(device: str) -> dict:
    """Why :func:`default_backends` does not pick a setting's fast path on ``device``: ``{setting: one line}``,
    empty on a Hopper (sm_90) CUDA device with triton and FLA. Without CUDA every setting is the PyTorch reference;
    without ``triton`` the sparse MLA kernel and FLA are out; without FLA's ``fla.ops.kda`` the KDA layer runs its
    PyTorch chunked form; below compute capability 9.0 DSA runs the masked dense reference (the sparse MLA kernel
    and its tilings are written for sm_90: vector reductions, ~200 KiB of shared memory a program)."""
    if str(device).split(":")[0] != "cuda":
        return {k: "no CUDA device: the PyTorch reference" for k in FAST_BACKENDS}
    from megatron_glm5.errors import one_line

    out = {}
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure: say which
        why = f"'import triton' failed ({type(e).__name__}: {one_line(e, 160)}): the PyTorch reference"
        return {"dsa_backend": why, "kda_backend": why}
    major, minor = torch.cuda.get_device_capability(device) if torch.cuda.is_available() else HOPPER
    if (major, minor) < HOPPER:
        out["dsa_backend"] = (f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}; the sparse MLA kernel is "
                              f"tuned for sm_90 (Hopper): the masked dense reference, memory quadratic in length")
    try:
        import fla.ops.kda  # noqa: F401
    except Exception as e:  # noqa: BLE001
        out["kda_backend"] = (f"'import fla.ops.kda' failed ({type(e).__name__}: {one_line(e, 160)}); install "
                              f"flash-linear-attention==0.6.0 fla-core==0.6.0: the PyTorch chunked KDA")
    return out


def default_backends(device: str) -> dict:
    """Fast paths where they are available, on CUDA: the Triton sparse MLA kernel for DSA (on sm_90), grouped-GEMM
    experts and ``kda_backend='fla_fused'`` for KDA (FLA's conv / in-kernel gates / fused gated norm around
    chunk_kda); the PyTorch references (and megatron-core's SequentialMLP) elsewhere, for the reasons
    :func:`backend_fallbacks` gives (:func:`describe_backends` prints them). (The mHC, expert-GLU, RMSNorm and
    cross-entropy Triton kernels need no backend setting: they run whenever the tensors are on CUDA and triton is
    installed.) With 'fla_fused', ``kda_save_intermediates`` keeps ``chunk_kda``'s forward intermediates for its
    backward (H200, 2026-12-04: the 8K proxy step 279.3 -> 273.0 ms, peak +3.4 GiB for three KDA layers).
    ``moe_cuda_graph`` (the MoE layers as replayed CUDA graphs, ``models/cuda_graphs.py``) is on for CUDA: layers that
    cannot run as graphs (collectives inside the layer, aux losses, recompute) still run eagerly."""
    reference = {"kda_backend": "torch", "dsa_backend": "torch", "moe_experts_backend": "sequential",
                 "moe_cuda_graph": False}
    if str(device).split(":")[0] != "cuda":
        return reference
    fallbacks = backend_fallbacks(device)
    out = dict(reference, moe_experts_backend="grouped", moe_cuda_graph=True)
    if "dsa_backend" not in fallbacks:
        out["dsa_backend"] = "fused"
    if "kda_backend" not in fallbacks:
        out["kda_backend"] = "fla_fused"
        out["kda_save_intermediates"] = True
    return out


def describe_backends(config: Glm5Config, device: str) -> str:
    """The start-up table of what runs for ``config`` on ``device``: each backend setting with ``fast path`` or
    ``fallback: <one line why>`` (:func:`backend_fallbacks`; ``set by flag or config`` where the setting was chosen
    against an available fast path), the MoE CUDA graphs with what blocks them (``cuda_graphs.moe_graph_blockers``),
    and whether the Triton kernels (mHC, expert GLU, RMSNorm, cross entropy, short convolution, indexer scores)
    run."""
    from megatron_glm5.kernels.triton_support import HAVE_TRITON
    from megatron_glm5.models.cuda_graphs import moe_graph_blockers

    cuda = str(device).split(":")[0] == "cuda" and torch.cuda.is_available()
    where = (f"{torch.cuda.get_device_name(device)}, sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}"
             if cuda else "CPU")
    fallbacks = backend_fallbacks(device)
    lines = [f"megatron_glm5 backends ({where}):"]
    for key, fast in FAST_BACKENDS.items():
        value = getattr(config, key, None)
        if key == "moe_cuda_graph" and not config.num_moe_experts:
            state = "no MoE layers"
        elif key == "moe_cuda_graph" and value and moe_graph_blockers(config):
            state = f"fallback: the MoE layers run eagerly: graphs are blocked by {', '.join(moe_graph_blockers(config))}"
        elif value == fast:
            state = "fast path"
        elif key in fallbacks:
            state = f"fallback: {fallbacks[key]}"
        else:
            state = f"set by flag or config (fast path: {fast})"
        lines.append(f"  {key:<20} {str(value):<10} {state}")
    if not cuda:
        kernels = "fallback: no CUDA device: the PyTorch references"
    elif not HAVE_TRITON:
        kernels = "fallback: 'import triton' failed: the PyTorch references"
    else:
        kernels = "fast path"
    lines.append(f"  {'triton kernels':<20} {str(cuda and HAVE_TRITON):<10} {kernels} (mHC, expert GLU, RMSNorm, "
                 f"cross entropy, short convolution, indexer scores)")
    return "\n".join(lines)


def build_model(config: Glm5Config, pre_process: bool = True, post_process: bool = True,
                vp_stage: Optional[int] = None, parallel_output: bool = True):
    """Glm5Model for this rank (megatron parallel state must be initialised)."""
    model = Glm5Model(config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                      parallel_output=parallel_output)
    ensure_tp_attributes(model)
    return model


def build_model_chunks(config: Glm5Config, parallel_output: bool = True, for_training: bool = True) -> List[Glm5Model]:
    """This rank's model chunks, as megatron-LM's ``get_model`` builds them: one ``Glm5Model`` per virtual pipeline
    stage (a one-element list without virtual stages), each with ``pre_process`` / ``post_process`` of its stage
    (``parallel_state.is_pipeline_first_stage`` / ``is_pipeline_last_stage(ignore_virtual=False, vp_stage)``).

    The list is what megatron-core's ``get_forward_backward_func()`` schedules and ``DistributedDataParallel`` /
    ``get_megatron_optimizer`` take (wrap every chunk in DDP). Megatron's parallel state must be initialised with
    the config's sizes (``initialize_megatron(tp, pp, ep, cp, vpp, etp=...)``); a mismatch raises one line.
    ``for_training`` adds megatron-core's training-only layout rule (MoE with TP > 1 needs sequence parallelism).
    """
    from megatron.core import parallel_state as ps

    from megatron_glm5.models.parallel_layout import check_parallel_layout

    check_parallel_layout(config, for_training=for_training)
    vpp = config.virtual_pipeline_model_parallel_size
    state = {"tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
             "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
             "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
             "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size(),
             "context_parallel_size": ps.get_context_parallel_world_size(),
             "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size()}
    bad = [f"{k} {getattr(config, k)} vs {v}" for k, v in state.items()
           if (getattr(config, k) or 1) != (v or 1)]
    if bad:
        raise ValueError("the config and megatron's parallel state disagree: " + ", ".join(bad)
                         + " (initialize_megatron with the config's sizes)")
    chunks = []
    for v in range(vpp or 1):
        vp_stage = v if vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        chunks.append(build_model(config, pre_process=pre, post_process=post, vp_stage=vp_stage,
                                  parallel_output=parallel_output))
    return chunks


def ensure_tp_attributes(model: torch.nn.Module) -> None:
    """megatron-core sets ``tensor_model_parallel`` / ``partition_dim`` on its parallel layers' weights only inside
    its weight initialisers; with ``perform_initialization=False`` (weights about to be loaded) they are missing, and
    TP slicing, grad-norm dedup and checkpoint sharding need them. Set them where absent."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        w = getattr(module, "weight", None)
        if w is not None and not hasattr(w, "tensor_model_parallel"):
            w.tensor_model_parallel = True
            w.partition_dim = dim
            w.partition_stride = 1


def build_model_from_hf(hf_dir: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                        parallel_output: bool = False, log: Optional[Callable[[str], None]] = None, **overrides):
    """Config from ``hf_dir/config.json``, model built on ``device`` in ``dtype`` (fp32 islands kept), HF weights
    loaded (FP8 dequantised). Single process unless megatron parallel state is already initialised.

    A checkpoint without MTP weights whose config declares MTP (transformers' ``save_pretrained`` writes no MTP
    weights) builds the model without MTP; the notice goes to ``log``."""
    from megatron_glm5.checkpoint.hf_io import HFCheckpointReader, load_hf_checkpoint, mtp_notice
    from megatron_glm5.initialize import ensure_initialized

    ensure_initialized()
    kw = dict(default_backends(device))
    kw.update(use_cpu_initialization=True, perform_initialization=False, params_dtype=torch.float32)
    kw.update(overrides)
    cfg = Glm5Config.from_hf(hf_dir, **kw)
    reader = HFCheckpointReader(hf_dir)
    notice = mtp_notice(hf_dir, cfg, reader)
    if notice is not None:
        if log is not None:
            log(notice)
        cfg = Glm5Config.from_hf(hf_dir, **{**kw, "mtp_num_layers": None})
    if dtype == torch.bfloat16:
        cfg.bf16 = True
    model = build_model(cfg, parallel_output=parallel_output)
    load_hf_checkpoint(model, hf_dir, reader=reader)
    model.to_dtype(dtype)
    model.to(device)
    model.eval()
    return model


def build_meta_model(config, params_dtype: torch.dtype = torch.bfloat16, parallel_output: bool = True,
                     **overrides):
    """The TP=PP=EP=1 model with every tensor on the meta device: its ``sharded_state_dict()`` gives the exact
    checkpoint structure (keys, global shapes, expert axes, factories) at no memory cost (~3 s for the 321B model).

    ``config``: a Glm5Config, or an HF checkpoint dir / config.json path / dict (then built with ``params_dtype``,
    no initialisation, torch backends, ``overrides`` applied). A single-process parallel state is created
    when there is none. Everything the build imports is imported before entering the meta context, so module-level
    tensors created at import time (megatron's ``MTPLossAutoScaler.main_loss_backward_scale``) stay real.
    """
    import megatron_glm5.models.vision  # noqa: F401  (imported lazily by Glm5Model)
    from megatron_glm5.initialize import ensure_initialized

    if not isinstance(config, Glm5Config):
        config = Glm5Config.from_hf(config, use_cpu_initialization=True, perform_initialization=False,
                                    params_dtype=params_dtype, kda_backend="torch", dsa_backend="torch", **overrides)
    ensure_initialized(require_tp1=True, who="the meta-device model build")
    with torch.device("meta"):
        return build_model(config, parallel_output=parallel_output)
