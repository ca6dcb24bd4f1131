"""Contiguous context parallelism (CP): what the model's modules need to run on one CP chunk of a packed row.

Layout. A packed row (``b = 1``, megatron-core ``PackedSeqParams`` THD) of ``S`` tokens (padded so that
``S = cp * L``) is cut into ``cp`` *contiguous* chunks: CP rank ``r`` owns row positions ``[r L, (r + 1) L)``.
Contiguous chunks of a causal model are not load-balanced (rank ``cp - 1`` attends to the most keys), but GLM-5.3's
mixers make the imbalance small and the contiguous cut necessary:

* KDA is a left-to-right recurrence; with contiguous chunks each rank needs only the recurrent state and the
  ``W - 1`` conv inputs at its left edge (:mod:`megatron_glm5.models.kda_cp`). The zig-zag cut megatron uses for
  softmax attention would need two such hand-offs per rank and buys nothing for a linear mixer.
* DSA's cost per query is capped by ``index_topk``; only the indexer's pool scoring grows with the position.

So this is NeMo AutoModel's choice for the same model (facts in ``shared/research``), implemented here on megatron
process groups.

What every rank is given: :class:`ContextParallelPackedSeqParams` (built by
:func:`megatron_glm5.data.context_parallel.split_batch_for_cp`). Its ``cu_seqlens_q`` / ``cu_seqlens_kv`` are the
*local* document boundaries of the chunk (global boundaries clipped to the chunk and shifted; 0 and ``L`` always
included), so code that is not CP-aware sees the chunk as an ordinary packed row. The CP-aware modules (KDA's state
and conv hand-off, the KPool indexer, DSA, the MTP roll, the image splice) also read:

* ``cu_seqlens_global``: document boundaries of the whole padded row (int32 ``[n_docs + 1]``, ends at ``S``);
* ``chunk_offset``: row position of this rank's first token (``r L``), ``global_seq_len``: ``S``;
* ``image_token_offset`` / ``video_token_offset``: how many image / video tokens (rows of the vision tower's image
  / video features) precede the chunk; ``video_span_depth``: video spans open at the chunk's first token (video
  starts minus ends before it), so a chunk that begins inside a video reads its image-token ids as video tokens.

Under CP every module takes its CP group from its ``pg_collection`` (megatron's ``cp`` group by default); all
cross-rank traffic is collectives on that group (all-gathers whose backward is a reduce-scatter), issued by every
rank in the same order, so no rank can wait on a peer that skipped one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from megatron_glm5.models.packing import row_cu_seqlens

__all__ = [
    "ContextParallelPackedSeqParams",
    "SequenceLayout",
    "sequence_layout",
    "local_cu_seqlens",
    "cp_group_of",
    "gather_sequence",
    "cp_all_reduce",
    "cp_token_mean",
    "mtp_loss_terms",
    "roll_left_in_documents",
    "video_span_depth_of",
    "local_image_features",
    "local_video_features",
]


@dataclass
class ContextParallelPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` of one CP chunk of a packed row (see the module docstring).

    ``cu_seqlens_q`` / ``cu_seqlens_kv``: local boundaries ``[0, ..., L]`` of the chunk (int32).
    ``cu_seqlens_global``: boundaries of the whole padded row ``[0, ..., S]`` (int32); ``chunk_offset``: the row
    position of the chunk's first token; ``global_seq_len``: ``S``; ``image_token_offset`` / ``video_token_offset``:
    image / video tokens before the chunk (index of the chunk's first image / video feature row);
    ``video_span_depth``: video spans open at the chunk's first token; ``row_length``: the row's length before the
    split's padding (positions from it on are padding; 0: not recorded, read as ``S``).
    """

    cu_seqlens_global: torch.Tensor = None
    chunk_offset: int = 0
    global_seq_len: int = 0
    image_token_offset: int = 0
    video_token_offset: int = 0
    video_span_depth: int = 0
    row_length: int = 0


def cp_group_of(pg_collection=None):
    """The CP process group: ``pg_collection.cp`` if given, else megatron's global one (``None`` when megatron's
    parallel state is not initialised, e.g. a module built stand-alone)."""
    if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
        return pg_collection.cp
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_context_parallel_group()
    return None


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def local_cu_seqlens(cu_global: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Boundaries of the window ``[start, start + length)`` of a row: the global boundaries strictly inside it,
    shifted by ``-start``, plus 0 and ``length`` (int32)."""
    cu = cu_global.long()
    inner = cu[(cu > start) & (cu < start + length)] - start
    ends = inner.new_tensor([0, length])
    return torch.cat([ends[:1], inner, ends[1:]]).to(torch.int32)


@dataclass
class SequenceLayout:
    """Where this rank's ``local_len`` tokens sit in the row.

    ``cu_seqlens``: global row boundaries (int32, on the tensors' device), ``offset``: row position of local token 0,
    ``global_len``: row length ``S``; ``cp_group`` / ``cp_size`` / ``cp_rank``. Without CP: ``offset = 0`` and
    ``global_len = local_len``.
    """

    cu_seqlens: torch.Tensor
    offset: int
    local_len: int
    global_len: int
    cp_group: Optional[object] = None
    cp_size: int = 1
    cp_rank: int = 0

    @property
    def is_cp(self) -> bool:
        return self.cp_size > 1

    @property
    def local_cu_seqlens(self) -> torch.Tensor:
        """Boundaries of the local chunk ``[0, ..., local_len]``."""
        if not self.is_cp:
            return self.cu_seqlens
        return local_cu_seqlens(self.cu_seqlens, self.offset, self.local_len)

    def chunk_starts_document(self, rank: int) -> bool:
        """Does CP rank ``rank``'s chunk begin with the first token of a document (rank 0 always does)?"""
        start = rank * self.local_len
        return start == 0 or bool((self.cu_seqlens == start).any())

    def chunk_is_one_piece(self, rank: int) -> bool:
        """Is CP rank ``rank``'s whole chunk the middle of one document (no boundary at or inside its left edge)?"""
        start = rank * self.local_len
        cu = self.cu_seqlens
        return not bool(((cu >= start) & (cu < start + self.local_len)).any())


def sequence_layout(packed_seq_params: Optional[PackedSeqParams], local_len: int, device,
                    cp_group=None) -> SequenceLayout:
    """The :class:`SequenceLayout` of this rank's tokens.

    Without CP (``cp_group`` of size 1 or ``None``) the row is local: ``row_cu_seqlens(packed_seq_params)``,
    offset 0 (a :class:`ContextParallelPackedSeqParams` of a single chunk works too). Under CP the batch must come
    from :func:`~megatron_glm5.data.context_parallel.split_batch_for_cp` (a :class:`ContextParallelPackedSeqParams`
    whose chunk length and offset match this rank), else ``ValueError``.
    """
    cp = _size(cp_group)
    if cp == 1:
        return SequenceLayout(row_cu_seqlens(packed_seq_params, local_len, device), 0, local_len, local_len)
    if not isinstance(packed_seq_params, ContextParallelPackedSeqParams):
        raise ValueError("context parallelism needs the batch cut by megatron_glm5.data.context_parallel."
                         "split_batch_for_cp (its ContextParallelPackedSeqParams as packed_seq_params)")
    rank = _rank(cp_group)
    p = packed_seq_params
    if p.global_seq_len != cp * local_len or p.chunk_offset != rank * local_len:
        raise ValueError(f"CP rank {rank} of {cp} got a chunk of {local_len} tokens at offset {p.chunk_offset} of a "
                         f"{p.global_seq_len}-token row; expected offset {rank * local_len} of {cp * local_len}")
    cu = p.cu_seqlens_global.to(device=device, dtype=torch.int32)
    return SequenceLayout(cu, p.chunk_offset, local_len, p.global_seq_len, cp_group, cp, rank)


def gather_sequence(x: torch.Tensor, group, seq_dim: int = 0) -> torch.Tensor:
    """All-gather ``x`` along its sequence dim over the CP ``group`` (chunks concatenated in rank order, i.e. row
    order). Differentiable: the backward reduce-scatters (sums every rank's gradient of each chunk onto its owner).
    Identity for a group of one."""
    if _size(group) == 1:
        return x
    if seq_dim != 0:
        x = x.transpose(0, seq_dim)
    out = gather_from_sequence_parallel_region(x.contiguous(), tensor_parallel_output_grad=True, group=group)
    return out.transpose(0, seq_dim) if seq_dim != 0 else out


def cp_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of a (detached) tensor over the CP ``group`` (a copy; ``x`` itself is not modified)."""
    x = x.detach().clone()
    if _size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def cp_token_mean(values: torch.Tensor, mask: torch.Tensor, group) -> torch.Tensor:
    """This rank's share of the mean of ``values`` over the masked tokens of the whole row:
    ``sum_local(values * mask) / sum_over_CP_ranks(mask)``. Summed over the CP ranks it is the row's mean; an empty
    mask everywhere gives 0, never NaN. Differentiable in ``values``.

    The LM loss under CP, exactly as on one rank: a megatron ``loss_func`` returns ``(cp_token_mean(loss, mask,
    cp_group), {...})`` (the 2-tuple form: the schedule multiplies by ``cp`` and DDP averages over DP x CP), or,
    with ``calculate_per_token_loss``, ``(sum(loss * mask), mask.sum(), {...})`` (summed, normalised after the
    gradient reduction by the global token count)."""
    count = cp_all_reduce(mask.float().sum(), group).clamp(min=1)
    return (values.float() * mask.float()).sum() / count


def mtp_loss_terms(per_token_loss: torch.Tensor, loss_mask: torch.Tensor, group, per_token_loss_mode: bool):
    """One MTP depth's loss under (contiguous) context parallelism.

    Args:
        per_token_loss: ``[b, s]`` this chunk's MTP cross entropy (already shifted); loss_mask: ``[b, s]``.
        group: the CP group; per_token_loss_mode: ``config.calculate_per_token_loss``.

    Returns:
        ``(mean, attached)``: ``mean`` the row's MTP loss (detached, same on every CP rank: for logging);
        ``attached`` what this rank hands to ``MTPLossAutoScaler`` (times the MTP scaling factor). With
        ``calculate_per_token_loss`` that is the local sum (megatron normalises after the gradient reduction);
        otherwise ``cp`` times this rank's share of the row's mean: megatron's DDP averages gradients over DP x CP,
        and its schedule does not scale the MTP loss by ``cp`` (megatron issue #3959), so the factor lives here.
        Empty chunks contribute 0 (no NaN).
    """
    share = cp_token_mean(per_token_loss, loss_mask, group)
    mean = cp_all_reduce(share, group)
    if per_token_loss_mode:
        return mean, (per_token_loss.float() * loss_mask.float()).sum()
    return mean, share * _size(group)


def roll_left_in_documents(x: torch.Tensor, packed_seq_params: Optional[PackedSeqParams], group) -> torch.Tensor:
    """Shift ``x`` ``[b, s]`` left by one token inside every document, for contiguous CP chunks: position ``t`` gets
    the value at row position ``t + 1`` when that token is in the same document, else 0 (the last token of every
    document and of the row). The value that crosses a chunk edge comes from the next CP rank (one all-gather of the
    chunks' first tokens). Without CP this is megatron's ``roll_tensor(x, -1, -1, packed_seq_params=...)`` (whose CP
    branch assumes megatron's zig-zag chunks). Not differentiable (labels, masks, token ids)."""
    b, s = x.shape
    layout = sequence_layout(packed_seq_params, s, x.device, group)
    out = torch.zeros_like(x)
    out[:, :-1] = x[:, 1:]
    if layout.is_cp:
        with torch.no_grad():
            firsts = gather_sequence(x[:, :1].transpose(0, 1), group)  # [cp, b]: every chunk's first token
        if layout.cp_rank + 1 < layout.cp_size:
            out[:, -1] = firsts[layout.cp_rank + 1]
    nxt = torch.arange(s, device=x.device) + layout.offset + 1
    starts_doc = torch.isin(nxt, layout.cu_seqlens.long()) | (nxt >= layout.global_len)
    return out.masked_fill(starts_doc[None, :], 0)


def video_span_depth_of(packed_seq_params: Optional[PackedSeqParams]) -> int:
    """Video spans open at the first token of this rank's tokens: ``video_span_depth`` of a CP chunk, else 0."""
    return getattr(packed_seq_params, "video_span_depth", 0) if isinstance(
        packed_seq_params, ContextParallelPackedSeqParams) else 0


def _local_features(features, input_ids, packed_seq_params, config, video: bool) -> torch.Tensor:
    if not isinstance(packed_seq_params, ContextParallelPackedSeqParams) or \
            packed_seq_params.global_seq_len == input_ids.shape[-1]:
        return features
    from megatron_glm5.models.vision import image_token_mask, video_token_mask

    p = packed_seq_params
    mask = (video_token_mask if video else image_token_mask)(input_ids, config, p.video_span_depth)
    start = p.video_token_offset if video else p.image_token_offset
    return features[start:start + int(mask.sum())]


def local_image_features(features: torch.Tensor, input_ids: torch.Tensor,
                         packed_seq_params: Optional[PackedSeqParams], config) -> torch.Tensor:
    """The rows of the vision tower's image features ``[n_img_tokens_of_row, h]`` that belong to this chunk's
    image tokens (every CP rank runs the tower on all images of its row). Without CP: ``features`` unchanged."""
    return _local_features(features, input_ids, packed_seq_params, config, video=False)


def local_video_features(features: torch.Tensor, input_ids: torch.Tensor,
                         packed_seq_params: Optional[PackedSeqParams], config) -> torch.Tensor:
    """:func:`local_image_features` for the video features ``[n_video_tokens_of_row, h]`` (every CP rank runs the
    tower on all videos of its row; a video may span chunk edges)."""
    return _local_features(features, input_ids, packed_seq_params, config, video=True)
