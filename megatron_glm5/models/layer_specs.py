"""Per-layer ModuleSpecs for GLM-5.3 from ``layer_types`` / ``mlp_layer_types``, sliced to a PP (and VPP) stage.

Layer i (0-based) is built from:
  attention: 'linear_attention' -> KimiDeltaAttention, 'indexed_attention' -> Glm5DSAttention
  mlp:       'dense' -> megatron-core MLP (fused [gate; up] fc1, clamped SwiGLU)
             'sparse' -> megatron-core MoELayer (sigmoid router + expert bias, SequentialMLP experts -- or
                         GroupedExperts with the plan's moe_experts_backend 'grouped' -- and a shared expert)
"""

from __future__ import annotations

import copy
from typing import List, Optional

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_glm5.config import INDEXED_ATTENTION, LINEAR_ATTENTION, SPARSE_MLP, Glm5Config
from megatron_glm5.execution_plan import plan_of
from megatron_glm5.models.grouped_experts import GroupedExperts
from megatron_glm5.models.kda import get_kda_module_spec
from megatron_glm5.models.kpool_dsa import get_dsa_module_spec
from megatron_glm5.models.layer import Glm5LayerSubmodules, Glm5MTPTransformerLayer, Glm5TransformerLayer
from megatron_glm5.models.mhc import HyperConnection
from megatron_glm5.models.mtp import Glm5MultiTokenPredictionLayer
from megatron_glm5.models.norms import RMSNorm

_MLP_SUBMODULES = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def get_dense_mlp_spec() -> ModuleSpec:
    """Dense clamped-SwiGLU MLP: linear_fc1 = [gate; up] (column parallel), linear_fc2 = down (row parallel)."""
    return ModuleSpec(module=MLP, submodules=_MLP_SUBMODULES)


def get_moe_spec(config: Optional[Glm5Config] = None) -> ModuleSpec:
    """megatron-core MoELayer with SequentialMLP routed experts (GroupedExperts, the same parameters run as grouped
    GEMMs, when the execution plan's ``moe_experts_backend`` is 'grouped') and one fused shared expert."""
    grouped = config is not None and plan_of(config).moe_experts_backend == "grouped"
    return ModuleSpec(
        module=MoELayer,
        submodules=MoESubmodules(
            experts=ModuleSpec(module=GroupedExperts if grouped else SequentialMLP, submodules=_MLP_SUBMODULES),
            shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=_MLP_SUBMODULES),
        ),
    )


def get_layer_spec(config: Glm5Config, layer_idx: int, attention_type: Optional[str] = None,
                   mlp_type: Optional[str] = None) -> ModuleSpec:
    """Spec of decoder layer ``layer_idx`` (0-based global index)."""
    attention_type = attention_type or config.layer_types[layer_idx]
    mlp_type = mlp_type or config.mlp_layer_types[layer_idx]
    attention = get_kda_module_spec() if attention_type == LINEAR_ATTENTION else get_dsa_module_spec()
    mlp = get_moe_spec(config) if mlp_type == SPARSE_MLP else get_dense_mlp_spec()
    return ModuleSpec(
        module=Glm5TransformerLayer,
        submodules=Glm5LayerSubmodules(
            attn_hc=HyperConnection, input_layernorm=RMSNorm, self_attention=attention,
            ffn_hc=HyperConnection, pre_mlp_layernorm=RMSNorm, mlp=mlp,
        ),
    )


def get_decoder_layer_specs(config: Glm5Config) -> List[ModuleSpec]:
    """One spec per global decoder layer."""
    return [get_layer_spec(config, i) for i in range(config.num_layers)]


def get_stage_layer_range(config: Glm5Config, vp_stage: Optional[int] = None,
                          pp_rank: Optional[int] = None) -> range:
    """Global 0-based indices of the decoder layers the PP stage ``pp_rank`` (default: this process's) and virtual
    stage ``vp_stage`` builds (uneven stages, layouts and virtual stages: :mod:`megatron_glm5.config.parallelism`)."""
    from megatron.core import parallel_state

    from megatron_glm5.config.parallelism import stage_layer_ranges

    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank() if config.pipeline_model_parallel_size > 1 else 0
    vpp = config.virtual_pipeline_model_parallel_size
    if vpp and vpp > 1 and vp_stage is None:
        raise ValueError("vp_stage is required with virtual pipeline stages")
    return stage_layer_ranges(config)[(pp_rank, vp_stage or 0)]


def get_mtp_block_spec(config: Glm5Config) -> Optional[ModuleSpec]:
    """megatron-core MultiTokenPredictionBlock spec whose transformer layer is a GLM layer (mHC included).

    The MTP layer's attention / MLP type: ``hf_text_config['mtp_layer_types']`` if given, else a DSA + MoE layer
    (the DeepSeek-V3.2 / GLM-5 convention). megatron's MTP asserts a causal ``attn_mask_type`` on the attention spec.
    """
    if not config.mtp_num_layers:
        return None
    extra = config.hf_text_config.get("mtp_layer_types") or [INDEXED_ATTENTION, SPARSE_MLP]
    spec = get_layer_spec(config, 0, attention_type=extra[0], mlp_type=extra[1])
    spec = copy.deepcopy(spec)
    spec.module = Glm5MTPTransformerLayer
    spec.submodules.self_attention.params = {"attn_mask_type": AttnMaskType.causal}
    layer = ModuleSpec(
        module=Glm5MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=RMSNorm, hnorm=RMSNorm, eh_proj=ColumnParallelLinear, mtp_model_layer=spec, layer_norm=RMSNorm),
    )
    return ModuleSpec(module=MultiTokenPredictionBlock, submodules=MultiTokenPredictionBlockSubmodules(
        layer_specs=[layer] * config.mtp_num_layers))
