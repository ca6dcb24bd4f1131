"""The switch from the KPool indexers' dense warm-up to the sparse stage (``--dsa-indexer-warmup N``,
docs/indexer_training.md), as a resume.

The warm-up stage (iterations ``1..N``) trains only the indexers, so its checkpoint (saved at iteration ``N``, where
the stage ends the run) holds Adam state for the indexers' parameters alone; the sparse stage trains every
parameter. Resuming at exactly iteration ``N`` is the switch: Megatron-LM's ``load_checkpoint`` restores the
weights, the RNG states, the iteration and the consumed samples (the data position) as on any resume, and the
learning-rate scheduler's state is restored from the checkpoint; the indexers' Adam moments are loaded from it and
every other parameter's start at zero, with the one step count megatron-core's optimizers keep for all of their
parameters restarted at 0 (bias correction right for the fresh moments; the indexers' first updates are smaller
than their warm-up ones). With megatron-core's distributed optimizer (its checkpoint format is per buffer, not per
parameter) every parameter starts fresh. Every other resume is Megatron-LM's own.
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["install", "is_stage_switch", "optimizer_state_refusal"]


def is_stage_switch(args) -> bool:
    """Whether this run resumes the warm-up's last checkpoint in the sparse stage (it starts at iteration
    ``--dsa-indexer-warmup``)."""
    from megatron_glm5.checkpoint.tracker import start_iteration

    n = getattr(args, "dsa_indexer_warmup", 0) or 0
    return n > 0 and bool(args.load) and not args.finetune and start_iteration(args) == n


def optimizer_state_refusal(ckpt_dir: str, saved: dict, args) -> Optional[str]:
    """Why this run cannot load the optimizer state of ``ckpt_dir`` (saved by a run with the arguments ``saved``)
    for the parameters it trains, or None: the indexers train (``--dsa-indexer-loss-coeff`` > 0) in one run and not
    in the other, or the saved run was not the warm-up and this one is. Resuming the warm-up's last checkpoint in the
    sparse stage is the switch (:func:`is_stage_switch`), not a refusal. Checkpoints that do not record it pass."""
    if "dsa_indexer_loss_coeff" not in saved or is_stage_switch(args):
        return None
    trained_was = (saved["dsa_indexer_loss_coeff"] or 0) > 0
    trained_now = (getattr(args, "dsa_indexer_loss_coeff", None) or 0) > 0
    if trained_was != trained_now:
        return (f"--dsa-indexer-loss-coeff: {ckpt_dir} was saved with the indexer loss "
                f"{'on' if trained_was else 'off'} (its optimizer state {'holds' if trained_was else 'has no'} "
                f"state for the indexers): resume with it {'on' if trained_was else 'off'}, or leave the optimizer "
                "state out (--no-load-optim)")
    warm_was, warm_now = bool(saved.get("dsa_indexer_warmup_stage")), bool(getattr(args, "dsa_indexer_warmup_stage",
                                                                                    False))
    if warm_now and not warm_was:
        return (f"--dsa-indexer-warmup: {ckpt_dir} was saved outside the indexer warm-up (its optimizer state covers "
                "every parameter; the warm-up trains only the indexers): leave the optimizer state out "
                "(--no-load-optim) or --dsa-indexer-warmup out")
    return None


def _switching_load(upstream):
    def load_checkpoint(model, optimizer, opt_param_scheduler, *a, **kw):
        from megatron.training import checkpointing, get_args
        from megatron.training.utils import print_rank_0

        from megatron_glm5.checkpoint.tracker import checkpoint_in

        args = get_args()
        if optimizer is None or args.no_load_optim or not is_stage_switch(args):
            return upstream(model, optimizer, opt_param_scheduler, *a, **kw)
        args.no_load_optim = True
        try:
            out = upstream(model, optimizer, opt_param_scheduler, *a, **kw)
        finally:
            args.no_load_optim = False
        ckpt_dir = checkpoint_in(args.load)
        if opt_param_scheduler is not None:
            common = checkpointing.dist_checkpointing.load_common_state_dict(ckpt_dir)
            opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
        carried = _load_indexer_moments(model, optimizer, ckpt_dir, args)
        moments = (f"the indexers' Adam moments ({carried} tensors) carried, every other parameter's fresh, one step "
                   "count restarted at 0" if carried else "fresh Adam state for every parameter")
        print_rank_0(f"indexer warm-up -> sparse stage at iteration {args.dsa_indexer_warmup}: weights, RNG, data "
                     f"position and learning-rate schedule from {os.path.abspath(args.load)}; {moments}")
        return out

    return load_checkpoint


def _torch_optimizers(optimizer):
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            yield opt, inner


def _load_indexer_moments(model, optimizer, ckpt_dir: str, args) -> int:
    """The warm-up checkpoint's Adam state of the indexers' parameters, loaded into this run's optimizer (whose
    other parameters keep the zero state megatron-core's ``init_state_fn`` gives); every parameter's step count
    set to 0 (megatron-core's optimizers keep one for all). Returns how many state tensors were loaded (all ranks
    agree); 0 (nothing changed) with megatron-core's distributed optimizer, whose checkpoint format is per buffer."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.training.checkpointing import _build_sharded_state_dict_metadata

    subs = list(_torch_optimizers(optimizer))
    if not subs or any(isinstance(opt, DistributedOptimizer) for opt, _ in subs):
        return 0
    metadata = _build_sharded_state_dict_metadata(args)
    from megatron.core.utils import unwrap_model

    chunks = unwrap_model(model if isinstance(model, (list, tuple)) else [model])
    model_sd = {f"model{i}": chunk.sharded_state_dict(metadata=metadata) for i, chunk in enumerate(chunks)}
    opt_sd = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)   # zero state for all
    wanted = {}
    for value in nested_values(opt_sd):
        if isinstance(value, ShardedTensor) and ".indexer." in value.key and value.key.startswith("optimizer."):
            wanted[value.key] = value
    loaded = dist_checkpointing.load(dict(wanted), ckpt_dir) if wanted else {}
    for key, sh in wanted.items():
        if loaded[key] is not sh.data:
            sh.data.copy_(loaded[key])
    for _, inner in subs:
        for group in inner.param_groups:
            on_device = bool(group.get("fused") or group.get("capturable"))
            for p in group["params"]:
                state = inner.state[p]
                if state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
    return len(wanted)


def install() -> bool:
    """Wrap the ``load_checkpoint`` that ``megatron.training.training`` calls (idempotent); True when installed
    now."""
    from megatron_glm5 import extensions

    record = extensions.BY_NAME["indexer_stage_switch"]
    return extensions.apply(record, _switching_load(extensions.current(record)))
