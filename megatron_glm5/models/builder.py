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
from megatron_glm5.execution_plan import (  # noqa: F401 (the plan's names, as the tools and tests know them here)
    FAST_BACKENDS,
    HOPPER,
    backend_fallbacks,
    default_backends,
    resolve_execution_plan,
)
# imported here, not lazily: a first import under ``with torch.device("meta")`` would create megatron's module-level
# tensors (MTPLossAutoScaler.main_loss_backward_scale) on the meta device
from megatron_glm5.models.model import Glm5Model


def describe_backends(config: Glm5Config, device: str) -> str:
    """The start-up table of what runs for ``config`` on ``device``: :meth:`ExecutionPlan.table` of the plan
    :func:`~megatron_glm5.execution_plan.resolve_execution_plan` gives (each setting with ``fast path``,
    ``fallback: <one line why>`` or ``set by flag or config``)."""
    return resolve_execution_plan(config, device).table()


def build_model(config: Glm5Config, pre_process: bool = True, post_process: bool = True,
                vp_stage: Optional[int] = None, parallel_output: bool = True):
    """Glm5Model for this rank (megatron parallel state must be initialised). A config without an execution plan gets
    the plan of this process's device (:func:`~megatron_glm5.execution_plan.resolve_execution_plan`)."""
    if config.execution_plan is None:
        config.execution_plan = resolve_execution_plan(config)
    model = Glm5Model(config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                      parallel_output=parallel_output)
    ensure_tp_attributes(model)
    if config.dsa_indexer_warmup:  # the indexer's dense warm-up: nothing but the indexers trains
        for name, p in model.named_parameters():
            if ".indexer." not in name:
                p.requires_grad_(False)
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

    from megatron_glm5.config.parallelism import check_parallel_layout

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
    kw = dict(use_cpu_initialization=True, perform_initialization=False, params_dtype=torch.float32)
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
    cfg.execution_plan = resolve_execution_plan(cfg, device)
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
