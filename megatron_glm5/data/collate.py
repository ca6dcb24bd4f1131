"""Batching of dataset rows into the micro-batch the training step consumes.

Plain rows (no ``cu_seqlens``): every key stacked to ``[b, ...]`` (``tokens`` / ``labels`` / ``loss_mask`` -> [b, s]).

Packed rows (``cu_seqlens`` present, megatron-core's THD convention with ``b = 1``): the ``b`` rows are laid end to
end as ONE row ``[1, b*s]`` (``tokens``, ``labels``, ``loss_mask`` and any other per-token key); ``cu_seqlens`` is
offset by each row's start and concatenated (int32, ``[sum(n_docs) + 1]``, 0 .. b*s); ``pixel_values`` /
``image_grid_thw`` and ``pixel_values_videos`` / ``video_grid_thw`` are concatenated over the rows that have them
(absent when none has), keeping image and video order equal to placeholder order; per-row counters
(``skipped_documents`` [1], ``modality_tokens`` [3]) are laid end to end like tokens ([1, b] and [1, 3b]).
Build ``PackedSeqParams`` from ``cu_seqlens`` with ``models.packing.make_packed_seq_params``.
"""

from __future__ import annotations

from typing import Dict, List

import torch

_IMAGE_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def _as_tensor(v) -> torch.Tensor:
    return v if isinstance(v, torch.Tensor) else torch.as_tensor(v)


def collate(samples: List[Dict]) -> Dict[str, torch.Tensor]:
    """Collate dataset rows (dicts of tensors; numpy scalars such as a blend's ``dataset_id`` are converted)."""
    if not samples:
        raise ValueError("collate: empty batch")
    packed = ["cu_seqlens" in s for s in samples]
    if any(packed) != all(packed):
        raise ValueError("collate: a batch mixes packed rows (with cu_seqlens) and plain rows")
    if not packed[0]:
        return {k: torch.stack([_as_tensor(s[k]) for s in samples]) for k in samples[0]}

    out: Dict[str, torch.Tensor] = {}
    cu, offset = [torch.zeros(1, dtype=torch.int32)], 0
    for s in samples:
        c = s["cu_seqlens"].to(torch.int32)
        n = int(s["tokens"].shape[0])
        if int(c[0]) != 0 or int(c[-1]) != n:
            raise ValueError(f"collate: cu_seqlens {c.tolist()} does not run from 0 to the row length {n}")
        cu.append(c[1:] + offset)
        offset += n
    out_keys = [k for k in samples[0] if k not in _IMAGE_KEYS and k != "cu_seqlens"]
    for k in out_keys:
        out[k] = torch.cat([_as_tensor(s[k]).reshape(-1) for s in samples]).unsqueeze(0)
    out["cu_seqlens"] = torch.cat(cu)
    for k in _IMAGE_KEYS:
        parts = [s[k] for s in samples if k in s]
        if parts:
            out[k] = torch.cat(parts)
    return out
