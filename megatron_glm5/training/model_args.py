"""Megatron-LM's arguments as this run uses them: the architecture flags set from the model config that is built.

This model takes its architecture from ``--hf-config`` / ``--model-preset``, not from Megatron-LM's GPT flags, whose
defaults describe another model (``normalization LayerNorm``, ``add_bias_linear True``, ``hidden_dropout 0.1``,
``multi_latent_attention False``, ``qk_head_dim 128``, ...). :func:`set_args_as_built` sets those of
:data:`MODEL_ARGS` to the built config's values once the flags are checked (a given flag that does not reach the
model is refused before, :func:`~megatron_glm5.training.arguments.check_flags_reach_the_model`), so that Megatron-LM's
arguments dump (console) and its TensorBoard ``args`` text (written from the same namespace) show the model that
trains. :func:`deferred_args_dump` holds the dump that ``validate_args`` prints until then (:func:`print_args`).
"""

from __future__ import annotations

import contextlib
import importlib.util

MODEL_ARGS = (
    "num_query_groups", "hidden_dropout", "attention_dropout", "add_bias_linear", "add_qkv_bias",
    "activation_func_clamp_value", "normalization", "norm_epsilon", "multi_latent_attention", "q_lora_rank",
    "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "qk_layernorm", "rope_type", "rotary_base",
    "rotary_scaling_factor", "embedding_init_method_std", "attention_softmax_in_fp32",
    "moe_router_topk_scaling_factor", "moe_router_score_function", "moe_router_dtype",
    "moe_router_enable_expert_bias", "moe_token_dispatcher_type",
)
"""The Megatron-LM arguments that are fields of the model config and set by the architecture (or by this trainer),
not by a flag. Device-dependent choices (``--kda-backend`` ...) stay as given: the model provider resolves them on
its device."""


def set_args_as_built(args, model_config) -> None:
    """Set ``args``' :data:`MODEL_ARGS` to ``model_config``'s values (a field the config leaves None keeps the
    flag's), and ``enable_one_logger`` to False where the ``one_logger`` package is not installed (Megatron-LM then
    runs without it and prints a pointer to an internal NVIDIA page on every start)."""
    for name in MODEL_ARGS:
        if hasattr(args, name) and getattr(model_config, name, None) is not None:
            setattr(args, name, getattr(model_config, name))
    if getattr(args, "enable_one_logger", False) and importlib.util.find_spec("one_logger") is None:
        args.enable_one_logger = False


@contextlib.contextmanager
def deferred_args_dump():
    """Megatron-LM's ``validate_args`` without its arguments dump (printed by :func:`print_args` once the arguments
    are set as built)."""
    from megatron.training import arguments

    printer = arguments._print_args
    arguments._print_args = lambda title, args: None
    try:
        yield
    finally:
        arguments._print_args = printer


def print_args(args) -> None:
    """Megatron-LM's arguments dump (rank 0) of ``args``."""
    from megatron.training.arguments import _print_args

    _print_args("arguments", args)
