"""Whether a GLM-5.3 model can be built at a TP / PP / EP layout, checked from its config alone (no tensors).

Used by the converter to refuse a layout up front; megatron-core's own checks (``TransformerConfig`` and its
pipeline layer distribution) run too, their failures reported as one line.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_glm5.errors import CheckpointError
from megatron_glm5.config import Glm5Config


class LayoutError(CheckpointError):
    """A TP / PP / EP layout the model cannot be built at."""


def validate_layout(hf_config, tp: int = 1, pp: int = 1, ep: int = 1, pipeline_layout: Optional[str] = None,
                    first_stage_layers: Optional[int] = None, last_stage_layers: Optional[int] = None) -> None:
    """Raise LayoutError unless the model of ``hf_config`` (an HF checkpoint dir, config.json path or dict)
    can be built at TP=tp, PP=pp, EP=ep with the given pipeline layout (megatron's layout string, or the number of
    decoder layers on the first / last stage; none: even, refused when PP does not divide the layers; see
    ``megatron_glm5.config.parallelism``). Glm5ConfigError if the config itself is invalid."""
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
    if pp > 1 and cfg.num_layers < pp:
        raise LayoutError(f"--pp {pp} exceeds num_hidden_layers = {cfg.num_layers}")
    # the pipeline layout (stages, MTP on the last stage, shared-indexer DSA layers kept with their full layer) and
    # megatron's own checks (TransformerConfig.__post_init__)
    layout = dict(pipeline_model_parallel_layout=pipeline_layout, num_layers_in_first_pipeline_stage=first_stage_layers,
                  num_layers_in_last_pipeline_stage=last_stage_layers)
    try:
        Glm5Config.from_hf(hf_config, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                           expert_model_parallel_size=ep, pipeline_dtype=torch.bfloat16,
                           **{k: v for k, v in layout.items() if v is not None})
    except (AssertionError, ValueError) as e:
        raise LayoutError(f"--tp {tp} --pp {pp} --ep {ep}: {' '.join(str(e).split())}") from None
