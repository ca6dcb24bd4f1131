"""Floating-point operations of one training iteration of GLM-5.3 — what ``--log-throughput`` divides by the
iteration time (TFLOP/s/GPU), in place of Megatron-LM's GPT / MLA / MoE formula, which has none of this model's
attention, mHC or vision terms.

Per text token (``T = global batch x seq_length`` tokens an iteration; forward 1x, backward 2x):

* ``6 N`` for the matrix weights a token passes through: every parameter of two or more dimensions except the word
  embedding (a lookup) and the vision tower; routed experts counted at ``topk / num_experts``. This holds the
  attention projections (KDA, MLA), the MLPs and experts, the router, mHC's projections, the short convolution, the
  LM head, and the MTP layer with its own pass through the LM head.
* The indexer's weights ``N_idx``, forward only (``2 N_idx``): it runs without gradients.
* KDA, per KDA layer and head (chunk ``C``, head dim ``d``): the chunked delta rule's ``4 C d`` (intra-chunk
  ``q k^T``, ``k k^T``, the corrected values and the intra-chunk output) and ``3 d^2`` (state read for the queries,
  for the keys, state update) multiply-adds: ``6 x 2 (4 C d + 3 d^2)`` a token.
* DSA, per DSA layer and head: absorbed attention over the latents (``d_c = kv_lora_rank``, ``d_r`` the rope part)
  of the positions the indexer selected: ``2 (2 d_c + d_r)`` a selected position forward, times 3. Query ``i``
  (0-based, in a document of at least ``i + 1`` tokens) reads ``K(i) = kpool min(topk / kpool, (i + 1) // kpool)``
  pool positions plus, with the tail, ``(i + 1) % kpool``; rows are counted as one document of ``seq_length``
  tokens (an upper bound for packed rows of shorter documents).
* The indexer's scores, per DSA layer: ``2 H_idx D_idx`` per complete visible pool (``(i + 1) // kpool``),
  forward only.
* mHC, per site (two a layer, the MTP layer's included): stream collapse, expansion and mixing,
  ``2 h n (n + 2)`` a token (``n = hc_mult``), times 3.

Vision (per image or video patch, from the micro batches' ``image_grid_thw`` and ``video_grid_thw``; a video's
``t`` temporal patches are ``t`` frames of ``h w`` patches, each its own attention segment): ``6 N_v`` for the
tower's matrix weights before the ``m x m`` merge, ``6 N_m / m^2`` for the downsample and merger, and attention
``12 depth h_v L`` for a patch in a frame of ``L`` patches; ``2`` and ``4`` instead of ``6`` and ``12`` with ``--freeze-vision``.

:func:`install` makes this Megatron-LM's ``num_floating_point_operations``; the model's weight counts are read
once, summed over the model-parallel ranks (:func:`weight_counts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

_MODEL_CHUNKS: List[torch.nn.Module] = []  # this rank's model chunks, registered by the model provider
_COUNTS: Dict[str, Optional["WeightCounts"]] = {"counts": None}
_VISION: Dict[int, List[float]] = {}  # iteration -> [patches, sum over frames of L^2], this rank's micro batches


@dataclass
class WeightCounts:
    """Weights a text token passes through, summed over the model-parallel ranks."""

    trained: float  # matrix weights of the language model and MTP (routed experts at topk / num_experts)
    indexer: float  # the DSA indexers' matrix weights (forward only)
    vision_patch: float  # vision tower matrix weights applied to every patch
    vision_merged: float  # downsample + merger matrix weights, applied to every merged token


def register_model_chunk(module: torch.nn.Module) -> None:
    _MODEL_CHUNKS.append(module)


def model_chunks() -> List[torch.nn.Module]:
    """This rank's model chunks, as the model provider registered them."""
    return list(_MODEL_CHUNKS)


def record_images(iteration: int, image_grid_thw: Optional[torch.Tensor],
                  video_grid_thw: Optional[torch.Tensor] = None) -> None:
    """Count a micro batch's image and video patches (and squared frame lengths) for iteration ``iteration``: the
    tower treats a ``[t, h, w]`` grid row, image or video, as ``t`` frames of ``h w`` patches."""
    for grid in (image_grid_thw, video_grid_thw):
        if grid is None or grid.numel() == 0:
            continue
        grid = grid.detach().to("cpu", torch.float64)
        frame = grid[:, 1] * grid[:, 2]
        entry = _VISION.setdefault(iteration, [0.0, 0.0])
        entry[0] += float((grid[:, 0] * frame).sum())
        entry[1] += float((grid[:, 0] * frame * frame).sum())


def _classify(name: str, param: torch.nn.Parameter, config) -> Optional[tuple]:
    """(bucket, weight) of a parameter for the per-token count, or None when it is not a matrix weight."""
    if param.dim() < 2 or name.endswith("word_embeddings.weight"):
        return None
    if "vision_model." in name:
        part = "vision_merged" if (".merger." in name or ".downsample." in name) else "vision_patch"
        return part, 1.0
    if ".indexer." in name:
        return "indexer", 1.0
    if ".experts." in name and config.num_moe_experts:
        return "trained", config.moe_router_topk / config.num_moe_experts
    return "trained", 1.0


def weight_counts(model_chunks: List[torch.nn.Module], config) -> WeightCounts:
    """The model's matrix weights per bucket (see :class:`WeightCounts`), each parameter counted once over tensor,
    pipeline and expert parallel ranks (a collective over the model-parallel groups)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.utils import unwrap_model

    keys = ("trained", "indexer", "vision_patch", "vision_merged")
    dense = torch.zeros(len(keys), dtype=torch.float64)
    expert = torch.zeros(len(keys), dtype=torch.float64)
    for chunk in unwrap_model(model_chunks):
        for name, p in chunk.named_parameters():
            if not param_is_not_tensor_parallel_duplicate(p):
                continue
            kind = _classify(name, p, config)
            if kind is None:
                continue
            bucket = expert if not getattr(p, "allreduce", True) else dense
            bucket[keys.index(kind[0])] += p.numel() * kind[1]
    if dist.is_initialized():
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dense, expert = dense.to(device), expert.to(device)
        dist.all_reduce(dense, group=parallel_state.get_model_parallel_group())
        dist.all_reduce(expert, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    total = (dense + expert).cpu().tolist()
    return WeightCounts(*total)


def selected_positions(seq_length: int, topk: int, kpool: int, tail: bool) -> float:
    """Sum over the queries of a ``seq_length``-token document of the positions its sparse attention reads."""
    i1 = torch.arange(1, seq_length + 1, dtype=torch.float64)
    pools = torch.clamp(torch.div(i1, kpool, rounding_mode="floor"), max=topk // kpool)
    k = kpool * pools + (torch.remainder(i1, kpool) if tail else 0.0)
    return float(k.sum())


def visible_pools(seq_length: int, kpool: int) -> float:
    """Sum over the queries of a ``seq_length``-token document of the complete pools the indexer scores."""
    i1 = torch.arange(1, seq_length + 1, dtype=torch.float64)
    return float(torch.div(i1, kpool, rounding_mode="floor").sum())


def text_forward_flops_per_row(config, counts: WeightCounts, seq_length: int) -> tuple:
    """Forward FLOPs of one row of ``seq_length`` text tokens: (the part that is backpropagated, the part that is
    not: the indexer). See the module docstring."""
    from megatron_glm5.config import INDEXED_ATTENTION

    s = float(seq_length)
    layer_types = list(config.layer_types)
    mtp = int(config.mtp_num_layers or 0)
    if mtp:  # the MTP layer's attention type, as models/layer_specs.get_mtp_block_spec builds it
        layer_types += [(config.hf_text_config.get("mtp_layer_types") or [INDEXED_ATTENTION])[0]] * mtp
    n_dsa = sum(1 for t in layer_types if t == INDEXED_ATTENTION)
    n_kda = len(layer_types) - n_dsa
    trained = 2.0 * counts.trained * s
    c, d = config.kda_chunk_size, config.linear_head_dim
    trained += n_kda * config.linear_num_heads * 2.0 * (4 * c * d + 3 * d * d) * s
    per_position = 2.0 * (2 * config.kv_lora_rank + config.qk_pos_emb_head_dim)
    positions = selected_positions(seq_length, config.index_topk, config.index_kpool,
                                   config.index_kpool_always_select_tail)
    trained += n_dsa * config.num_attention_heads * per_position * positions
    n, h = config.hc_mult, config.hidden_size
    trained += 2 * len(layer_types) * 2.0 * h * n * (n + 2) * s
    forward_only = 2.0 * counts.indexer * s
    forward_only += n_dsa * 2.0 * config.index_n_heads * config.index_head_dim * visible_pools(
        seq_length, config.index_kpool)
    return trained, forward_only


def text_flops_per_row(config, counts: WeightCounts, seq_length: int) -> float:
    """Training FLOPs of one row of ``seq_length`` text tokens: 3x the backpropagated forward, 1x the rest."""
    trained, forward_only = text_forward_flops_per_row(config, counts, seq_length)
    return 3.0 * trained + forward_only


def vision_flops(config, counts: WeightCounts, patches: float, frame_sq_sum: float, trained: bool) -> float:
    """FLOPs of the vision tower over ``patches`` patches whose frames' squared lengths sum to ``frame_sq_sum``."""
    if config.vision is None or patches == 0:
        return 0.0
    factor = 6.0 if trained else 2.0
    merge = config.vision.spatial_merge_size ** 2
    flops = factor * (counts.vision_patch * patches + counts.vision_merged * patches / merge)
    flops += 2.0 * factor * config.vision.depth * config.vision.hidden_size * frame_sq_sum
    return flops


def num_floating_point_operations(args, batch_size, seqlen_squared_sum_in_batch=None,
                                  total_real_tokens_in_batch=None) -> float:
    """Megatron-LM's ``num_floating_point_operations`` for this model: one iteration of ``batch_size`` rows (and the
    images its micro batches held on this rank, times the data-parallel size)."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    config = get_model_config(_MODEL_CHUNKS[0])
    if _COUNTS["counts"] is None:
        _COUNTS["counts"] = weight_counts(_MODEL_CHUNKS, config)
    counts = _COUNTS["counts"]
    flops = batch_size * text_flops_per_row(config, counts, args.seq_length)
    patches, frame_sq = _VISION.get(args.curr_iteration, (0.0, 0.0))
    dp = parallel_state.get_data_parallel_world_size()
    flops += dp * vision_flops(config, counts, patches, frame_sq, trained=not args.freeze_vision)
    for it in [k for k in _VISION if k < args.curr_iteration]:
        del _VISION[it]
    return flops


def install() -> None:
    """Make :func:`num_floating_point_operations` the one Megatron-LM's trainer uses (registered as
    ``flop_count`` in :mod:`megatron_glm5.extensions`)."""
    from megatron_glm5 import extensions

    extensions.apply(extensions.BY_NAME["flop_count"], num_floating_point_operations)
