"""Synthetic packed multimodal rows in the layout transformers' Glm5Next processor produces."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

_SPECIAL_KEYS = ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
                 "video_start_token_id", "video_end_token_id")


def packed_documents(cfg_json: dict, doc_lens: Sequence[int], image_doc: Optional[int] = None,
                     grid_thw: Tuple[int, int, int] = (1, 4, 4), image_at: int = 2, seed: int = 0):
    """Random documents for one packed row, optionally one image in document ``image_doc``.

    ``cfg_json`` is an HF GLM-5.3 config.json dict. Returns (docs: list of int64 [n_i] token tensors, pixel_values
    [t*h*w, C*T*P*P] or None, image_grid_thw [1, 3] or None). The image is
    ``<begin_image> <image> * (t*h*w / merge^2) <end_image>`` starting at ``image_at``; no other token of any
    document is a special (image / video) token.
    """
    g = torch.Generator().manual_seed(seed)
    vocab = cfg_json["text_config"]["vocab_size"]
    special = {cfg_json[k] for k in _SPECIAL_KEYS if k in cfg_json}
    filler = next(i for i in range(1, vocab) if i not in special)
    docs: List[torch.Tensor] = []
    for n in doc_lens:
        ids = torch.randint(1, vocab, (n,), generator=g)
        for s in special:
            ids[ids == s] = filler
        docs.append(ids)
    if image_doc is None:
        return docs, None, None
    v = cfg_json["vision_config"]
    grid = torch.tensor([list(grid_thw)])
    n_img = int(grid.prod()) // v["spatial_merge_size"] ** 2
    d = docs[image_doc]
    if image_at + n_img + 2 > d.numel():
        raise ValueError(f"document {image_doc} ({d.numel()} tokens) is too short for {n_img} image tokens")
    d[image_at] = cfg_json["image_start_token_id"]
    d[image_at + 1:image_at + 1 + n_img] = cfg_json["image_token_id"]
    d[image_at + 1 + n_img] = cfg_json["image_end_token_id"]
    pixel_values = torch.randn(int(grid.prod()), v.get("in_channels", 3) * v["temporal_patch_size"] * v["patch_size"] ** 2,
                               generator=g)
    return docs, pixel_values, grid


def cu_seqlens_of(doc_lens: Sequence[int]) -> torch.Tensor:
    """int32 document boundaries [0, l0, l0+l1, ...] of one packed row."""
    out = [0]
    for n in doc_lens:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32)
