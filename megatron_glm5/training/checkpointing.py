"""Training checkpoints in Megatron-LM's layout, written with megatron-core ``dist_checkpointing`` (torch_dist):

    SAVE/iter_0000010/                 model, optimizer, scheduler, RNG, iteration, data position, run args
    SAVE/latest_checkpointed_iteration.txt

Saving is atomic: every rank writes into ``SAVE/iter_0000010.tmp-<id>/``; once all have finished, rank 0 renames it
to ``iter_0000010/`` and then replaces the tracker file (write + fsync + rename). A run killed at any moment leaves
the previous checkpoint loadable and the tracker on it; the next save removes stale ``.tmp-`` directories.

``load_checkpoint`` resumes everything from ``--load`` (the tracker's iteration), or starts from weights only with
``--finetune`` / ``--pretrained-checkpoint``. A weights-only directory may also be the output of
``tools/convert_hf_to_mcore.py`` (a torch_dist checkpoint of the model alone, with ``hf_config.json``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import uuid
from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject
from megatron.core.dist_checkpointing.utils import extract_sharded_base

from megatron_glm5.checkpoint.atomic import OLD_TAG, publish_dir, write_text_atomic
# a checkpoint this run cannot use (missing, of another architecture, unreadable): the package's one error class
from megatron_glm5.checkpoint.errors import CheckpointError
from megatron_glm5.checkpoint.safe_load import check_dist_checkpoint
from megatron_glm5.training.model_setup import optimizer_parts, unwrap_model

TRACKER = "latest_checkpointed_iteration.txt"
CONFIG_FILE = "hf_config.json"
ARGS_FILE = "run_args.json"
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    """The iteration ``root``'s tracker names, or None when there is no tracker."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path}: expected an iteration number, found {text[:40]!r}")
    return int(text)


def is_dist_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "metadata.json"))


def resolve_load_dir(root: str) -> Tuple[Optional[str], Optional[int]]:
    """(directory holding a dist checkpoint, its iteration) for a --load / --pretrained-checkpoint root: the
    tracker's ``iter_*`` directory, or ``root`` itself when it is a bare dist checkpoint (iteration None)."""
    iteration = read_tracker(root)
    if iteration is not None:
        ckpt = checkpoint_dir(root, iteration)
        if not is_dist_checkpoint(ckpt):
            raise CheckpointError(f"{os.path.join(root, TRACKER)} names iteration {iteration}, but {ckpt} is not a "
                                  "complete checkpoint")
        return ckpt, iteration
    if is_dist_checkpoint(root):
        return root, None
    return None, None


_ARCH_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "n_routed_experts",
              "moe_intermediate_size", "intermediate_size", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
              "v_head_dim", "linear_num_heads", "linear_head_dim", "hc_mult", "index_n_heads", "index_head_dim",
              "layer_types", "mlp_layer_types", "n_shared_experts")


def check_architecture(ckpt_dir: str, hf_config: dict) -> None:
    """Refuse a checkpoint whose recorded HF config differs from this run's architecture (one line naming the
    first differing field)."""
    path = os.path.join(ckpt_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        return
    try:
        saved = json.load(open(path))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    a, b = saved.get("text_config", saved), hf_config.get("text_config", hf_config)
    for key in _ARCH_KEYS:
        if key in a and key in b and a[key] != b[key]:
            raise CheckpointError(f"{ckpt_dir} is a checkpoint of another architecture: {key} is {a[key]!r} there, "
                                  f"{b[key]!r} in this run's model config")
    if ("vision_config" in saved) != ("vision_config" in hf_config):
        raise CheckpointError(f"{ckpt_dir} is a checkpoint of another architecture: vision tower "
                              f"{'present' if 'vision_config' in saved else 'absent'} there")


# ---------------------------------------------------------------------------- state
def _rng_state() -> dict:
    state = {"random": random.getstate(), "np": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _model_sharded_state_dict(model: List[torch.nn.Module]) -> dict:
    chunks = unwrap_model(model)
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(chunks)}


def _rng_sharded_object() -> ShardedObject:
    """One RNG state per rank (TP ranks differ in their tracker states; DP ranks in nothing, but keep them)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)


def _optimizer_step(part) -> int:
    """How many steps a megatron optimizer's torch optimizer has taken (per-parameter ``step`` of torch Adam, or the
    per-group one of fused Adams); 0 before the first."""
    inner = part.optimizer
    steps = [int(s["step"]) for s in inner.state.values() if "step" in s]
    steps += [int(g["step"]) for g in inner.param_groups if "step" in g]
    return max(steps, default=0)


def _set_optimizer_step(part, step: int) -> None:
    inner = part.optimizer
    for s in inner.state.values():
        if "step" in s:
            s["step"] = (torch.tensor(float(step), dtype=s["step"].dtype, device=s["step"].device)
                         if torch.is_tensor(s["step"]) else step)  # fused Adam keeps it on the parameter's device
    for g in inner.param_groups:
        if "step" in g:
            g["step"] = step


def _optimizer_sharded_state(optimizer, model_sd: dict, is_loading: bool) -> dict:
    """The optimizer's part of a checkpoint, independent of the layout: its state tensors in model space
    (``optimizer.state.<exp_avg|exp_avg_sq|param>.<model key>``, megatron's fully reshardable format for the
    distributed optimizer) and the step count. How megatron splits the parameters over optimizers (dense vs
    expert-parallel) and param groups depends on the layout, so those structures are rebuilt from the loading run's
    own optimizer rather than saved (megatron-core's chained format would prefix keys with the optimizer's index)."""
    tensors, own = {}, {}
    for i, part in enumerate(optimizer_parts(optimizer)):
        part_sd = part.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPTIMIZER_METADATA)
        tensors[str(i)], own[str(i)] = extract_sharded_base(part_sd)
    state = {"tensors": tensors, "step": max(_optimizer_step(p) for p in optimizer_parts(optimizer))}
    if is_loading:  # the loading run's own structures, handed back by dist_checkpointing.load, never saved
        state["own"] = LocalNonpersistentObject(own)
    return state


def _load_optimizer_state(optimizer, loaded: dict) -> None:
    """Load ``loaded`` (the optimizer part of :func:`_full_state` after ``dist_checkpointing.load``) into each of the
    optimizer's parts: its own non-tensor state (param groups, sharding type) with the loaded tensors, then the
    checkpoint's step count."""
    step = int(loaded["step"])
    for i, part in enumerate(optimizer_parts(optimizer)):
        part_sd = loaded["own"][str(i)]
        dict_list_map_inplace(lambda v: v.unwrap() if isinstance(v, LocalNonpersistentObject) else v, part_sd)
        merge(part_sd, loaded["tensors"][str(i)])
        # megatron's non-distributed optimizers keep torch Adam's per-parameter step as one 'common_step' entry
        per_param = part_sd.get("state", part_sd.get("optimizer", {}).get("state"))
        if per_param:
            per_param["common_step"] = torch.tensor(float(step))
        part.load_state_dict(part_sd)
        _set_optimizer_step(part, step)


def _full_state(model, optimizer, scheduler, iteration, consumed, args, with_optimizer: bool,
                is_loading: bool = False) -> dict:
    """The sharded state dict of a resumable checkpoint (``is_loading`` makes the optimizer lay out its state
    tensors to be filled, as megatron-core requires before a load)."""
    state = _model_sharded_state_dict(model)
    if with_optimizer and optimizer is not None:
        model_sd = dict(state)
        state["optimizer"] = _optimizer_sharded_state(optimizer, model_sd if len(model_sd) > 1 else model_sd["model"],
                                                      is_loading)
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    state["rng_state"] = _rng_sharded_object()
    state["iteration"] = iteration
    state["consumed_train_samples"] = consumed["train"]
    state["consumed_valid_samples"] = consumed["valid"]
    state["checkpoint_version"] = 3.0
    return state


# ---------------------------------------------------------------------------- save
def _remove_stale_temporaries(root: str) -> List[str]:
    removed = []
    for name in sorted(os.listdir(root)):
        if (name.startswith("iter_") and ".tmp-" in name) or (name.startswith(".iter_") and OLD_TAG in name):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed


def save_checkpoint(iteration: int, model, optimizer, scheduler, consumed: dict, args, hf_config: dict,
                    log=print) -> str:
    """Save a resumable checkpoint of ``iteration`` under ``args.save`` atomically; returns its directory."""
    root = args.save
    rank = dist.get_rank()
    final = checkpoint_dir(root, iteration)
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for name in _remove_stale_temporaries(root):
            log(f"removed the unfinished checkpoint {os.path.join(root, name)} of an interrupted save")
        tmp_name = [f"{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:8]}"]
    else:
        tmp_name = [None]
    dist.broadcast_object_list(tmp_name, src=0)
    tmp = os.path.join(root, tmp_name[0])
    if rank == 0:
        os.makedirs(tmp)
    dist.barrier()
    state = _full_state(model, optimizer, scheduler, iteration, consumed, args,
                        with_optimizer=not args.no_save_optim)
    dist_checkpointing.save(state, tmp, sharded_strategy=("torch_dist", 1))
    if getattr(args, "test_kill_during_save", None) == iteration:  # tests: the job dies with the save half done
        os.killpg(os.getpgid(0), signal.SIGKILL)  # its process group: megatron's writer helper process too
    dist.barrier()
    if rank == 0:
        with open(os.path.join(tmp, CONFIG_FILE), "w") as fh:
            json.dump(hf_config, fh, indent=1)
        with open(os.path.join(tmp, ARGS_FILE), "w") as fh:
            json.dump({k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list, type(None)))},
                      fh, indent=1)
        for dirpath, _, files in os.walk(tmp):
            for f in files:
                with open(os.path.join(dirpath, f), "rb") as fh:
                    os.fsync(fh.fileno())
        publish_dir(tmp, final)  # re-saving an iteration (e.g. after a resume) swaps, then drops the old one
        write_text_atomic(os.path.join(root, TRACKER), f"{iteration}\n")
    dist.barrier()
    return final


# ---------------------------------------------------------------------------- load
LAYOUT_ARGS = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
               "expert_model_parallel_size", "expert_tensor_parallel_size", "context_parallel_size")


def _layout(args) -> tuple:
    return tuple(getattr(args, name, None) for name in LAYOUT_ARGS)


def _describe(layout: tuple) -> str:
    return ", ".join(f"{short} {value}" for short, value in zip(("world", "TP", "PP", "EP", "ETP", "CP"), layout))


def _saved_layout(ckpt_dir: str) -> Optional[tuple]:
    """The layout a checkpoint of this package was saved at (from its run arguments), or None if unknown."""
    path = os.path.join(ckpt_dir, ARGS_FILE)
    try:
        with open(path) as fh:
            saved = json.load(fh)
    except (OSError, ValueError):
        return None
    return tuple(saved.get(name) for name in LAYOUT_ARGS) if isinstance(saved, dict) else None


def load_checkpoint(model, optimizer, scheduler, args, hf_config: dict, log=print) -> Tuple[int, dict]:
    """Load per the flags; returns (iteration to continue from, consumed samples {'train', 'valid'}).

    --load with a tracker: everything (model, optimizer unless --no-load-optim, scheduler, RNG unless
    --no-load-rng, iteration, data position); with --finetune only the model, from iteration 0.
    --load without a checkpoint (or no --load) and --pretrained-checkpoint: the model weights of that checkpoint.
    """
    consumed = {"train": 0, "valid": 0}
    ckpt, iteration, finetune = None, None, args.finetune
    if args.load:
        ckpt, iteration = resolve_load_dir(args.load)
        if ckpt is not None and iteration is None:
            finetune = True  # a bare dist checkpoint (converter output) holds weights only
    if ckpt is None and args.pretrained_checkpoint:
        ckpt, iteration = resolve_load_dir(args.pretrained_checkpoint)
        if ckpt is None:
            raise CheckpointError(f"--pretrained-checkpoint: no checkpoint in {args.pretrained_checkpoint}")
        finetune = True
    if ckpt is None:
        if args.load and args.finetune:
            raise CheckpointError(f"--load: no checkpoint in {args.load} to fine-tune from")
        return 0, consumed
    check_architecture(ckpt, hf_config)
    check_dist_checkpoint(ckpt)  # no code from its .metadata, checksums verified when it has a manifest

    if finetune:
        state = dist_checkpointing.load(_model_sharded_state_dict(model), ckpt)
        _load_model_state(model, state)
        log(f"loaded model weights from {ckpt} (fine-tuning from iteration 0)")
        return 0, consumed

    full = _full_state(model, optimizer, scheduler, 0, consumed, args, with_optimizer=not args.no_load_optim,
                       is_loading=True)
    load_rng = not args.no_load_rng
    saved_layout = _saved_layout(ckpt)
    if load_rng and saved_layout is not None and saved_layout != _layout(args):
        # the RNG states are per rank of the saving layout; another layout starts from this run's seeded states
        log(f"{ckpt} was saved at another layout ({_describe(saved_layout)}; now {_describe(_layout(args))}): "
            "its weights, optimizer state and data position are resharded, its random states are not loaded")
        load_rng = False
    if not load_rng:
        full.pop("rng_state")
    state = dist_checkpointing.load(full, ckpt)
    _load_model_state(model, state)
    if optimizer is not None and not args.no_load_optim:
        _load_optimizer_state(optimizer, state["optimizer"])
    if scheduler is not None and "opt_param_scheduler" in state:
        scheduler.load_state_dict(state["opt_param_scheduler"])
    if load_rng:
        rng = state["rng_state"]
        if isinstance(rng, ShardedObject):
            rng = rng.data
        _set_rng_state(rng)
    consumed = {"train": int(state["consumed_train_samples"]), "valid": int(state["consumed_valid_samples"])}
    log(f"resumed from {ckpt} at iteration {state['iteration']} ({consumed['train']} samples consumed)")
    return int(state["iteration"]), consumed


def _load_model_state(model, state: dict) -> None:
    chunks = unwrap_model(model)
    if len(chunks) == 1:
        chunks[0].load_state_dict(state["model"], strict=True)
    else:
        for i, m in enumerate(chunks):
            m.load_state_dict(state[f"model{i}"], strict=True)
