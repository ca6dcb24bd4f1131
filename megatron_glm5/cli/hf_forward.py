"""Run megatron_glm5's GLM-5.3 model on an HF checkpoint and write its logits.

    python tools/hf_forward.py --hf-dir DIR --input IN.pt --output OUT.pt [--dtype fp32|bf16] [--device cpu|cuda]

IN.pt: a dict saved with torch.save holding ``input_ids`` [b, s] int64 and optionally, under transformers' names and
in the layout its Glm5Next processor produces, ``pixel_values`` [image patches, C*T*P*P] with ``image_grid_thw``
[num_images, 3], ``pixel_values_videos`` [video patches, C*T*P*P] with ``video_grid_thw`` [num_videos, 3] (the
processor's frames: image tokens inside ``<begin_video> .. <end_video>``), ``mm_token_type_ids`` [b, s] (0 text,
1 image, 2 video; checked against the placeholders), ``attention_mask`` (all ones), and ``cu_seqlens`` (integer
document boundaries of one packed row, b = 1, strictly increasing from 0 to s). It is loaded with
``weights_only=True``. All inputs are checked against config.json before the model is loaded. A checkpoint without
MTP weights whose config declares MTP (transformers' save_pretrained) runs without MTP, with one notice. OUT.pt:
``{"logits": [b, s, vocab] float32}``, written atomically; it may not be an input or lie inside
the checkpoint. On bad input it prints one error line, exits 2 and writes nothing.
"""

from __future__ import annotations

import os
import sys
import time

from megatron_glm5.errors import CheckpointError
from megatron_glm5.cli.common import OneLineArgumentParser, quiet_library_warnings, run_cli, stderr_line

PROG = "hf_forward"
INPUT_KEYS = ("input_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "cu_seqlens",
              "attention_mask", "mm_token_type_ids")


class InputError(CheckpointError):
    """An --input that does not fit the model."""


def check_inputs(batch, cfg) -> None:
    """Raise InputError (one line naming the field) unless ``batch`` is a valid input for the model of ``cfg``."""
    import torch

    if not isinstance(batch, dict):
        raise InputError(f"input file must hold a dict, got {type(batch).__name__}")
    unknown = sorted(str(k) for k in batch if k not in INPUT_KEYS)
    if unknown:
        raise InputError(f"unknown input keys {unknown}")
    for k, v in batch.items():
        if v is not None and not isinstance(v, torch.Tensor):
            raise InputError(f"{k} must be a tensor, got {type(v).__name__}")
    ids = batch.get("input_ids")
    if ids is None or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise InputError("input_ids must be an int64 tensor of shape [b, s]")
    if ids.numel() == 0:
        raise InputError("input_ids is empty")
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise InputError(f"input_ids out of range [0, {cfg.vocab_size})")
    mask = batch.get("attention_mask")
    if mask is not None and (tuple(mask.shape) != tuple(ids.shape) or not bool(mask.bool().all())):
        raise InputError("padding attention_mask is not supported; pack documents with cu_seqlens instead")
    cu = batch.get("cu_seqlens")
    if cu is not None:
        if ids.shape[0] != 1:
            raise InputError(f"cu_seqlens needs one packed row (b = 1), got b = {ids.shape[0]}")
        if cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool:
            raise InputError(f"cu_seqlens must be an integer tensor, got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != ids.shape[1] or bool(
                (cu[1:] <= cu[:-1]).any()):
            raise InputError(f"cu_seqlens must increase strictly from 0 to s = {ids.shape[1]}, got "
                             f"{cu.tolist()[:16]}")
    from megatron_glm5.models.vision import image_token_mask, video_token_mask

    _check_visual(batch, cfg, "pixel_values", "image_grid_thw", "image", image_token_mask)
    _check_visual(batch, cfg, "pixel_values_videos", "video_grid_thw", "video", video_token_mask)
    types = batch.get("mm_token_type_ids")
    if types is not None:
        want = image_token_mask(ids, cfg).long() + 2 * video_token_mask(ids, cfg).long()
        if tuple(types.shape) != tuple(ids.shape) or not torch.equal(types.long(), want):
            raise InputError("mm_token_type_ids disagree with the image / video placeholders of input_ids (1: image "
                             "tokens outside <begin_video> .. <end_video>, 2: inside)")


def _check_visual(batch, cfg, pv_key: str, grid_key: str, what: str, token_mask) -> None:
    """Check one pixel / grid pair (``pixel_values`` / ``image_grid_thw`` or the video pair) and that
    ``input_ids`` hold one placeholder per merged patch (``token_mask``: where those placeholders are)."""
    import torch

    ids = batch["input_ids"]
    pv, grid = batch.get(pv_key), batch.get(grid_key)
    if (pv is None) != (grid is None):
        raise InputError(f"{pv_key} and {grid_key} must be given together")
    if pv is None:
        return
    vc = cfg.vision
    if vc is None:
        raise InputError(f"{pv_key} given but the checkpoint has no vision_config")
    if grid.dim() != 2 or grid.shape[1] != 3 or grid.is_floating_point() or grid.dtype == torch.bool:
        raise InputError(f"{grid_key} must be an integer tensor [num_{what}s, 3]")
    if grid.numel() == 0 or bool((grid <= 0).any()):
        raise InputError(f"{grid_key} entries must be positive")
    m = vc.spatial_merge_size
    if bool((grid[:, 1] % m).any()) or bool((grid[:, 2] % m).any()):
        raise InputError(f"{grid_key}: h and w must be multiples of vision_config.spatial_merge_size = {m}")
    n_patches = int(grid.prod(-1).sum())
    width = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    if not pv.is_floating_point() or pv.dim() != 2 or tuple(pv.shape) != (n_patches, width):
        raise InputError(f"{pv_key} must be a float tensor [sum(t*h*w) = {n_patches}, C*T*P*P = {width}] "
                         f"(vision_config), got {pv.dtype} {tuple(pv.shape)}")
    if not bool(torch.isfinite(pv).all()):
        raise InputError(f"{pv_key} contains NaN/inf")
    n_tok = int(token_mask(ids, cfg).sum())
    if n_tok != n_patches // (m * m):
        where = "inside" if what == "video" else "outside"
        raise InputError(f"input_ids hold {n_tok} {what} tokens (id {cfg.image_token_id} {where} <begin_video> .. "
                         f"<end_video>) but {grid_key} gives {n_patches // (m * m)} merged patches")


def run(hf_dir: str, batch: dict, dtype: str = "fp32", device: str = "cpu", log=stderr_line):
    """Build the model from ``hf_dir``, load it and return logits [b, s, vocab] float32 (inputs checked first)."""
    import torch

    from megatron_glm5.config import Glm5Config
    from megatron_glm5.models.builder import build_model_from_hf
    from megatron_glm5.models.packing import make_packed_seq_params

    check_inputs(batch, Glm5Config.from_hf(hf_dir))
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = build_model_from_hf(hf_dir, dtype=torch_dtype, device=device, log=log)
    ids = batch["input_ids"].long().to(device)
    psp = None
    if batch.get("cu_seqlens") is not None:
        psp = make_packed_seq_params(batch["cu_seqlens"].to(device=device, dtype=torch.int32))
    visual = {}
    for pv_key, grid_key in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        if batch.get(pv_key) is not None:
            visual[pv_key] = batch[pv_key].to(device=device, dtype=torch_dtype)
            visual[grid_key] = batch[grid_key].to(device)
    with torch.no_grad():
        logits = model(ids, packed_seq_params=psp, **visual)
    return logits.float().cpu()


def parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--input", required=True, help="torch.save'd dict with input_ids [b, s] (+ optional keys)")
    p.add_argument("--output", required=True, help="where to write {'logits': [b, s, vocab] float32}")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    quiet_library_warnings()

    def body():
        import torch

        from megatron_glm5.checkpoint.atomic import atomic_write_file, check_output_path
        from megatron_glm5.checkpoint.safe_load import torch_load_weights_only

        if not os.path.isdir(args.hf_dir):
            raise InputError(f"--hf-dir {args.hf_dir} is not a directory")
        if not os.path.isfile(args.input):
            raise InputError(f"--input {args.input} does not exist")
        check_output_path(args.output, [args.input, args.hf_dir], overwrite=True, flag="--output", is_dir=False)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise InputError("--device cuda requested but no CUDA device is available")
        batch = torch_load_weights_only(args.input, f"--input {args.input}")
        t0 = time.time()
        logits = run(args.hf_dir, batch, args.dtype, args.device)
        atomic_write_file(args.output, lambda tmp: torch.save({"logits": logits}, tmp),
                          inputs=[args.input, args.hf_dir], flag="--output")
        print(f"{PROG}: wrote logits {tuple(logits.shape)} to {args.output} in {time.time() - t0:.2f}s")

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
