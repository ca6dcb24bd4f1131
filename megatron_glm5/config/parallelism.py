"""Where every layer lives under a parallel layout, and the one-line refusals of layouts that cannot work.

Pipeline stages use megatron-core's own config fields and arithmetic (``TransformerConfig``):

* ``pipeline_model_parallel_layout``: the string / list form (``'Ettt|ttmL'``: ``E`` embedding, ``t`` decoder
  layer, ``m`` MTP layer, ``L`` loss; ``|`` separates stages, listed ``vpp0 pp0, vpp0 pp1, ..., vpp1 pp0, ...``;
  ``(tt|)*3`` repeats), megatron's ``PipelineParallelLayerLayout``;
* ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage`` (Megatron-LM's
  ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``), the rest split evenly;
* neither: an even split (megatron's default). When ``pipeline_model_parallel_size`` does not divide the decoder
  layers (a 5-layer model at PP 2, the released 45 layers at PP 2/4/8) and no layout is given, the config is
  refused with one line that proposes :func:`balanced_pipeline_layout` (the extra layers on middle stages first:
  the first stage also runs the embedding and the vision tower, the last one the output layer, loss and MTP).

``stage_layer_ranges(config)`` gives the global decoder-layer indices of every ``(pp_rank, vp_stage)``, computed
from the config alone (no process groups), with megatron's ``get_transformer_layer_offset`` /
``get_num_layers_to_build`` (or the layout's own table).

Refusals (``Glm5ConfigError``, one line naming the field, raised from ``Glm5Config.__post_init__`` before
megatron's own checks so a user never sees an assertion traceback): tensor parallelism that does not divide the
heads (DSA, KDA), the vocabulary, the dense / shared-expert widths; expert tensor parallelism that does not divide
the expert width; expert parallelism that does not divide the routed experts; pipeline layouts whose stages do not
cover the layers, that hold the MTP layer anywhere but the last stage, or that cut between a 'shared' DSA layer and
the full DSA layer whose top-k it reuses (the top-k is *not* sent across stages: choose a layout that keeps them
together).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from megatron_glm5.errors import Glm5ConfigError
from megatron_glm5.layer_types import INDEXED_ATTENTION, SPARSE_MLP

__all__ = [
    "prepare_parallel_layout",
    "balanced_pipeline_layout",
    "stage_layer_ranges",
    "check_parallel_layout",
    "check_shared_indexers",
    "mtp_on_stage",
]


def _err(field: str, msg: str) -> Glm5ConfigError:
    return Glm5ConfigError(f"{field}: {msg}")


def balanced_pipeline_layout(num_layers: int, pp: int, vpp: Optional[int] = None, mtp: bool = False) -> str:
    """A ``pipeline_model_parallel_layout`` string for ``num_layers`` decoder layers over ``pp * vpp`` stages:
    ``num_layers // stages`` each, the remainder on the middle stages first, then the first stage, then the last.
    The MTP layer (if any) sits on the last stage with the loss.

    >>> balanced_pipeline_layout(5, 2)
    'Ettt|ttL'
    >>> balanced_pipeline_layout(45, 2, mtp=True)
    'Et*23|t*22mL'
    """
    stages = pp * (vpp or 1)
    if num_layers < stages:
        raise _err("pipeline_model_parallel_size",
                   f"{stages} pipeline stages (pp {pp} x vpp {vpp or 1}) for {num_layers} decoder layers: each "
                   f"stage needs at least one (or give pipeline_model_parallel_layout)")
    counts = [num_layers // stages] * stages
    order = list(range(1, stages - 1)) + [0, stages - 1]
    for i in range(num_layers % stages):
        counts[order[i]] += 1
    parts = []
    for i, c in enumerate(counts):
        part = ("E" if i == 0 else "") + (f"t*{c}" if c > 1 else "t" * c)
        if i == stages - 1:
            part += ("m" if mtp else "") + "L"
        parts.append(part)
    return "|".join(parts)


def _layout_table(config) -> Optional[List[List[list]]]:
    """The parsed layout ``[pp_rank][vp_stage] -> [LayerType, ...]`` or None without a custom layout."""
    layout = config.pipeline_model_parallel_layout
    if layout is None:
        return None
    if isinstance(layout, (str, list)):
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        layout = PipelineParallelLayerLayout(layout, config.pipeline_model_parallel_size)
    return layout.layout


def stage_layer_ranges(config) -> Dict[Tuple[int, int], range]:
    """``{(pp_rank, vp_stage): range of global 0-based decoder layers}`` for every (virtual) pipeline stage.
    ``vp_stage`` is 0 without virtual stages."""
    from megatron.core.transformer.enums import LayerType

    pp = config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size or 1
    table = _layout_table(config)
    if table is not None:
        vpp = len(table[0])
        out, offset = {}, 0
        for v in range(vpp):
            for r in range(pp):
                n = table[r][v].count(LayerType.decoder)
                out[(r, v)] = range(offset, offset + n)
                offset += n
        return out
    if pp == 1:
        return {(0, 0): range(config.num_layers)}
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    out = {}
    for r in range(pp):
        for v in range(vpp):
            vp_stage = v if config.virtual_pipeline_model_parallel_size else None
            off = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=r)
            n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=r)
            out[(r, v)] = range(off, off + n)
    return out


def mtp_on_stage(config, pp_rank: int, vp_stage: Optional[int]) -> bool:
    """Whether the MTP block lives on this (virtual) stage: always the last one (the loss stage)."""
    if not config.mtp_num_layers:
        return False
    vpp = config.virtual_pipeline_model_parallel_size
    last_vp = (vp_stage or 0) == ((vpp or 1) - 1)
    return pp_rank == config.pipeline_model_parallel_size - 1 and last_vp


def check_shared_indexers(config, layers: range, where: str) -> None:
    """A 'shared' DSA layer reuses the top-k of the previous full DSA layer, which must run in the same forward
    call (the same pipeline / virtual stage): the top-k is not sent across stages."""
    dsa = [i for i in layers if config.layer_types[i] == INDEXED_ATTENTION]
    for i in dsa:
        if config.indexer_types[i] == "shared" and not any(j < i and config.indexer_types[j] == "full" for j in dsa):
            raise _err("pipeline_model_parallel_layout",
                       f"shared-indexer DSA layer {i} would sit on {where} (layers {layers.start}..{layers.stop - 1}) "
                       f"without the full DSA layer whose top-k it reuses; choose stage boundaries that keep them "
                       f"together")


def _check_pipeline(config) -> None:
    from megatron.core.transformer.enums import LayerType

    pp = config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size
    n = config.num_layers
    if vpp is not None and vpp > 1 and pp == 1:
        raise _err("virtual_pipeline_model_parallel_size", f"{vpp} needs pipeline_model_parallel_size > 1")
    table = None
    if config.pipeline_model_parallel_layout is not None:
        try:
            table = _layout_table(config)
        except (AssertionError, ValueError) as e:
            raise _err("pipeline_model_parallel_layout", " ".join(str(e).split())) from None
        flat = [t for v in range(len(table[0])) for r in range(pp) for t in table[r][v]]
        if flat.count(LayerType.decoder) != n:
            raise _err("pipeline_model_parallel_layout",
                       f"holds {flat.count(LayerType.decoder)} decoder layers ('t'), the model has {n}")
        if flat[:1] != [LayerType.embedding] or flat[-1:] != [LayerType.loss] or flat.count(LayerType.embedding) != 1 \
                or flat.count(LayerType.loss) != 1:
            raise _err("pipeline_model_parallel_layout", "must start with one 'E' and end with one 'L'")
        m = flat.count(LayerType.mtp)
        if m != (config.mtp_num_layers or 0):
            raise _err("pipeline_model_parallel_layout",
                       f"holds {m} MTP layers ('m'), the model has {config.mtp_num_layers or 0}")
        if m and LayerType.mtp not in table[pp - 1][-1]:
            raise _err("pipeline_model_parallel_layout",
                       "the MTP layer ('m') must sit on the last stage, with the loss ('L')")
        if vpp is not None and len(table[0]) != vpp:
            raise _err("pipeline_model_parallel_layout",
                       f"describes {len(table[0])} virtual stages per rank, virtual_pipeline_model_parallel_size "
                       f"is {vpp}")
    elif pp > 1:
        first, last = config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage
        stages = pp * (vpp or 1)
        if first is None and last is None and n % stages:
            proposal = balanced_pipeline_layout(n, pp, vpp, bool(config.mtp_num_layers))
            raise _err("pipeline_model_parallel_size",
                       f"{stages} (virtual) pipeline stages do not divide {n} decoder layers; set "
                       f"pipeline_model_parallel_layout (e.g. '{proposal}') or num_layers_in_first/last_pipeline_stage")
        middle_layers, middle_stages = n, pp
        for name, v in (("num_layers_in_first_pipeline_stage", first), ("num_layers_in_last_pipeline_stage", last)):
            if v is not None:
                if v < 1:
                    raise _err(name, f"must be >= 1, got {v}")
                if vpp and v % vpp:
                    raise _err(name, f"{v} is not divisible by virtual_pipeline_model_parallel_size {vpp}")
                middle_layers -= v
                middle_stages -= 1
        if middle_layers < 0 or bool(middle_layers) != bool(middle_stages) or (
                middle_stages and middle_layers % (middle_stages * (vpp or 1))):
            raise _err("num_layers_in_first_pipeline_stage" if first is not None else
                       "num_layers_in_last_pipeline_stage",
                       f"{middle_layers} decoder layers left for the other {middle_stages} stage(s) (x vpp {vpp or 1}) "
                       f"of {n} layers at PP {pp}: they must divide evenly, at least one per stage")
    ranges = stage_layer_ranges(config)
    if sum(len(r) for r in ranges.values()) != n:
        raise _err("pipeline_model_parallel_layout", f"the stages hold {sum(len(r) for r in ranges.values())} of "
                                                     f"{n} decoder layers")
    for (r, v), layers in sorted(ranges.items()):
        where = f"pipeline stage {r}" + (f" virtual stage {v}" if (vpp or 1) > 1 else "")
        check_shared_indexers(config, layers, where)


def prepare_parallel_layout(config) -> None:
    """Called by ``Glm5Config.__post_init__`` before megatron-core's own checks: mark pipeline transfers as
    variable-shape (the mHC streams crossing a stage are ``[s, b, n*h]``, not megatron's default ``[s, b, h]``, so
    the schedules exchange shapes first: ``variable_seq_lengths``); with two stages and virtual stages, unbatched
    p2p; then :func:`check_parallel_layout`."""
    pp = config.pipeline_model_parallel_size
    per_chunk = getattr(config, "num_layers_per_virtual_pipeline_stage", None)
    if per_chunk is not None:
        field = "num_layers_per_virtual_pipeline_stage"
        if pp == 1:
            raise _err(field, "needs pipeline_model_parallel_size > 1")
        if (config.pipeline_model_parallel_layout is not None or config.num_layers_in_first_pipeline_stage is not None
                or config.num_layers_in_last_pipeline_stage is not None):
            raise _err(field, "only with even stages; give the virtual stages in pipeline_model_parallel_layout")
        if per_chunk < 1 or config.num_layers % (pp * per_chunk):
            raise _err(field, f"{per_chunk} layers per virtual stage do not divide {config.num_layers} decoder layers "
                              f"over {pp} pipeline stages")
        vpp = config.num_layers // (pp * per_chunk)
        if config.virtual_pipeline_model_parallel_size not in (None, vpp):
            raise _err(field, f"gives {vpp} virtual stages, virtual_pipeline_model_parallel_size is "
                              f"{config.virtual_pipeline_model_parallel_size}")
        config.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None
    if pp > 1:
        config.variable_seq_lengths = True
    if pp == 2 and (config.virtual_pipeline_model_parallel_size or 1) > 1:
        # the interleaved schedule sends an activation and a gradient to the same peer in one step; batched they
        # share one communicator and can be matched in the wrong order (gloo swaps them): megatron's unbatched path
        # puts the two directions on different communicators
        config.batch_p2p_comm = False
    check_parallel_layout(config)


def check_parallel_layout(config, for_training: bool = False) -> None:
    """Raise ``Glm5ConfigError`` (one line) unless the model of ``config`` can be built at the parallel sizes the
    config names (tensor / sequence / pipeline (+ layout, virtual stages) / expert / expert-tensor parallel).
    ``for_training`` adds megatron-core's training-only rule: MoE layers with TP > 1 need sequence parallelism."""
    tp = config.tensor_model_parallel_size
    etp = config.expert_tensor_parallel_size or tp
    ep = config.expert_model_parallel_size
    has_moe = SPARSE_MLP in config.mlp_layer_types or bool(config.mtp_num_layers and config.num_moe_experts)
    for name, v in (("tensor_model_parallel_size", tp), ("expert_tensor_parallel_size", etp),
                    ("expert_model_parallel_size", ep), ("pipeline_model_parallel_size",
                                                         config.pipeline_model_parallel_size)):
        if not isinstance(v, int) or v < 1:
            raise _err(name, f"must be a positive integer, got {v!r}")
    if tp > 1:
        need = [("num_attention_heads (DSA heads)", config.num_attention_heads),
                ("linear_num_heads (KDA heads)", config.linear_num_heads),
                ("vocab_size (embedding / output rows)", config.vocab_size),
                ("ffn_hidden_size (dense MLP)", config.ffn_hidden_size)]
        if has_moe and config.moe_shared_expert_intermediate_size:
            need.append(("moe_shared_expert_intermediate_size", config.moe_shared_expert_intermediate_size))
        bad = [f"{k} = {v}" for k, v in need if v % tp]
        if bad:
            raise _err("tensor_model_parallel_size", f"{tp} does not divide {', '.join(bad)}")
    if config.sequence_parallel and tp == 1:
        raise _err("sequence_parallel", "needs tensor_model_parallel_size > 1")
    if has_moe:
        if config.num_moe_experts % ep:
            raise _err("expert_model_parallel_size", f"{ep} does not divide num_moe_experts = {config.num_moe_experts}")
        if config.moe_ffn_hidden_size % etp:
            raise _err("expert_tensor_parallel_size",
                       f"{etp} does not divide moe_ffn_hidden_size = {config.moe_ffn_hidden_size}")
        if for_training and tp > 1 and not config.sequence_parallel:
            raise _err("sequence_parallel", f"MoE layers with tensor_model_parallel_size {tp} need sequence "
                                            f"parallelism in training (megatron-core)")
    elif ep > 1:
        raise _err("expert_model_parallel_size", f"{ep} > 1 but the model has no MoE layers")
    _check_pipeline(config)
