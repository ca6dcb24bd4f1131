#!/usr/bin/env python
"""Run megatron_glm5's GLM-5.3 model on an HF checkpoint and write its logits.

    python tools/hf_forward.py --hf-dir DIR --input IN.pt --output OUT.pt [--dtype fp32|bf16] [--device cpu|cuda]

IN.pt: a dict saved with torch.save holding ``input_ids`` [b, s] int64 and optionally ``pixel_values``
[num_patches, C*T*P*P] with ``image_grid_thw`` [num_images, 3] (the layout transformers' Glm5Next processor
produces) and ``cu_seqlens`` (int32 document boundaries of one packed row, b = 1).
OUT.pt: ``{"logits": [b, s, vocab] float32}``. On bad input it prints one error line and writes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class InputError(ValueError):
    pass


def _check_inputs(batch, vocab_size: int, has_vision: bool, image_token_id: int):
    import torch

    if not isinstance(batch, dict):
        raise InputError(f"input file must hold a dict, got {type(batch).__name__}")
    unknown = set(batch) - {"input_ids", "pixel_values", "image_grid_thw", "cu_seqlens", "attention_mask"}
    if unknown:
        raise InputError(f"unknown input keys {sorted(unknown)}")
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise InputError("input_ids must be an int64 tensor of shape [b, s]")
    if ids.numel() == 0:
        raise InputError("input_ids is empty")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise InputError(f"input_ids out of range [0, {vocab_size})")
    if "attention_mask" in batch and not bool(batch["attention_mask"].bool().all()):
        raise InputError("padding attention_mask is not supported; pack documents with cu_seqlens instead")
    cu = batch.get("cu_seqlens")
    if cu is not None:
        if ids.shape[0] != 1:
            raise InputError(f"cu_seqlens needs one packed row (b = 1), got b = {ids.shape[0]}")
        if cu.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != ids.shape[1] or bool((cu[1:] <= cu[:-1]).any()):
            raise InputError(f"cu_seqlens must increase strictly from 0 to s = {ids.shape[1]}, got {cu.tolist()}")
    pv, grid = batch.get("pixel_values"), batch.get("image_grid_thw")
    if (pv is None) != (grid is None):
        raise InputError("pixel_values and image_grid_thw must be given together")
    if pv is not None:
        if not has_vision:
            raise InputError("pixel_values given but the checkpoint has no vision_config")
        if grid.dim() != 2 or grid.shape[1] != 3:
            raise InputError("image_grid_thw must be [num_images, 3]")
        if pv.dim() != 2 or pv.shape[0] != int(grid.prod(-1).sum()):
            raise InputError(f"pixel_values must be [sum(t*h*w) = {int(grid.prod(-1).sum())}, C*T*P*P], "
                             f"got {tuple(pv.shape)}")


def run(hf_dir: str, batch: dict, dtype: str = "fp32", device: str = "cpu"):
    """Build the model from ``hf_dir``, load it and return logits [b, s, vocab] float32."""
    import torch

    from megatron_glm5.config import Glm5Config
    from megatron_glm5.models.builder import build_model_from_hf
    from megatron_glm5.models.packing import make_packed_seq_params

    cfg = Glm5Config.from_hf(hf_dir)
    _check_inputs(batch, cfg.vocab_size, cfg.vision is not None, cfg.image_token_id)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = build_model_from_hf(hf_dir, dtype=torch_dtype, device=device)
    ids = batch["input_ids"].long().to(device)
    psp = None
    if batch.get("cu_seqlens") is not None:
        psp = make_packed_seq_params(batch["cu_seqlens"].to(device=device, dtype=torch.int32))
    pv = batch.get("pixel_values")
    grid = batch.get("image_grid_thw")
    with torch.no_grad():
        logits = model(ids, packed_seq_params=psp,
                       pixel_values=None if pv is None else pv.to(device=device, dtype=torch_dtype),
                       image_grid_thw=None if grid is None else grid.to(device))
    return logits.float().cpu()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--input", required=True, help="torch.save'd dict with input_ids [b, s] (+ optional keys)")
    p.add_argument("--output", required=True, help="where to write {'logits': [b, s, vocab] float32}")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args(argv)

    import torch

    try:
        if not os.path.isdir(args.hf_dir):
            raise InputError(f"--hf-dir {args.hf_dir} is not a directory")
        if not os.path.exists(args.input):
            raise InputError(f"--input {args.input} does not exist")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise InputError("--device cuda requested but no CUDA device is available")
        try:
            batch = torch.load(args.input, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - report any unreadable file the same way
            raise InputError(f"cannot read --input {args.input}: {e}") from None
        t0 = time.time()
        logits = run(args.hf_dir, batch, args.dtype, args.device)
    except Exception as e:  # one clear line, nothing written
        from megatron_glm5.config import Glm5ConfigError
        from megatron_glm5.checkpoint.hf_io import CheckpointMismatchError

        if isinstance(e, (InputError, Glm5ConfigError, CheckpointMismatchError, FileNotFoundError)):
            print(f"hf_forward: error: {e}", file=sys.stderr)
            return 2
        raise
    tmp = args.output + ".tmp"
    torch.save({"logits": logits}, tmp)
    os.replace(tmp, args.output)
    print(f"hf_forward: wrote logits {tuple(logits.shape)} to {args.output} in {time.time() - t0:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
