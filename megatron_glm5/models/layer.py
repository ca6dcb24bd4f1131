"""The GLM-5.3 decoder layer: two mHC sites around (norm -> KDA | KPool-DSA) and (norm -> dense MLP | MoE).

Between layers the ``hc_mult`` residual streams travel as one plain ``[s, b, n*h]`` tensor (viewed as
``[s, b, n, h]`` inside the layer), so pipeline send/recv, recompute and sequence-parallel sharding along ``s``
need no special case.

Per site (HF ``Glm5NextTextDecoderLayer``)::

    post, comb, x = hc(streams)                  # x = sum_n pre_n * stream_n
    y = sublayer(norm(x))
    streams = post[..., None] * y[..., None, :] + comb^T @ streams

Selective activation recompute (``recompute_granularity='selective'``, megatron's ``recompute_modules``):
'layernorm' recomputes the two RMSNorms, 'core_attn' the whole mixer (KDA or DSA with its indexer: the
projections are cheap next to the delta rule / sparse attention, and recomputing the module keeps their code
untouched), 'mlp' the dense MLP; 'moe' and 'shared_experts' are handled by megatron's ``MoELayer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import GraphableMegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    _get_offloading_interface,
    get_transformer_layer_offset,
)
from megatron.core.utils import get_pg_rank

from megatron_glm5.execution_plan import moe_graph_blockers, plan_of
from megatron_glm5.models.cuda_graphs import GraphedModule
from megatron_glm5.models.mhc import HyperConnection, apply_hyper_connection_output


@dataclass
class Glm5LayerSubmodules(TransformerLayerSubmodules):
    """Submodules of one GLM-5.3 decoder layer: megatron's ``TransformerLayerSubmodules`` (whose
    ``input_layernorm``, ``self_attention``, ``pre_mlp_layernorm`` and ``mlp`` the layer builds; megatron's MTP layer
    reads ``self_attention``'s ``attn_mask_type`` through this type) plus the two mHC sites. The bias-dropout-add and
    cross-attention fields are not used."""

    attn_hc: Union[ModuleSpec, type] = HyperConnection
    ffn_hc: Union[ModuleSpec, type] = HyperConnection


def _build_attention(spec, config, layer_number, pg_collection):
    """Build KDA / DSA from its spec. Spec params (e.g. megatron's attn_mask_type, which MTP asserts) are not
    constructor arguments of our attention modules, so they are not forwarded."""
    if isinstance(spec, ModuleSpec):
        return spec.module(config=config, submodules=spec.submodules, layer_number=layer_number,
                           pg_collection=pg_collection)
    return spec(config=config, layer_number=layer_number, pg_collection=pg_collection)


class Glm5TransformerLayer(TransformerLayer):
    """One decoder layer, a megatron-core ``TransformerLayer`` as ``TransformerBlock`` and its recompute see it.

    ``layer_number`` is what ``TransformerBlock`` passes (1-based, local to the stage); the layer adds the stage's
    offset (megatron's ``get_transformer_layer_offset``) as ``TransformerLayer`` does, so ``self.layer_number`` is
    global. In megatron's MTP layer (``is_mtp_layer``) it is the MTP depth, and the MoE router logs its losses after
    the decoder layers' (megatron's ``TransformerLayer`` contract).

    ``TransformerLayer.__init__`` builds megatron's own submodule layout (bias-dropout-add, cross attention, MLP
    builders), so this layer runs ``GraphableMegatronModule.__init__`` and builds its own submodules; it sets the
    attributes megatron-core reads from a ``TransformerLayer`` (``layer_number``, ``is_moe_layer``,
    ``pg_collection``, ``submodules_config``, the selective-recompute and offloading flags)."""

    def __init__(self, config, submodules: Glm5LayerSubmodules, layer_number: int = 1, hidden_dropout=None,
                 pg_collection=None, vp_stage=None, is_mtp_layer: bool = False, add_layer_offset: bool = True,
                 pp_layer_offset=None, name=None):
        self.submodules_config = submodules
        GraphableMegatronModule.__init__(self, config=config, vp_stage=vp_stage)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        if is_mtp_layer or not add_layer_offset:
            self.layer_number = layer_number
        else:
            self.layer_number = layer_number + get_transformer_layer_offset(config, vp_stage,
                                                                            get_pg_rank(pg_collection.pp))
        layer_number = self.layer_number
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout
        self.is_mtp_layer = is_mtp_layer
        self.hc_mult = config.hc_mult
        self.plan = plan_of(config)
        self.attn_hc = build_module(submodules.attn_hc, config=config, layer_number=layer_number)
        self.input_layernorm = build_module(submodules.input_layernorm, config=config,
                                            hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        self.self_attention = _build_attention(submodules.self_attention, config, layer_number, pg_collection)
        self.self_attention.is_mtp_layer = is_mtp_layer   # the DSA indexer loss logs the MTP layer in a slot of its own
        from megatron_glm5.models.kpool_dsa import Glm5DSAttention

        self.is_dsa = isinstance(self.self_attention, Glm5DSAttention)
        self.ffn_hc = build_module(submodules.ffn_hc, config=config, layer_number=layer_number)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, config=config,
                                              hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        mlp_spec = submodules.mlp
        if isinstance(mlp_spec, ModuleSpec) and issubclass(mlp_spec.module, MoELayer):
            self.mlp = build_module(mlp_spec, config=config, layer_number=layer_number,
                                    pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        else:
            self.mlp = build_module(mlp_spec, config=config, ffn_hidden_size=config.ffn_hidden_size,
                                    tp_group=pg_collection.tp)
        self.is_moe_layer = isinstance(self.mlp, MoELayer)
        if hasattr(self.mlp, "set_layer_number"):  # the MoE router logs its aux loss per layer (megatron contract)
            self.mlp.set_layer_number(layer_number)
        # the plan's moe_cuda_graph: the MLP half of an MoE layer (its mHC input side, norm, MoE layer and mHC output
        # side, streams in and out) as replayed CUDA graphs where eligible (models/cuda_graphs.py)
        self.mlp_graphs = None
        if self.plan.moe_cuda_graph and self.is_moe_layer:
            self.mlp_graphs = GraphedModule(self, self._mlp_half, parts=("ffn_hc", "pre_mlp_layernorm", "mlp"))
        modules = (config.recompute_modules or []) if config.recompute_granularity == "selective" else []
        self.recompute_layernorm = "layernorm" in modules
        self.recompute_attention = "core_attn" in modules
        self.recompute_mlp = "mlp" in modules and not self.is_moe_layer
        # megatron's TransformerLayer flags (read by megatron-core's CUDA-graph and offloading code); the layer's own
        # selective recompute is the three flags above
        self.recompute_input_layernorm = self.recompute_pre_mlp_layernorm = False
        self._set_offload_modules()
        self.off_interface = _get_offloading_interface()
        self.mlp_norm_manager = None

    def _recompute(self, flag: bool) -> bool:
        return flag and self.training and torch.is_grad_enabled()

    def _norm(self, norm, x):
        if self._recompute(self.recompute_layernorm):
            return tensor_parallel.checkpoint(norm, False, x)
        return norm(x)

    def _attention(self, x, attention_mask, packed_seq_params, shared_topk_indices):
        """-> (output [s, b, h], topk_indices or None)."""
        def run(x_, topk_):
            if self.is_dsa:
                return self.self_attention(x_, attention_mask=attention_mask, packed_seq_params=packed_seq_params,
                                           shared_topk_indices=topk_)
            return self.self_attention(x_, attention_mask=attention_mask, packed_seq_params=packed_seq_params)[0], None

        if self._recompute(self.recompute_attention):
            return tensor_parallel.checkpoint(run, False, x, shared_topk_indices)
        return run(x, shared_topk_indices)

    def _moe(self, x, padding_mask=None):
        """megatron's MoELayer on ``x [s, b, h]`` -> ``[s, b, h]``: padding tokens (``padding_mask [b, s]``, True =
        padding) leave the loads and aux losses."""
        return self.mlp(x, padding_mask=padding_mask)[0]

    def _mlp(self, x, padding_mask=None):
        if self.is_moe_layer:
            return self._moe(x, padding_mask)
        if self._recompute(self.recompute_mlp):
            return tensor_parallel.checkpoint(lambda x_: self.mlp(x_)[0], False, x)
        return self.mlp(x)[0]

    def _mlp_half(self, streams, padding_mask=None):
        """The layer's second half on ``streams [s, b, n, h]`` -> new streams: mHC input side, norm, MLP, mHC output
        side (what :attr:`mlp_graphs` captures for MoE layers)."""
        post, comb, x, streams = self.ffn_hc(streams, pass_streams=True)
        x = self._norm(self.pre_mlp_layernorm, x)
        y = self._mlp(x, padding_mask)
        return apply_hyper_connection_output(y, streams, post, comb, fused=self.plan.mhc_fused and streams.is_cuda)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, context: Optional[torch.Tensor] = None,
                packed_seq_params=None, padding_mask: Optional[torch.Tensor] = None, **kwargs):
        """hidden_states: ``[s, b, n*h]`` streams. Returns ``(streams [s, b, n*h], context)``: megatron's
        ``TransformerLayer`` contract, as ``TransformerBlock`` and its ``checkpointed_forward`` call every layer.

        ``context`` is the shared indexer top-k ``[b, s, width]`` of this block (None before the first DSA layer):
        a DSA layer returns what its indexer selected (a full layer) or the top-k it reused (a 'shared' layer, which
        reads it from ``context``); a KDA layer returns ``context`` unchanged. ``TransformerBlock`` hands it from
        layer to layer and its full recompute saves it with each recomputed group's inputs, so a group that starts
        at a 'shared' layer recomputes with its own micro batch's top-k. ``padding_mask`` [b, s] bool (True =
        padding, this rank's tokens like ``hidden_states``) goes to the MoE router (megatron's ``MoELayer``):
        padding tokens are still computed but not counted in the expert loads (the expert-bias update) nor the aux
        losses. Other megatron arguments (rotary embeddings, inference context, ...) are not used (the LM is NoPE).
        """
        s, b, nh = hidden_states.shape
        n = self.hc_mult
        streams = hidden_states.view(s, b, n, nh // n)

        post, comb, x, streams = self.attn_hc(streams, pass_streams=True)
        x = self._norm(self.input_layernorm, x)
        y, topk = self._attention(x, attention_mask, packed_seq_params, context)
        streams = apply_hyper_connection_output(y, streams, post, comb, fused=self.plan.mhc_fused and streams.is_cuda)

        # the plan's rule, asked again each step: a config changed after the build (recompute on) runs eagerly
        if self.mlp_graphs is not None and not moe_graph_blockers(self.config):
            streams = self.mlp_graphs(streams, *(() if padding_mask is None else (padding_mask,)))
        else:
            streams = self._mlp_half(streams, padding_mask)
        return streams.reshape(s, b, nh), (context if topk is None else topk)


class Glm5MTPTransformerLayer(Glm5TransformerLayer):
    """The GLM layer inside megatron-core's ``MultiTokenPredictionLayer``.

    megatron's MTP layer hands a single ``[s, b, h]`` stream to its transformer layer and expects
    ``(hidden_states, context)`` back. The MTP layer of GLM-5.3 carries mHC parameters like every decoder layer, so
    the input is expanded to ``hc_mult`` identical streams, the layer runs, and the streams are averaged (the same
    contract as the main decoder's embedding expansion and final head). ``padding_mask`` (what megatron's MTP block
    hands down) reaches the MoE router as in a decoder layer.
    """

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None,
                padding_mask: Optional[torch.Tensor] = None, **kwargs):
        n = self.hc_mult
        s, b, h = hidden_states.shape
        streams = hidden_states.unsqueeze(2).expand(s, b, n, h).reshape(s, b, n * h)
        streams, _ = super().forward(streams, attention_mask=attention_mask, context=None,
                                     packed_seq_params=packed_seq_params, padding_mask=padding_mask)
        return streams.view(s, b, n, h).mean(dim=2), None
