"""Whether a GLM-5.3 model can be built at a TP / PP / EP layout, checked from its config alone (no tensors).

Used by the converter to refuse a layout up front; megatron-core's own checks (``TransformerConfig`` and its
pipeline layer distribution) run too, their failures reported as one line.
"""

from __future__ import annotations

import torch

from megatron_glm5.checkpoint.errors import CheckpointError
from megatron_glm5.config import Glm5Config


class LayoutError(CheckpointError):
    """A TP / PP / EP layout the model cannot be built at."""


def validate_layout(hf_config, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
    """Raise LayoutError unless the model of ``hf_config`` (an HF checkpoint dir, config.json path or dict)
    can be built at TP=tp, PP=pp, EP=ep (Glm5ConfigError if the config itself is invalid)."""
    cfg = Glm5Config.from_hf(hf_config)
    for name, v in (("tp", tp), ("pp", pp), ("ep", ep)):
        if not isinstance(v, int) or v < 1:
            raise LayoutError(f"--{name} must be a positive integer, got {v!r}")
    if tp > 1:
        need = [("num_attention_heads", cfg.num_attention_heads), ("linear_num_heads", cfg.linear_num_heads),
                ("vocab_size (embedding and output layer rows)", cfg.vocab_size),
                ("intermediate_size", cfg.ffn_hidden_size)]
        if cfg.num_moe_experts:
            need.append(("moe_intermediate_size", cfg.moe_ffn_hidden_size))
            if cfg.moe_shared_expert_intermediate_size:
                need.append(("shared expert size", cfg.moe_shared_expert_intermediate_size))
        bad = [f"{n} = {v}" for n, v in need if v % tp]
        if bad:
            raise LayoutError(f"--tp {tp} does not divide {', '.join(bad)}")
    if ep > 1:
        if not cfg.num_moe_experts:
            raise LayoutError(f"--ep {ep}: the model has no MoE layers")
        if cfg.num_moe_experts % ep:
            raise LayoutError(f"--ep {ep} does not divide n_routed_experts = {cfg.num_moe_experts}")
    if pp > 1:
        if cfg.num_layers < pp:
            raise LayoutError(f"--pp {pp} exceeds num_hidden_layers = {cfg.num_layers}")
        if cfg.mtp_num_layers:
            raise LayoutError(f"--pp {pp}: the MTP layer needs the embedding on the last pipeline stage; "
                                       "the model supports MTP only at PP=1")
    # megatron's own checks (TransformerConfig.__post_init__ and its layer distribution)
    try:
        full = Glm5Config.from_hf(hf_config, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  expert_model_parallel_size=ep, pipeline_dtype=torch.bfloat16)
        if pp > 1:
            from megatron.core.transformer.transformer_block import get_num_layers_to_build
            from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

            for r in range(pp):
                off = get_transformer_layer_offset(full, pp_rank=r)
                n = get_num_layers_to_build(full, pp_rank=r)
                if n < 1:
                    raise LayoutError(f"--pp {pp}: pipeline stage {r} would hold no decoder layer")
                _check_shared_indexers(full, range(off, off + n), pp)
    except LayoutError:
        raise
    except (AssertionError, ValueError) as e:
        raise LayoutError(f"--tp {tp} --pp {pp} --ep {ep}: {e}") from None


def _check_shared_indexers(cfg: Glm5Config, layers: range, pp: int) -> None:
    """A 'shared' DSA layer reuses the top-k of an earlier full DSA layer, which must sit on the same stage."""
    from megatron_glm5.config import INDEXED_ATTENTION

    dsa = [i for i in layers if cfg.layer_types[i] == INDEXED_ATTENTION]
    for i in dsa:
        if cfg.indexer_types[i] == "shared" and not any(j < i and cfg.indexer_types[j] == "full" for j in dsa):
            raise LayoutError(
                f"--pp {pp}: shared-indexer DSA layer {i} has no full DSA layer before it on its pipeline stage "
                f"(layers {layers.start}..{layers.stop - 1})")
