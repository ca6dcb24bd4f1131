"""The documents of a packed row, per position, from its boundaries ``cu_seqlens`` (int, ``[n_docs + 1]``, starting
at 0 and ending at the row length; :mod:`megatron_glm5.models.packing` reads them from megatron-core's
``PackedSeqParams``): the kernels' references and the models share these two."""

from __future__ import annotations

import torch

__all__ = ["document_ids", "document_starts"]


def document_ids(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[seq_len]`` int64: the 0-based document index of every position."""
    pos = torch.arange(seq_len, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].long(), pos, right=True)


def document_starts(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[seq_len]`` int64: the row position where each position's document starts."""
    return cu_seqlens.long()[document_ids(cu_seqlens, seq_len)]
