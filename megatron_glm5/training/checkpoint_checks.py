"""What ``--load`` / ``--pretrained-checkpoint`` must hold before Megatron-LM reads it, checked up front with one
line naming the flag: Megatron-LM's layout (``latest_checkpointed_iteration.txt`` naming ``iter_NNNNNNN`` or
``release``), and a checkpoint of this run's architecture (the ``hf_config.json`` every checkpoint of this model
carries: the converter writes it, and so does every save of the trainer, :mod:`megatron_glm5.training.
megatron_hooks`).

Megatron-LM starts from scratch when ``--load`` holds no tracker; a directory that holds a checkpoint's files but no
tracker (an ``iter_NNNNNNN`` folder itself) would silently start from random weights, and is refused instead.
"""

from __future__ import annotations

import json
import os

from megatron_glm5.checkpoint.hf_to_mcore import HF_CONFIG_FNAME
# the tracker logic lives with the checkpoint code; re-exported here for the argument checks
from megatron_glm5.checkpoint.megatron_layout import TRACKER_FILE as TRACKER  # noqa: F401
from megatron_glm5.checkpoint.megatron_layout import CheckpointDirError, checkpoint_in  # noqa: F401

# the HF config fields that change the checkpoint's tensors
ARCHITECTURE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "n_routed_experts",
                     "moe_intermediate_size", "intermediate_size", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                     "v_head_dim", "linear_num_heads", "linear_head_dim", "hc_mult", "index_n_heads", "index_head_dim",
                     "layer_types", "mlp_layer_types", "n_shared_experts")


def _json_object(path: str) -> dict:
    """The JSON object in ``path`` (a :class:`CheckpointDirError` naming it when unreadable or not an object)."""
    try:
        with open(path, encoding="utf-8") as fh:
            obj = json.load(fh)
    except (OSError, ValueError) as e:
        raise CheckpointDirError(f"{path}: unreadable ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointDirError(f"{path}: not a JSON object")
    return obj


def check_architecture(ckpt_dir: str, hf_config: dict) -> None:
    """Refuse a checkpoint whose ``hf_config.json`` describes another architecture than ``hf_config`` (one line
    naming the first differing field); a checkpoint without one is not checked here."""
    path = os.path.join(ckpt_dir, HF_CONFIG_FNAME)
    if not os.path.isfile(path):
        return
    saved = _json_object(path)
    a, b = saved.get("text_config", saved), hf_config.get("text_config", hf_config)
    for key in ARCHITECTURE_KEYS:
        if key in a and key in b and a[key] != b[key]:
            raise CheckpointDirError(f"{ckpt_dir} is a checkpoint of another architecture: {key} is {a[key]!r} there, "
                                     f"{b[key]!r} in this run's model config")
    if ("vision_config" in saved) != ("vision_config" in hf_config):
        raise CheckpointDirError(f"{ckpt_dir} is a checkpoint of another architecture: vision tower "
                                 f"{'present' if 'vision_config' in saved else 'absent'} there")


LAYOUT_FNAME = "parallel_layout.json"  # written beside every save of the trainer (megatron_hooks)
LAYOUT_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                 "expert_tensor_parallel_size", "context_parallel_size", "data_parallel_size",
                 "use_distributed_optimizer", "dist_ckpt_optim_fully_reshardable")


def layout_record(args) -> dict:
    """The parallel layout and optimizer-state format of a run, as :data:`LAYOUT_FNAME` records it."""
    return {k: getattr(args, k, None) for k in LAYOUT_FIELDS}


def check_resume_layout(ckpt_dir: str, args) -> None:
    """Refuse (one line) to resume, with its optimizer state, a distributed-optimizer checkpoint that Megatron-LM cannot
    load at this layout (it stops with a traceback in the middle of loading): one saved at another expert-parallel
    size, or in the DP-reshardable format (the default) at another TP / PP."""
    path = os.path.join(ckpt_dir, LAYOUT_FNAME)
    if not os.path.isfile(path) or args.finetune or args.no_load_optim or not args.use_distributed_optimizer:
        return
    saved = _json_object(path)
    if not saved.get("use_distributed_optimizer"):
        return
    ep_was, ep_now = saved.get("expert_model_parallel_size"), args.expert_model_parallel_size
    if ep_was is not None and ep_was != ep_now:
        raise CheckpointDirError(
            f"{ckpt_dir} holds distributed-optimizer state saved at EP {ep_was}: Megatron-LM loads it only at the "
            f"same expert-parallel size (its optimizer is split by it; this run: EP {ep_now}): resume at EP {ep_was}, "
            f"or leave the optimizer state out (--no-load-optim)")
    if saved.get("dist_ckpt_optim_fully_reshardable"):
        return
    was = (saved.get("tensor_model_parallel_size"), saved.get("pipeline_model_parallel_size"))
    now = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    if was != now:
        raise CheckpointDirError(
            f"{ckpt_dir} holds distributed-optimizer state saved at TP {was[0]} PP {was[1]} in the DP-reshardable "
            f"format, which loads only at that TP / PP (this run: TP {now[0]} PP {now[1]}): resume at TP {was[0]} "
            f"PP {was[1]}, leave the optimizer state out (--no-load-optim), or save with "
            f"--dist-ckpt-optim-fully-reshardable")
