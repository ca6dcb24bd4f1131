"""First-fit packing of documents into fixed-length rows, and the packed row layout.

A packed row holds whole documents back to back, then one padding document filling the tail (absent when the row
is full). Per row: ``tokens`` [s] int64, ``labels`` [s] int64 (``tokens`` shifted left by one; the last position
holds ``pad_id``), ``loss_mask`` [s] float32 (each document's own target mask, 0 on padding) and ``cu_seqlens``
[n_docs + 1] int32 from 0 to s (the padding document included). A document's target mask must be 0 at its last
position, so no label crosses a document boundary.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np
import torch


def first_fit(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """Pack items of ``lengths`` (each <= ``capacity``), in the given order, first-fit into bins of ``capacity``.

    Returns the bins in creation order, each the list of item indices in insertion order. Every item goes to the
    lowest-numbered bin with room for it (a max segment tree over the bins' free space finds it in O(log n)).
    """
    n = len(lengths)
    if n == 0:
        return []
    size = 1
    while size < n:
        size *= 2
    free = [0] * (2 * size)  # leaves size..2*size-1: free space of bins 0..size-1 (unopened bins count as 0)
    bins: List[List[int]] = []
    for i, length in enumerate(lengths):
        length = int(length)
        if length > capacity or length <= 0:
            raise ValueError(f"item {i} has length {length}, outside 1..{capacity}")
        if free[1] >= length:  # some open bin fits: walk down to the leftmost one
            node = 1
            while node < size:
                node = 2 * node if free[2 * node] >= length else 2 * node + 1
            b = node - size
        else:
            b = len(bins)
            bins.append([])
            node = b + size
            free[node] = capacity
        bins[b].append(i)
        free[node] -= length
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return bins


def assemble_row(doc_tokens: Sequence[np.ndarray], doc_targets: Sequence[np.ndarray], seq_length: int,
                 pad_id: int) -> Dict[str, torch.Tensor]:
    """One packed row of ``seq_length`` tokens from documents (int64 token arrays + bool target masks)."""
    used = sum(len(t) for t in doc_tokens)
    if used > seq_length:
        raise ValueError(f"documents of {used} tokens do not fit a row of {seq_length}")
    tokens = np.full(seq_length, pad_id, dtype=np.int64)
    loss_mask = np.zeros(seq_length, dtype=np.float32)
    bounds = [0]
    for t, m in zip(doc_tokens, doc_targets):
        a = bounds[-1]
        tokens[a:a + len(t)] = t
        loss_mask[a:a + len(t)] = m
        bounds.append(a + len(t))
    if used < seq_length:
        bounds.append(seq_length)
    labels = np.empty_like(tokens)
    labels[:-1] = tokens[1:]
    labels[-1] = pad_id
    return {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(loss_mask), "cu_seqlens": torch.tensor(bounds, dtype=torch.int32)}
