"""Model, optimizer and scheduler of a training run, on megatron-core's parts (Megatron-LM's
``setup_model_and_optimizer``): one model chunk per virtual pipeline stage, megatron's bf16 ``Float16Module``,
``DistributedDataParallel`` with contiguous grad buffers, ``get_megatron_optimizer`` (fp32 master weights, optional
distributed optimizer) and ``OptimizerParamScheduler``.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, List

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.enums import ModelType
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
from megatron.core.optimizer.optimizer_config import ParamKey
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module

from megatron_glm5.training.logger import print_rank_0


def unwrap_model(model):
    """The Glm5Model inside DDP / Float16Module wrappers (a list in, a list out)."""
    if isinstance(model, list):
        return [unwrap_model(m) for m in model]
    while isinstance(model, (DistributedDataParallel, Float16Module)):
        model = model.module
    return model


def get_model(model_provider: Callable, config, args) -> List[torch.nn.Module]:
    """Build this rank's model chunks (one per virtual pipeline stage), cast and wrap them in DDP.

    ``model_provider(pre_process, post_process, vp_stage)`` returns the unwrapped model of one stage.
    """
    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = model_provider(pre_process=pre, post_process=post, vp_stage=vp_stage)
        model.model_type = ModelType.encoder_or_decoder
        chunks.append(model)
    for model in chunks:
        for param in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if args.freeze_vision and getattr(model, "vision_model", None) is not None:
            for param in model.vision_model.parameters():
                param.requires_grad_(False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    chunks = [m.to(device) for m in chunks]
    if config.bf16:
        # Glm5Model keeps its fp32 islands in fp32 through the wrapper's ``.bfloat16()``
        chunks = [Float16Module(config, m) for m in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather, use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=False, bucket_size=None if args.overlap_grad_reduce else None)
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=m, disable_bucketing=(i > 0))
            for i, m in enumerate(chunks)]


def get_optimizer(model: List[torch.nn.Module], config, args, timers=None):
    """megatron-core optimizer (Adam with decoupled weight decay, fp32 master weights under bf16, grad clipping,
    distributed optimizer with --use-distributed-optimizer)."""
    opt_config = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        bf16=config.bf16, params_dtype=torch.float32, use_distributed_optimizer=args.use_distributed_optimizer,
        log_num_zeros_in_grad=True, timers=timers)
    # under bf16 the fp32 islands get param groups of their own: megatron-core 0.16.1's mixed-precision optimizers pair fp32
    # master weights with model parameters by position inside a group, which a group mixing bf16 and fp32
    # parameters breaks (in its checkpoints)
    if not config.bf16:
        optimizer = get_megatron_optimizer(opt_config, model)
    else:
        overrides = get_standard_config_overrides(opt_config)
        overrides[ParamKey(attr="keep_fp32")] = {"fp32_island": True}
        optimizer = get_megatron_optimizer(opt_config, model, config_overrides=overrides)
    for part in optimizer_parts(optimizer):
        if getattr(part, "init_state_fn", None) is None and args.optimizer == "sgd":
            part.init_state_fn = _sgd_init_state  # megatron-core has none for SGD: its checkpoints could not load
    if getattr(args, "torch_fused_adam", False):
        print_rank_0(f"--torch-fused-adam: {use_torch_fused_adam(optimizer)} param groups run torch's fused Adam")
    return optimizer


def use_torch_fused_adam(optimizer) -> int:
    """Switch the param groups of megatron-core's torch ``Adam`` / ``AdamW`` fallback (no Transformer Engine or
    Apex) to torch's fused kernel (``fused=True``: one pass over parameters, gradients and moments per step; torch
    defaults to its foreach form, a pass per operation). The group flag is what ``step`` reads; a group switched
    before its first step gets its ``step`` counters on the parameters' device, as fused Adam needs, and checkpoint
    loads keep them there (torch's ``load_state_dict`` for fused groups, :func:`~megatron_glm5.training.
    checkpointing._set_optimizer_step`). Groups of parameters on more than one device, or on a device without the
    fused kernel, are left alone. Returns the number of groups switched."""
    switched = 0
    for part in optimizer_parts(optimizer):
        inner = getattr(part, "optimizer", None)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            devices = {p.device.type for p in group["params"]}
            if len(devices) != 1 or devices.pop() not in ("cuda", "cpu") or group.get("differentiable"):
                continue
            if not all(p.is_floating_point() for p in group["params"]):
                continue
            group["fused"], group["foreach"] = True, False
            switched += 1
    return switched


def optimizer_parts(optimizer) -> list:
    """The megatron optimizers behind ``optimizer`` (a ``ChainedOptimizer`` holds one for the dense and one for the
    expert-parallel parameters, depending on the layout)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _sgd_init_state(opt: torch.optim.SGD, config=None) -> None:
    """Lay out torch SGD's state (a momentum buffer per parameter, when momentum is on) so that a checkpoint can be
    loaded into it, as megatron-core's ``init_state_fn`` does for Adam."""
    for group in opt.param_groups:
        if group["momentum"] == 0:
            continue
        for p in group["params"]:
            if opt.state[p].get("momentum_buffer") is None:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p.data)


def get_scheduler(optimizer, args) -> OptimizerParamScheduler:
    """Megatron-LM's iteration-based schedule, counted in samples (steps advance by the global batch size)."""
    gbs = args.global_batch_size
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs, lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs, wd_incr_style="constant",
        wsd_decay_steps=(args.lr_wsd_decay_iters * gbs) if args.lr_wsd_decay_iters else None,
        lr_wsd_decay_style=args.lr_wsd_decay_style)


def setup_model_and_optimizer(model_provider: Callable, config, args, timers=None):
    """(model chunks, optimizer, scheduler); also wires the grad-sync hooks into ``config`` as Megatron-LM does."""
    model = get_model(model_provider, config, args)
    optimizer = get_optimizer(model, config, args, timers)
    scheduler = get_scheduler(optimizer, args)
    config.no_sync_func = [m.no_sync for m in model]
    if len(model) == 1:
        config.no_sync_func = config.no_sync_func[0]
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = None
    config.timers = timers
    if args.overlap_grad_reduce:
        config.grad_sync_func = [m.start_grad_sync for m in model]
        if len(model) == 1:
            config.grad_sync_func = config.grad_sync_func[0]
    if args.overlap_param_gather and args.use_distributed_optimizer:
        config.param_sync_func = [partial(m.start_param_sync, force_sync=False) for m in model]
        if len(model) == 1:
            config.param_sync_func = config.param_sync_func[0]
    return model, optimizer, scheduler
