"""Document boundaries of a packed row: the one source of truth is megatron-core's ``PackedSeqParams``.

A packed row is ``b = 1`` with ``packed_seq_params.cu_seqlens_q`` (int32, ``[n_docs + 1]``, starting at 0 and ending
at the row length). Without packing every batch row is one document. The per-position document index and start
of a row's ``cu_seqlens`` are :mod:`megatron_glm5.kernels.documents`' (the kernels read them too).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_glm5.kernels.documents import document_starts


_CHECKED_ATTR = "_glm5_checked_row"


def _checked_row(packed_seq_params: PackedSeqParams, seq_len: int):
    """``(boundaries as python ints, {device: int32 tensor})`` of a packed row, checked once per
    ``PackedSeqParams``: reading the values is a host sync on CUDA, and every layer of a step asks. The result is
    remembered on the params object with the ``cu_seqlens_q`` object and the length it was checked for."""
    src = packed_seq_params.cu_seqlens_q
    checked = getattr(packed_seq_params, _CHECKED_ATTR, None)
    if checked is not None and checked[0] is src and checked[1] == seq_len:
        return checked[2], checked[3]
    row = [int(x) for x in src.tolist()] if src.dim() == 1 else []
    if len(row) < 2 or row[0] != 0 or row[-1] != seq_len:
        raise ValueError(f"cu_seqlens must run from 0 to the row length {seq_len}, got {src.tolist()}")
    if any(b < a for a, b in zip(row[:-1], row[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {row}")
    return row, _remember_row(packed_seq_params, src, seq_len, row, {})


def _remember_row(packed_seq_params: PackedSeqParams, src: torch.Tensor, seq_len: int, row: List[int],
                  on_device: dict) -> dict:
    """Keep the checked ``row`` of ``src`` (the ``cu_seqlens_q`` object it was read from) and its device copies
    ``on_device`` on the params object; returns ``on_device``."""
    setattr(packed_seq_params, _CHECKED_ATTR, (src, seq_len, row, on_device))
    return on_device


def row_cu_seqlens(packed_seq_params: Optional[PackedSeqParams], seq_len: int, device) -> torch.Tensor:
    """cu_seqlens (int32, [n_docs + 1]) of one row of length ``seq_len``; ``[0, seq_len]`` without packing."""
    if packed_seq_params is None or packed_seq_params.cu_seqlens_q is None:
        return torch.tensor([0, seq_len], dtype=torch.int32, device=device)
    _, on_device = _checked_row(packed_seq_params, seq_len)
    device = torch.device(device)
    if device not in on_device:
        on_device[device] = packed_seq_params.cu_seqlens_q.to(device=device, dtype=torch.int32)
    return on_device[device]


def row_document_starts(packed_seq_params: Optional[PackedSeqParams], seq_len: int, device) -> torch.Tensor:
    """int32 ``[seq_len]``: :func:`document_starts` of a packed row (zeros without packing), computed once per
    ``PackedSeqParams`` and device (every KDA layer of a step asks) from the cached device boundaries, without a
    host sync."""
    if packed_seq_params is None or packed_seq_params.cu_seqlens_q is None:
        return torch.zeros(seq_len, dtype=torch.int32, device=device)
    _, cache = _checked_row(packed_seq_params, seq_len)
    key = ("starts", torch.device(device))
    if key not in cache:
        cu = row_cu_seqlens(packed_seq_params, seq_len, device)
        cache[key] = document_starts(cu, seq_len).to(torch.int32)
    return cache[key]


def to_device_async(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device`` without making the host wait: staged through pinned memory and copied with
    ``non_blocking`` (a copy from pageable memory waits for all queued GPU work first)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def packed_seq_params_to(packed_seq_params: Optional[PackedSeqParams], device,
                         seq_len: int) -> Optional[PackedSeqParams]:
    """``packed_seq_params`` built on the host, its ``cu_seqlens_q`` / ``cu_seqlens_kv`` moved to ``device`` without
    making the host wait (:func:`to_device_async`), in place. The boundaries of the row of length ``seq_len`` are
    checked and remembered from the host copy first, so that the layers' :func:`row_boundaries` read no device
    tensor (a host sync a micro batch otherwise). On the CPU the same steps run (the copy is the tensor itself)."""
    if packed_seq_params is None or packed_seq_params.cu_seqlens_q is None:
        return packed_seq_params
    row, _ = _checked_row(packed_seq_params, seq_len)
    q, kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
    q_dev = to_device_async(q.to(torch.int32), device)
    packed_seq_params.cu_seqlens_q = q_dev
    if kv is not None:
        packed_seq_params.cu_seqlens_kv = q_dev if kv is q else to_device_async(kv, device)
    _remember_row(packed_seq_params, q_dev, seq_len, row, {torch.device(device): q_dev})
    return packed_seq_params


def fla_cu_seqlens(packed_seq_params: PackedSeqParams, seq_len: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(on device, on host)`` int64 boundaries of a packed row for FLA's varlen kernels (``cu_seqlens`` /
    ``cu_seqlens_cpu``): the same two tensor objects for every layer of the step and its backward, because FLA
    caches its chunk indices by tensor identity and builds them again, with a host-synchronizing copy, for a new
    object."""
    row, cache = _checked_row(packed_seq_params, seq_len)
    key = ("fla", torch.device(device))
    if key not in cache:
        host = torch.tensor(row, dtype=torch.long)
        cache[key] = (to_device_async(host, device), host)
    return cache[key]


def row_boundaries(packed_seq_params: Optional[PackedSeqParams], seq_len: int) -> List[int]:
    """:func:`row_cu_seqlens` as python ints (no host sync after the first ask)."""
    if packed_seq_params is None or packed_seq_params.cu_seqlens_q is None:
        return [0, seq_len]
    return list(_checked_row(packed_seq_params, seq_len)[0])


def make_packed_seq_params(cu_seqlens: torch.Tensor) -> PackedSeqParams:
    """PackedSeqParams (THD) for one packed row with the given document boundaries."""
    cu = cu_seqlens.to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len,
                           max_seqlen_kv=max_len)
