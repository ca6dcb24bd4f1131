"""The training entry: ``pretrain`` sets up the run, ``train`` loops over ``train_step``, ``evaluate`` runs
validation — Megatron-LM's ``megatron/training/training.py`` in small, on megatron-core's schedules.

One iteration = one optimizer step over ``--global-batch-size`` samples, split into micro batches by megatron-core's
microbatch calculator and run by ``get_forward_backward_func()`` (no pipelining, 1F1B or interleaved VPP).
A step whose loss or grad norm is NaN/inf is skipped (no parameter, optimizer or scheduler update) and counted;
``--max-consecutive-skipped-iterations`` in a row stop the run with one line naming the iteration, the last
checkpoint left as it was.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.num_microbatches_calculator import (
    destroy_num_microbatches_calculator,
    get_num_microbatches,
    init_num_microbatches_calculator,
)
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.rerun_state_machine import destroy_rerun_state_machine
from megatron.core.timers import Timers
from megatron.core.transformer.moe.moe_utils import track_moe_metrics
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from megatron_glm5.cli import one_line
from megatron_glm5.models.cuda_graphs import describe_graphed_modules
from megatron_glm5.training import global_vars
from megatron_glm5.training.arguments import fail, hf_config_dict, model_config_from_args, parse_args
from megatron_glm5.training.checkpointing import CheckpointError, load_checkpoint, save_checkpoint
from megatron_glm5.training.logger import TrainingLogger, get_tensorboard_writer, print_rank_0
from megatron_glm5.training.model_setup import setup_model_and_optimizer, unwrap_model


class TrainingStopped(RuntimeError):
    """The run cannot go on (too many skipped iterations in a row); the message names the iteration."""


# ---------------------------------------------------------------------------- MoE expert loads
def _routers(model) -> list:
    return [m for chunk in unwrap_model(model) for m in chunk.modules()
            if getattr(m, "local_tokens_per_expert", None) is not None and hasattr(m, "expert_bias")]


def finalize_grads_and_record_expert_loads(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """megatron-core's ``finalize_model_grads`` (DP grad reduction, SP / embedding grad all-reduces, the
    aux-loss-free expert-bias update from this step's expert loads), keeping a copy of the per-layer expert loads
    (tokens per expert, summed over the step's micro batches) for logging before megatron resets them."""
    global_vars.record_expert_loads([r.local_tokens_per_expert.detach().clone() for r in _routers(model)])
    finalize_model_grads(model, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def expert_load_imbalance() -> Dict[str, float]:
    """{'moe/expert-load-imbalance': mean over MoE layers of max/mean tokens per expert, per-layer values}, loads
    summed over the tensor x data x context parallel ranks (as the expert-bias update sums them)."""
    loads = global_vars.expert_loads()
    if not loads:
        return {}
    stacked = torch.stack(loads)
    dist.all_reduce(stacked, group=parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True))
    ratio = stacked.max(dim=1).values / stacked.mean(dim=1).clamp(min=1e-9)
    out = {"moe/expert-load-imbalance": float(ratio.mean())}
    out.update({f"moe/expert-load-imbalance/layer_{i}": float(r) for i, r in enumerate(ratio)})
    return out


# ---------------------------------------------------------------------------- one step
def _reduce_losses(losses_reduced: List[dict]) -> Dict[str, float]:
    """Token-weighted mean of each reported loss over micro batches and data(+context)-parallel ranks, on the last
    pipeline stage ({} elsewhere). Each entry of ``losses_reduced`` maps a name to tensor([sum, count])."""
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return {}
    totals: Dict[str, torch.Tensor] = {}
    for entry in losses_reduced:
        for k, v in entry.items():
            totals[k] = totals.get(k, 0) + v.detach().double()
    out = {}
    for k, v in totals.items():
        v = v.clone()
        dist.all_reduce(v, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        out[k] = float(v[0] / v[1].clamp(min=1))
    return out


def _nonfinite_anywhere(values: Dict[str, float]) -> bool:
    """Whether any rank saw a NaN/inf loss (losses live on the last pipeline stage only)."""
    flag = torch.tensor([0.0 if all(math.isfinite(v) for v in values.values()) else 1.0])
    if torch.cuda.is_available():
        flag = flag.cuda()
    dist.all_reduce(flag)
    return bool(flag.item() > 0)


def optimizer_step(optimizer, clip_grad: float):
    """megatron-core optimizer step that refuses non-finite gradients: (updated, grad_norm, num_zeros).

    Mirrors ``MegatronOptimizer.step`` (prepare grads, grad norm, clip, count zeros, step) but computes the grad
    norm once, before anything is changed, and stops there when it is NaN/inf."""
    found_inf = optimizer.prepare_grads()
    grad_norm = optimizer.get_grad_norm()
    if found_inf or grad_norm is None or not math.isfinite(float(grad_norm)):
        return False, grad_norm, None
    if clip_grad > 0:
        subs = getattr(optimizer, "chained_optimizers", [optimizer])
        for sub in subs:
            params = sub.get_parameters()
            if params and not getattr(sub, "is_stub_optimizer", False):
                clip_grad_by_total_norm_fp32(
                    params, max_norm=clip_grad, total_norm=grad_norm,
                    use_decoupled_grad=sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    num_zeros = optimizer.count_zeros() if optimizer.config.log_num_zeros_in_grad else None
    return optimizer.step_with_ready_grads(), grad_norm, num_zeros


def train_step(forward_step_func, data_iterators, model, optimizer, scheduler, config, args):
    """One optimizer step. Returns (losses {name: value} on the last stage, updated, grad_norm, num_zeros)."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward = get_forward_backward_func()
    losses_reduced = forward_backward(
        forward_step_func=forward_step_func,
        data_iterator=data_iterators if len(data_iterators) > 1 else data_iterators[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=get_num_microbatches(), seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=False)
    losses = _reduce_losses(losses_reduced)
    if _nonfinite_anywhere(losses):
        return losses, False, float("nan"), None
    updated, grad_norm, num_zeros = optimizer_step(optimizer, args.clip_grad)
    if updated:
        scheduler.step(increment=args.global_batch_size)
    return losses, updated, float(grad_norm) if grad_norm is not None else None, num_zeros


def params_norm(model) -> float:
    """L2 norm of all parameters (each counted once across tensor / pipeline / expert ranks)."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    dense = torch.zeros(1, dtype=torch.float64)
    expert = torch.zeros(1, dtype=torch.float64)
    for chunk in unwrap_model(model):
        for p in chunk.parameters():
            if not (param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)):
                continue
            sq = p.detach().double().pow(2).sum().cpu()
            if getattr(p, "allreduce", True):
                dense += sq
            else:
                expert += sq
    if torch.cuda.is_available():
        dense, expert = dense.cuda(), expert.cuda()
    dist.all_reduce(dense, group=parallel_state.get_model_parallel_group())
    dist.all_reduce(expert, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    return float((dense + expert).sqrt())


def active_params_per_token(model, config) -> float:
    """Parameters each token passes through (routed experts counted at topk / num_experts), over all model-parallel
    ranks: the N of the 6N FLOP estimate."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    dense = torch.zeros(1, dtype=torch.float64)
    expert = torch.zeros(1, dtype=torch.float64)
    for chunk in unwrap_model(model):
        for name, p in chunk.named_parameters():
            if not param_is_not_tensor_parallel_duplicate(p) or "vision_model" in name:
                continue
            if getattr(p, "allreduce", True):
                dense += p.numel()
            else:
                expert += p.numel()
    if torch.cuda.is_available():
        dense, expert = dense.cuda(), expert.cuda()
    dist.all_reduce(dense, group=parallel_state.get_model_parallel_group())
    dist.all_reduce(expert, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    frac = (config.moe_router_topk / config.num_moe_experts) if config.num_moe_experts else 0.0
    return float(dense + expert * frac)


# ---------------------------------------------------------------------------- evaluation
def evaluate(forward_step_func, data_iterators, model, args) -> Dict[str, float]:
    """Mean validation losses over --eval-iters global batches (no gradients)."""
    for chunk in model:
        chunk.eval()
    forward_backward = get_forward_backward_func()
    collected: List[dict] = []
    with torch.no_grad():
        for _ in range(args.eval_iters):
            collected += forward_backward(
                forward_step_func=forward_step_func,
                data_iterator=data_iterators if len(data_iterators) > 1 else data_iterators[0],
                model=model if len(model) > 1 else model[0], num_microbatches=get_num_microbatches(),
                seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=True)
    # MTP / MoE trackers collected values during the evaluation forward passes: drop them
    if "values" in MTPLossLoggingHelper.tracker:
        MTPLossLoggingHelper.clean_loss_in_tracker()
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()
    for chunk in model:
        chunk.train()
    return _reduce_losses(collected)


# ---------------------------------------------------------------------------- the loop
def _aux_losses(model, config, writer, iteration) -> Dict[str, float]:
    """MoE balancing and MTP losses of the step, through megatron-core's trackers (all ranks take part)."""
    scale = 1.0 / get_num_microbatches()
    totals: Dict[str, torch.Tensor] = {}
    if config.num_moe_experts and config.moe_router_load_balancing_type != "none":
        names = [t.strip() for t in config.moe_router_load_balancing_type.split(",")]
        track_names = ["seq_load_balancing_loss" if n == "seq_aux_loss" else "load_balancing_loss" for n in names]
        layer_types = [1 if t == "sparse" else 0 for t in config.mlp_layer_types]
        track_moe_metrics(loss_scale=scale, iteration=iteration, writer=None, total_loss_dict=totals,
                          force_initialize=True, track_names=track_names,
                          num_layers=config.num_layers + (config.mtp_num_layers or 0),
                          moe_layer_freq=layer_types, mtp_num_layers=config.mtp_num_layers)
        if "seq_load_balancing_loss" in totals and "load_balancing_loss" not in totals:
            totals["load_balancing_loss"] = totals["seq_load_balancing_loss"]
    if config.mtp_num_layers:
        MTPLossLoggingHelper.track_mtp_metrics(loss_scale=scale, iteration=iteration, writer=None,
                                               total_loss_dict=totals)
    return {k: float(v) for k, v in totals.items()}


def train(forward_step_func, model, optimizer, scheduler, train_iterators, valid_iterators, config, args,
          iteration: int, consumed: dict, logger: TrainingLogger, hf_config: dict, packing_efficiency=None) -> int:
    for chunk in model:
        chunk.train()
    consecutive_skipped = 0
    tokens_per_iter = args.global_batch_size * args.seq_length
    last_saved = iteration if args.load else None
    while iteration < args.train_iters:
        global_vars.set_iteration(iteration + 1)
        start = time.time()
        losses, updated, grad_norm, num_zeros = train_step(forward_step_func, train_iterators, model, optimizer,
                                                           scheduler, config, args)
        iteration += 1
        consumed["train"] += args.global_batch_size
        extra = _aux_losses(model, config, logger.writer, iteration)
        losses.update({k: v for k, v in extra.items() if k not in losses})
        extra_tb = expert_load_imbalance()
        if packing_efficiency is not None:
            extra_tb["packing-efficiency"] = packing_efficiency
        if updated:
            consecutive_skipped = 0
        else:
            consecutive_skipped += 1
            print_rank_0(f"iteration {iteration}: NaN/inf loss or grad norm, step skipped "
                         f"({consecutive_skipped} in a row)")
        pnorm = params_norm(model)
        logger.log_iteration(iteration, losses, scheduler.get_lr(optimizer.param_groups[0]), grad_norm, pnorm,
                             num_zeros, not updated, time.time() - start, tokens_per_iter, consumed["train"],
                             extra_tb)
        if consecutive_skipped >= args.max_consecutive_skipped_iterations:
            logger.flush()
            where = f"; the last checkpoint (iteration {last_saved}) is intact" if last_saved else ""
            raise TrainingStopped(f"stopped at iteration {iteration}: {consecutive_skipped} iterations in a row had a "
                                  f"NaN/inf loss or grad norm{where}")
        if args.eval_interval and iteration % args.eval_interval == 0 and valid_iterators is not None:
            logger.log_validation(iteration, evaluate(forward_step_func, valid_iterators, model, args))
            consumed["valid"] += args.eval_iters * args.global_batch_size
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(iteration, model, optimizer, scheduler, consumed, args, hf_config, log=print_rank_0)
            last_saved = iteration
            print_rank_0(f"saved checkpoint at iteration {iteration} to {args.save}")
        if args.exit_interval and iteration % args.exit_interval == 0:
            if args.save and last_saved != iteration:
                save_checkpoint(iteration, model, optimizer, scheduler, consumed, args, hf_config, log=print_rank_0)
                last_saved = iteration
            print_rank_0(f"exiting at iteration {iteration} (--exit-interval {args.exit_interval})")
            break
    if args.save and last_saved != iteration:
        save_checkpoint(iteration, model, optimizer, scheduler, consumed, args, hf_config, log=print_rank_0)
        print_rank_0(f"saved checkpoint at iteration {iteration} to {args.save}")
    graphs = describe_graphed_modules(unwrap_model(model))
    if graphs:
        print_rank_0(graphs)
    logger.flush()
    return iteration


def _make_iterators(dataset, consumed_samples: int, args, n_chunks: int):
    """One data iterator per model chunk (each chunk reads the same micro batches, as Megatron-LM does)."""
    from megatron_glm5.data.sampler import build_data_loader

    if dataset is None:
        return None
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    return [iter(build_data_loader(dataset, consumed_samples, args.micro_batch_size, dp_rank, dp_size,
                                   num_workers=args.num_workers)) for _ in range(n_chunks)]


def pretrain(train_valid_test_datasets_provider: Callable, model_provider: Callable, forward_step_func: Callable,
             argv: Optional[List[str]] = None, prog: Optional[str] = None) -> int:
    """Parse flags, set up megatron, build model/optimizer/scheduler, load, build data, train, evaluate, save.

    ``model_provider(config, pre_process, post_process, vp_stage)`` -> model of one (virtual) stage;
    ``train_valid_test_datasets_provider(args, config)`` -> (train, valid, test) map-style datasets;
    ``forward_step_func(data_iterator, model)`` -> (output tensor, loss function), megatron-core's contract.
    User errors end with one line and exit 2; a run stopped by NaNs exits 1.
    """
    from megatron_glm5.config import Glm5ConfigError
    from megatron_glm5.data import DataError
    from megatron_glm5.initialize import destroy_megatron, initialize_megatron

    prog = prog or os.path.basename(sys.argv[0])
    args = parse_args(argv, prog=prog)
    # megatron-core's dataset builders log a warning for every index they do not cache (mock data): not news
    logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)
    global_vars.set_args(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        config = model_config_from_args(args, device)
    except (Glm5ConfigError, ValueError, TypeError, AssertionError) as e:
        fail(f"model config: {one_line(e)}", prog)
    global_vars.set_config(config)
    try:
        initialize_megatron(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                            ep=args.expert_model_parallel_size, cp=args.context_parallel_size,
                            vpp=config.virtual_pipeline_model_parallel_size, etp=args.expert_tensor_parallel_size,
                            seed=args.seed)
    except (ValueError, RuntimeError, AssertionError) as e:
        fail(f"parallel layout: {one_line(e)}", prog)
    try:
        timers = Timers(log_level=0, log_option="minmax")
        init_num_microbatches_calculator(dist.get_rank(), None, args.global_batch_size, args.micro_batch_size,
                                         args.data_parallel_size)
        hf_config = hf_config_dict(args)
        try:
            model, optimizer, scheduler = setup_model_and_optimizer(
                lambda **kw: model_provider(config, **kw), config, args, timers)
        except (ValueError, AssertionError, NotImplementedError) as e:
            fail(f"model: {one_line(e)}", prog)
        config.finalize_model_grads_func = finalize_grads_and_record_expert_loads
        try:
            iteration, consumed = load_checkpoint(model, optimizer, scheduler, args, hf_config, log=print_rank_0)
        except CheckpointError as e:
            fail(str(e), prog)
        try:
            train_ds, valid_ds, _ = train_valid_test_datasets_provider(args, config)
        except DataError as e:
            fail(str(e), prog)
        packing = getattr(train_ds, "packing_efficiency", None)
        train_iters = _make_iterators(train_ds, consumed["train"], args, len(model))
        valid_iters = _make_iterators(valid_ds, consumed["valid"], args, len(model)) if args.eval_iters else None
        writer = get_tensorboard_writer(args)
        logger = TrainingLogger(args, writer, flops_per_token=6.0 * active_params_per_token(model, config))
        n_params = sum(p.numel() for m in unwrap_model(model) for p in m.parameters())
        print_rank_0(f"{prog}: {n_params / 1e6:.2f}M parameters on rank 0, world {args.world_size} "
                     f"(TP {args.tensor_model_parallel_size} PP {args.pipeline_model_parallel_size} "
                     f"EP {args.expert_model_parallel_size} CP {args.context_parallel_size} "
                     f"DP {args.data_parallel_size}), {get_num_microbatches()} micro batches per step, "
                     f"starting at iteration {iteration}")
        try:
            iteration = train(forward_step_func, model, optimizer, scheduler, train_iters, valid_iters, config, args,
                              iteration, consumed, logger, hf_config, packing)
        except TrainingStopped as e:
            print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
            logger.close()
            return 1
        if args.eval_iters and valid_iters is not None and args.eval_interval is None:
            logger.log_validation(iteration, evaluate(forward_step_func, valid_iters, model, args))
        logger.close()
        return 0
    finally:
        destroy_num_microbatches_calculator()
        destroy_rerun_state_machine()
        destroy_megatron()
