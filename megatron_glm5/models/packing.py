"""Document boundaries of a packed row: the one source of truth is megatron-core's ``PackedSeqParams``.

A packed row is ``b = 1`` with ``packed_seq_params.cu_seqlens_q`` (int32, ``[n_docs + 1]``, starting at 0 and ending
at the row length). Without packing every batch row is one document.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams


def row_cu_seqlens(packed_seq_params: Optional[PackedSeqParams], seq_len: int, device) -> torch.Tensor:
    """cu_seqlens (int32, [n_docs + 1]) of one row of length ``seq_len``; ``[0, seq_len]`` without packing."""
    if packed_seq_params is None or packed_seq_params.cu_seqlens_q is None:
        return torch.tensor([0, seq_len], dtype=torch.int32, device=device)
    cu = packed_seq_params.cu_seqlens_q.to(device=device, dtype=torch.int32)
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != seq_len:
        raise ValueError(f"cu_seqlens must run from 0 to the row length {seq_len}, got {cu.tolist()}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
    return cu


def document_ids(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len] int64: the 0-based document index of every position."""
    pos = torch.arange(seq_len, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].long(), pos, right=True)


def document_starts(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len] int64: the row position where each position's document starts."""
    return cu_seqlens.long()[document_ids(cu_seqlens, seq_len)]


def make_packed_seq_params(cu_seqlens: torch.Tensor) -> PackedSeqParams:
    """PackedSeqParams (THD) for one packed row with the given document boundaries."""
    cu = cu_seqlens.to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len,
                           max_seqlen_kv=max_len)
