"""Export a megatron_glm5 torch_dist checkpoint to an HF GLM-5.3 checkpoint (bf16 safetensors, sharded, with
index and config.json; optionally re-quantised to block FP8), streaming with bounded memory, together with the
tokenizer, chat template and processor files (:mod:`hf_assets`) that make it usable with transformers' processors:
taken from an HF folder (``hf_assets``) or else from the checkpoint folder (the converter puts them into
``release``; a training save's ``iter_NNNNNNN`` holds none).

Used by ``tools/convert_mcore_to_hf.py`` (and by anything else that exports, e.g. after training).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Optional

from megatron_glm5.checkpoint.atomic import atomic_output_dir
from megatron_glm5.checkpoint.checksums import write_manifest
from megatron_glm5.errors import CheckpointError
from megatron_glm5.checkpoint.hf_assets import ASSET_FILES, read_hf_assets, write_hf_assets
from megatron_glm5.checkpoint.safetensors_io import SafetensorsStreamWriter, nbytes


PROG = "convert_mcore_to_hf"
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128]}
FP8_BLOCK = (128, 128)
"""The FP8 block of an export whose model config declares none (the released checkpoint's)."""


class ExportError(CheckpointError):
    """Bad input for the exporter (reported as one error line, exit 2)."""


# ------------------------------------------------------------------------------------------ planning
def fp8_block(hf_config: dict, where: str = "hf_config.json"):
    """The FP8 block the export quantises with: the model config's ``quantization_config.weight_block_size`` (what
    the import dequantised with, kept in the config by ``Glm5Config.to_hf_dict``), else :data:`FP8_BLOCK`."""
    from megatron_glm5.checkpoint.hf_io import weight_block_size

    bs = weight_block_size(hf_config, where)
    return tuple(bs) if bs is not None else FP8_BLOCK


def output_specs(t, fp8: bool, text_cfg: dict, block=FP8_BLOCK):
    """[(hf_key, shape, dtype)] that one megatron tensor becomes (FP8 weight followed by its scale grid)."""
    import torch

    from megatron_glm5.checkpoint.fp8 import FP8_DTYPE, is_fp8_in_release
    from megatron_glm5.checkpoint.mcore_reader import hf_dtype

    out = []
    for key, shape in zip(t.hf_keys, t.hf_shapes):
        if fp8 and is_fp8_in_release(key, text_cfg):
            if len(shape) != 2:
                raise ExportError(f"{key}: FP8 keys must be 2-D, got {shape}")
            grid = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
            out += [(key, shape, FP8_DTYPE), (key + "_scale_inv", grid, torch.float32)]
        else:
            out.append((key, shape, hf_dtype(key, torch.bfloat16)))
    return out


def plan_shards(reader, fp8: bool, shard_bytes: int, text_cfg: dict, block=FP8_BLOCK):
    """Greedy split of the model's tensors (model order; gate/up halves stay together) into output shards."""
    shards, cur, size = [], [], 0
    for t in reader.tensors:
        specs = output_specs(t, fp8, text_cfg, block)
        b = sum(nbytes(s, d) for _, s, d in specs)
        if cur and size + b > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((t, specs))
        size += b
    if cur:
        shards.append(cur)
    return shards


def convert_tensor(t, full, fp8: bool, text_cfg: dict, block=FP8_BLOCK):
    """Yield (hf_key, tensor) for one loaded megatron tensor: split, cast, optionally FP8-quantised."""
    import torch

    from megatron_glm5.checkpoint.fp8 import is_fp8_in_release, quantize_fp8_blockwise
    from megatron_glm5.checkpoint.mcore_reader import hf_dtype

    for key, part in t.split(full):
        if fp8 and is_fp8_in_release(key, text_cfg):
            q, scale = quantize_fp8_blockwise(part.float(), block)
            yield key, q
            yield key + "_scale_inv", scale.float().contiguous()
        else:
            yield key, part.to(hf_dtype(key, torch.bfloat16))


def hf_output_config(hf_config: dict, fp8: bool, block=FP8_BLOCK) -> dict:
    """The exported config.json: ``hf_config`` in bf16, with the FP8 ``quantization_config`` of ``block`` when
    ``fp8``."""
    cfg = json.loads(json.dumps(hf_config))
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "bfloat16"
    cfg.pop("quantization_config", None)
    if fp8:
        cfg["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG, weight_block_size=list(block))
    return cfg


# ------------------------------------------------------------------------------------------ export
def export_hf_checkpoint(load_dir: str, out_dir: str, hf_config=None, fp8: bool = False, shard_mb: float = 5000,
                         overwrite: bool = False, progress: bool = True, log=print, max_load_mb: float = 1024,
                         inputs=(), hf_assets: Optional[str] = None) -> dict:
    """Export ``load_dir`` (a torch_dist checkpoint folder, or a save root whose tracker names one) to the HF
    directory ``out_dir``; returns a summary dict.

    ``hf_config``: dict, path, or None for ``hf_config.json`` in the checkpoint folder. ``hf_assets``: an HF folder
    to take the tokenizer / chat template / processor files from; None takes those in the checkpoint folder (a
    notice through ``log`` when there are none). Checkpoint tensors are read at most ``max_load_mb`` (or one shard,
    or one tensor if larger) at a time. ``inputs``: further paths the output may not touch (e.g. the directory
    given on the command line when it resolved to an iteration). Raises a CheckpointError on bad input; ``out_dir``
    is published (atomically, under a lock) only when complete, with a ``checksums.sha256`` manifest."""
    import torch
    from tqdm import tqdm

    from megatron_glm5.checkpoint.hf_io import all_finite
    from megatron_glm5.checkpoint.mcore_reader import McoreCheckpointReader, batch_by_bytes

    if not shard_mb > 0:
        raise ExportError(f"--shard-mb must be positive, got {shard_mb}")
    t0 = time.time()
    if hf_assets is not None and not os.path.isdir(hf_assets):
        raise ExportError(f"--hf-assets {hf_assets}: no such directory")
    all_inputs = [load_dir, *inputs] + ([hf_config] if isinstance(hf_config, str) else []) + [hf_assets]
    with atomic_output_dir(out_dir, inputs=all_inputs, overwrite=overwrite, log=log) as tmp:
        reader = McoreCheckpointReader(load_dir, hf_config)  # the checkpoint's checksums verified (assets included)
        assets = read_hf_assets(hf_assets or reader.load_dir)
        if not assets and hf_assets is not None:
            raise ExportError(f"--hf-assets {hf_assets}: holds none of {', '.join(ASSET_FILES)}")
        text_cfg = {"num_hidden_layers": reader.config.num_layers, "layer_types": list(reader.config.layer_types)}
        shard_bytes = int(shard_mb * 2 ** 20)
        block = fp8_block(reader.hf_config, os.path.join(reader.load_dir, "hf_config.json"))
        shards = plan_shards(reader, fp8, shard_bytes, text_cfg, block)
        load_bytes = min(shard_bytes, int(max_load_mb * 2 ** 20))
        total = sum(nbytes(s, d) for shard in shards for _, specs in shard for _, s, d in specs)
        n = len(shards)
        weight_map, digests = {}, {}
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=PROG, file=sys.stderr,
                   disable=not progress, dynamic_ncols=True, delay=1.0)
        try:
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                writer = SafetensorsStreamWriter(os.path.join(tmp, fname),
                                                 [spec for _, specs in shard for spec in specs])
                try:
                    # read the shard's tensors in bounded batches; each is converted and written, then dropped
                    for batch in batch_by_bytes([t for t, _ in shard], load_bytes):
                        loaded = reader.load([t.name for t in batch])
                        for t in batch:
                            full = loaded.pop(t.name)
                            if full.is_floating_point() and not all_finite(full):
                                raise ExportError(f"{reader.load_dir}: {t.name} contains NaN/inf")
                            with torch.no_grad():
                                for key, tensor in convert_tensor(t, full, fp8, text_cfg, block):
                                    bar.update(writer.write(key, tensor))
                                    weight_map[key] = fname
                            del full
                        del loaded
                    writer.close()
                    digests[fname] = writer.sha256
                except BaseException:
                    writer.abort()
                    raise
            bar.close()
        except BaseException:
            bar.leave = False  # erase the bar so the error line stands alone
            bar.close()
            raise
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, fh,
                      indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as fh:
            json.dump(hf_output_config(reader.hf_config, fp8, block), fh, indent=2, sort_keys=True)
        asset_names = write_hf_assets(assets, tmp)
        write_manifest(tmp, known=digests)
    dt = time.time() - t0
    if not asset_names and log is not None:  # after the export: a failing run prints its error line only
        log(f"notice: {reader.load_dir} holds no tokenizer or processor files; the export has weights and "
            "config.json only (pass --hf-assets HF_DIR to copy them from an HF checkpoint)")
    summary = {"out": out_dir, "tensors": len(weight_map), "shards": n, "bytes": total, "seconds": dt,
               "fp8": fp8, "load": reader.load_dir, "hf_assets": asset_names}
    if log is not None:
        log(f"{PROG}: wrote {len(weight_map)} tensors in {n} shard(s), {total / 2 ** 20:.1f} MiB "
            f"({'FP8' if fp8 else 'BF16'}) to {out_dir} in {dt:.1f}s ({total / 2 ** 20 / max(dt, 1e-9):.1f} MiB/s)")
    return summary
