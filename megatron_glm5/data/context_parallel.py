"""The one place that cuts a batch for context parallelism (CP).

A micro-batch is one packed row (``b = 1``, THD, as ``data/collate.py`` lays it out): ``{tokens [1, s],
labels [1, s], loss_mask [1, s], any other per-token [1, s] entry, cu_seqlens [n_docs + 1] (optional: one document),
pixel_values / image_grid_thw and pixel_values_videos / video_grid_thw (optional: the row's images and videos)}``.
:func:`split_batch_for_cp` pads the row and returns CP rank ``r``'s contiguous chunk plus the
:class:`~megatron_glm5.models.context_parallel.ContextParallelPackedSeqParams` the model needs.

Why contiguous chunks: with ``cp`` contiguous chunks of a causal model the last rank has the most keys to attend
to, so the work is not balanced (megatron's load-balanced cut gives rank ``r`` chunks ``r`` and ``2 cp - 1 - r``).
GLM-5.3 keeps the contiguous cut, like NeMo AutoModel does for this model: KDA's recurrent state must flow left to
right (a zig-zag cut would need two state hand-offs per rank), DSA attends to at most ``index_topk`` keys per
query whatever its position, and only the indexer's pool scoring grows with the position.

Padding: the row is padded at the end to a multiple of ``cp * chunk_multiple`` (``chunk_multiple = tp`` with
sequence parallelism, whose chunks are cut once more over TP). The padding is its own document (so it never joins
the last real document), with ``pad_token_id`` tokens and labels and 0 in every other per-token entry (loss mask
0): it changes no loss.

Images and videos: every CP rank keeps all of the row's ``pixel_values`` / ``image_grid_thw`` and
``pixel_values_videos`` / ``video_grid_thw`` (the vision tower runs on every CP rank; it is small and usually
frozen); ``image_token_offset`` / ``video_token_offset`` tell the model which feature rows belong to its chunk and
``video_span_depth`` whether the chunk begins inside a video, so an image or a video may span chunk edges.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from megatron_glm5.models.context_parallel import ContextParallelPackedSeqParams, local_cu_seqlens

__all__ = ["split_batch_for_cp", "merge_cp_chunks"]

ROW_KEYS = ("cu_seqlens", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
"""Entries that describe the whole row (never cut). Every other tensor entry of shape ``[1, s]`` is per-token."""


def _token_keys(batch: Dict, s: int) -> List[str]:
    return [k for k, v in batch.items()
            if k not in ROW_KEYS and torch.is_tensor(v) and tuple(v.shape) == (1, s)]


def split_batch_for_cp(batch: Dict, cp_size: int, cp_rank: int, config=None, *, chunk_multiple: int = 1,
                       pad_token_id: Optional[int] = None) -> Tuple[Dict, ContextParallelPackedSeqParams]:
    """CP rank ``cp_rank``'s chunk of a packed row and its ``PackedSeqParams``.

    Args:
        batch: ``tokens`` ``[1, s]`` (required), ``labels`` / ``loss_mask`` / other per-token ``[1, s]`` entries,
            ``cu_seqlens`` int ``[n_docs + 1]`` from 0 to ``s`` (absent: the row is one document), ``pixel_values`` /
            ``image_grid_thw`` and ``pixel_values_videos`` / ``video_grid_thw`` (all images and videos of the row),
            anything else (passed through).
        cp_size, cp_rank: the context-parallel group size and this rank's index in it (``cp_size = 1`` is allowed:
            the row is only padded).
        config: ``Glm5Config`` (image / video token ids, pad id); required when the batch has ``pixel_values`` or
            ``pixel_values_videos``.
        chunk_multiple: every chunk's length is a multiple of this (the TP size under sequence parallelism).
        pad_token_id: token id and label of the padding (default: ``config.pad_token_id``, else 0).

    Returns:
        ``(local_batch, packed_seq_params)``: ``local_batch`` holds the ``[1, L]`` slices of the per-token entries
        (``L = padded length / cp``) and every other entry unchanged (``cu_seqlens`` is replaced by the chunk's local
        boundaries); ``packed_seq_params`` is a ``ContextParallelPackedSeqParams`` (``cu_seqlens_q/kv``: local
        boundaries; ``cu_seqlens_global``, ``chunk_offset``, ``global_seq_len``, ``image_token_offset``,
        ``video_token_offset``, ``video_span_depth``).

    Raises:
        ValueError: a malformed batch (not one row, boundaries that do not cover the row, bad sizes).
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size or chunk_multiple < 1:
        raise ValueError(f"bad CP layout: cp_size={cp_size}, cp_rank={cp_rank}, chunk_multiple={chunk_multiple}")
    tokens = batch.get("tokens")
    if tokens is None or tokens.dim() != 2 or tokens.shape[0] != 1:
        raise ValueError("split_batch_for_cp needs batch['tokens'] of shape [1, s] (one packed row)")
    s = tokens.shape[1]
    token_keys = _token_keys(batch, s)
    for key in ("labels", "loss_mask"):
        if batch.get(key) is not None and key not in token_keys:
            raise ValueError(f"batch[{key!r}] has shape {tuple(batch[key].shape)}, expected (1, {s})")
    cu = batch.get("cu_seqlens")
    cu = torch.tensor([0, s], dtype=torch.int32) if cu is None else cu.detach().to("cpu", torch.int32).flatten()
    if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != s or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing from 0 to the row length {s}, got {cu.tolist()}")
    if pad_token_id is None:
        pad_token_id = getattr(config, "pad_token_id", None) or 0

    unit = cp_size * chunk_multiple
    total = -(-s // unit) * unit
    chunk = total // cp_size
    start = cp_rank * chunk
    if total > s:  # the padding is its own document
        cu = torch.cat([cu, cu.new_tensor([total])])

    local = {k: v for k, v in batch.items() if k not in token_keys}
    for key in token_keys:
        x = batch[key]
        if total > s:
            pad = pad_token_id if key in ("tokens", "labels") else 0
            x = torch.cat([x, x.new_full((1, total - s), pad)], dim=1)
        local[key] = x[:, start:start + chunk]

    offsets = {}
    if batch.get("pixel_values") is not None or batch.get("pixel_values_videos") is not None:
        if config is None:
            raise ValueError("split_batch_for_cp needs the model config to place the image and video tokens of a row")
        from megatron_glm5.models.vision import image_token_mask, video_token_mask

        before = tokens[:, :start]
        depth = int((before == config.video_start_token_id).sum()) - int((before == config.video_end_token_id).sum())
        offsets = dict(image_token_offset=int(image_token_mask(before, config).sum()),
                       video_token_offset=int(video_token_mask(before, config).sum()), video_span_depth=depth)

    local_cu = local_cu_seqlens(cu, start, chunk)
    if "cu_seqlens" in batch:
        local["cu_seqlens"] = local_cu
    max_len = int((local_cu[1:] - local_cu[:-1]).max())
    params = ContextParallelPackedSeqParams(
        qkv_format="thd", cu_seqlens_q=local_cu, cu_seqlens_kv=local_cu, max_seqlen_q=max_len, max_seqlen_kv=max_len,
        cu_seqlens_global=cu, chunk_offset=start, global_seq_len=total, row_length=s, **offsets)
    return local, params


def merge_cp_chunks(chunks: List[Dict], params: ContextParallelPackedSeqParams, seq_len: int) -> Dict:
    """Inverse of :func:`split_batch_for_cp` (tests, evaluation): all ranks' ``local_batch`` es in rank order, one
    rank's ``params`` and the unpadded row length -> the row: per-token entries concatenated with the padding cut off,
    ``cu_seqlens`` = the row's boundaries (if the chunks carry ``cu_seqlens``), everything else from rank 0."""
    token_keys = _token_keys(chunks[0], int(chunks[0]["tokens"].shape[1]))
    out = {k: v for k, v in chunks[0].items() if k not in token_keys and k != "cu_seqlens"}
    for key in token_keys:
        out[key] = torch.cat([c[key] for c in chunks], dim=1)[:, :seq_len]
    if "cu_seqlens" in chunks[0]:
        cu = params.cu_seqlens_global
        out["cu_seqlens"] = cu[cu <= seq_len]
    return out
