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


def check_architecture(ckpt_dir: str, hf_config: dict) -> None:
    """Refuse a checkpoint whose ``hf_config.json`` describes another architecture than ``hf_config`` (one line
    naming the first differing field); a checkpoint without one is not checked here."""
    path = os.path.join(ckpt_dir, HF_CONFIG_FNAME)
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as fh:
            saved = json.load(fh)
    except (OSError, ValueError) as e:
        raise CheckpointDirError(f"{path}: unreadable ({e})") from None
    if not isinstance(saved, dict):
        raise CheckpointDirError(f"{path}: not a JSON object")
    a, b = saved.get("text_config", saved), hf_config.get("text_config", hf_config)
    for key in ARCHITECTURE_KEYS:
        if key in a and key in b and a[key] != b[key]:
            raise CheckpointDirError(f"{ckpt_dir} is a checkpoint of another architecture: {key} is {a[key]!r} there, "
                                     f"{b[key]!r} in this run's model config")
    if ("vision_config" in saved) != ("vision_config" in hf_config):
        raise CheckpointDirError(f"{ckpt_dir} is a checkpoint of another architecture: vision tower "
                                 f"{'present' if 'vision_config' in saved else 'absent'} there")
