"""Export a megatron_glm5 torch_dist checkpoint to an HF GLM-5.3 checkpoint (bf16 safetensors, sharded, with
index and config.json; optionally re-quantised to block FP8), streaming with bounded memory.

Used by ``tools/convert_mcore_to_hf.py`` (and by anything else that exports, e.g. after training).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
import time
import sys


PROG = "convert_mcore_to_hf"
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128]}
FP8_BLOCK = (128, 128)


class ExportError(Exception):
    """Bad input for the exporter (reported as one error line, exit 2)."""


# ------------------------------------------------------------------------------------------ safetensors writer
def _st_dtype(dtype) -> str:
    import torch

    names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
             torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
             torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
    return names[dtype]


def _nbytes(shape, dtype) -> int:
    import torch

    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


class SafetensorsStreamWriter:
    """Writes one .safetensors file tensor by tensor: the header (all names, dtypes, shapes, offsets) is known up
    front, so each tensor goes to disk as soon as it is converted and is never held together with the others."""

    def __init__(self, path: str, specs, metadata=None):
        self.path = path
        self.specs = list(specs)  # [(name, shape, dtype)] in write order
        header, offset = {}, 0
        for name, shape, dtype in self.specs:
            n = _nbytes(shape, dtype)
            header[name] = {"dtype": _st_dtype(dtype), "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        header["__metadata__"] = dict(metadata or {"format": "pt"})
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self.data_bytes = offset
        self._fh = open(path, "wb")
        self._fh.write(struct.pack("<Q", len(raw)))
        self._fh.write(raw)
        self._next = 0

    def write(self, name: str, tensor) -> int:
        import torch

        exp_name, shape, dtype = self.specs[self._next]
        if name != exp_name or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise RuntimeError(f"{self.path}: expected {exp_name} {tuple(shape)} {dtype}, got {name} "
                               f"{tuple(tensor.shape)} {tensor.dtype}")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        if flat.numel():
            self._fh.write(flat.view(torch.uint8).numpy().data)
        self._next += 1
        return flat.numel() * flat.element_size()

    def close(self):
        if self._next != len(self.specs):
            raise RuntimeError(f"{self.path}: {len(self.specs) - self._next} tensors were not written")
        self._fh.close()

    def abort(self):
        self._fh.close()


# ------------------------------------------------------------------------------------------ planning
def output_specs(t, fp8: bool, text_cfg: dict):
    """[(hf_key, shape, dtype)] that one megatron tensor becomes (FP8 weight followed by its scale grid)."""
    import torch

    from megatron_glm5.checkpoint.fp8 import FP8_DTYPE, is_fp8_in_release
    from megatron_glm5.checkpoint.mcore_reader import hf_dtype

    out = []
    for key, shape in zip(t.hf_keys, t.hf_shapes):
        if fp8 and is_fp8_in_release(key, text_cfg):
            if len(shape) != 2:
                raise ExportError(f"{key}: FP8 keys must be 2-D, got {shape}")
            grid = (math.ceil(shape[0] / FP8_BLOCK[0]), math.ceil(shape[1] / FP8_BLOCK[1]))
            out += [(key, shape, FP8_DTYPE), (key + "_scale_inv", grid, torch.float32)]
        else:
            out.append((key, shape, hf_dtype(key, torch.bfloat16)))
    return out


def plan_shards(reader, fp8: bool, shard_bytes: int, text_cfg: dict):
    """Greedy split of the model's tensors (model order; gate/up halves stay together) into output shards."""
    shards, cur, size = [], [], 0
    for t in reader.tensors:
        specs = output_specs(t, fp8, text_cfg)
        b = sum(_nbytes(s, d) for _, s, d in specs)
        if cur and size + b > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((t, specs))
        size += b
    if cur:
        shards.append(cur)
    return shards


def convert_tensor(t, full, fp8: bool, text_cfg: dict):
    """Yield (hf_key, tensor) for one loaded megatron tensor: split, cast, optionally FP8-quantised."""
    import torch

    from megatron_glm5.checkpoint.fp8 import is_fp8_in_release, quantize_fp8_blockwise
    from megatron_glm5.checkpoint.mcore_reader import hf_dtype

    for key, part in t.split(full):
        if fp8 and is_fp8_in_release(key, text_cfg):
            q, scale = quantize_fp8_blockwise(part.float(), FP8_BLOCK)
            yield key, q
            yield key + "_scale_inv", scale.float().contiguous()
        else:
            yield key, part.to(hf_dtype(key, torch.bfloat16))


def hf_output_config(hf_config: dict, fp8: bool) -> dict:
    cfg = json.loads(json.dumps(hf_config))
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "bfloat16"
    cfg.pop("quantization_config", None)
    if fp8:
        cfg["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    return cfg


# ------------------------------------------------------------------------------------------ export
def check_out_dir(out_dir: str, load_dir: str, overwrite: bool):
    if os.path.realpath(out_dir) == os.path.realpath(load_dir):
        raise ExportError(f"--out {out_dir} is the checkpoint directory itself")
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise ExportError(f"--out {out_dir} exists and is not a directory")
        if os.listdir(out_dir) and not overwrite:
            raise ExportError(f"--out {out_dir} exists and is not empty (pass --overwrite to replace it)")


def export_hf_checkpoint(load_dir: str, out_dir: str, hf_config=None, fp8: bool = False, shard_mb: float = 5000,
                         overwrite: bool = False, progress: bool = True, log=print, max_load_mb: float = 1024
                         ) -> dict:
    """Export ``load_dir`` (torch_dist) to the HF directory ``out_dir``; returns a summary dict.

    ``hf_config``: dict, path, or None for ``hf_config.json`` next to the checkpoint. Checkpoint tensors are
    read at most ``max_load_mb`` (or one shard, or one tensor if larger) at a time. Raises ExportError /
    McoreCheckpointError on bad input; ``out_dir`` is only created when everything was written."""
    import torch
    from tqdm import tqdm

    from megatron_glm5.checkpoint.mcore_reader import McoreCheckpointReader, batch_by_bytes

    if shard_mb <= 0:
        raise ExportError(f"--shard-mb must be positive, got {shard_mb}")
    check_out_dir(out_dir, load_dir, overwrite)
    t0 = time.time()
    reader = McoreCheckpointReader(load_dir, hf_config)
    text_cfg = {"num_hidden_layers": reader.config.num_layers, "layer_types": list(reader.config.layer_types)}
    shard_bytes = int(shard_mb * 2 ** 20)
    shards = plan_shards(reader, fp8, shard_bytes, text_cfg)
    load_bytes = min(shard_bytes, int(max_load_mb * 2 ** 20))
    total = sum(_nbytes(s, d) for shard in shards for _, specs in shard for _, s, d in specs)
    n = len(shards)

    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.tmp-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the published folder gets the usual permissions
    weight_map = {}
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
                        with torch.no_grad():
                            for key, tensor in convert_tensor(t, full, fp8, text_cfg):
                                bar.update(writer.write(key, tensor))
                                weight_map[key] = fname
                        del full
                    del loaded
                writer.close()
            except BaseException:
                writer.abort()
                raise
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, fh,
                      indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as fh:
            json.dump(hf_output_config(reader.hf_config, fp8), fh, indent=2, sort_keys=True)
        bar.close()
        _publish(tmp, out_dir)
    except BaseException:
        bar.leave = False  # erase the bar so the error line stands alone
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    dt = time.time() - t0
    summary = {"out": out_dir, "tensors": len(weight_map), "shards": n, "bytes": total, "seconds": dt,
               "fp8": fp8, "load": reader.load_dir}
    if log is not None:
        log(f"{PROG}: wrote {len(weight_map)} tensors in {n} shard(s), {total / 2 ** 20:.1f} MiB "
            f"({'FP8' if fp8 else 'BF16'}) to {out_dir} in {dt:.1f}s ({total / 2 ** 20 / max(dt, 1e-9):.1f} MiB/s)")
    return summary


def _publish(tmp: str, out_dir: str):
    """Move the finished temporary folder to ``out_dir`` (an existing one is replaced only when complete)."""
    trash = None
    if os.path.exists(out_dir) and os.listdir(out_dir):
        trash = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.old-",
                                 dir=os.path.dirname(os.path.abspath(out_dir)))
        os.replace(out_dir, os.path.join(trash, "old"))
    os.replace(tmp, out_dir)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


# ------------------------------------------------------------------------------------------ CLI
