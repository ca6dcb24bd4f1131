"""Read HF GLM-5.3 safetensors checkpoints (single file or sharded with ``model.safetensors.index.json``) into a
megatron_glm5 model on one process, tensor by tensor (never the whole checkpoint in memory).

:class:`HFCheckpointReader` validates the whole checkpoint before a tensor is read: the index (a JSON object whose
shard paths stay inside the checkpoint: no ``../``, absolute paths or symlinks out), every shard's header
(:mod:`safetensors_io`), each tensor in exactly one shard and where the index says, every ``weight_scale_inv``
beside an FP8 weight with the block grid of that weight, the checksum manifest when there is one. Reading a tensor
checks its values: FP8 scales positive and finite, weights finite after dequantisation, no integer dtype where a
float belongs. Every failure is a :class:`CheckpointMismatchError` (a :class:`CheckpointError`) of one line.
Missing, unexpected or shape-mismatched keys fail with their full list.
"""

from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional

import torch

from megatron_glm5.checkpoint.checksums import verify_manifest
from megatron_glm5.errors import CheckpointError
from megatron_glm5.checkpoint.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8_blockwise, fp8_nan_count
from megatron_glm5.checkpoint.hf_keys import canonical_name, hf_to_mcore, is_non_persistent, mcore_to_hf
from megatron_glm5.checkpoint.safe_load import check_inside, hub_blobs_dir
from megatron_glm5.checkpoint.safetensors_io import DTYPE_NAMES, SafetensorsFile

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class CheckpointMismatchError(CheckpointError):
    """A checkpoint that does not fit the model: missing / unexpected / mis-shaped keys, bad dtypes or values."""


def read_json(path: str, what: str = "") -> object:
    """A JSON file, refusing duplicate object keys; failures are one CheckpointMismatchError line."""
    def pairs(items):
        d = {}
        for k, v in items:
            if k in d:
                raise CheckpointMismatchError(f"{path}: key {k!r} appears twice")
            d[k] = v
        return d

    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh, object_pairs_hook=pairs)
    except CheckpointMismatchError:
        raise
    except OSError as e:
        raise CheckpointMismatchError(f"{path}: cannot read {what}({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:
        raise CheckpointMismatchError(f"{path}: not valid JSON ({' '.join(str(e).split())[:200]})") from None


def weight_block_size(cfg, where: str):
    """The FP8 block ``[rows, cols]`` an HF config dict declares (``quantization_config.weight_block_size``), or
    None; ``where`` names the config in the error."""
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointMismatchError(f"{where}: quantization_config must be an object")
    bs = q.get("weight_block_size")
    if bs is None:
        return None
    if not (isinstance(bs, list) and len(bs) == 2 and all(type(b) is int and b > 0 for b in bs)):
        raise CheckpointMismatchError(f"{where}: quantization_config.weight_block_size must be two positive "
                                      f"integers, got {bs!r}")
    return bs


def _block_size(cfg_path: str):
    if not os.path.exists(cfg_path):
        return None
    return weight_block_size(read_json(cfg_path), cfg_path)


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/inf in a float tensor: one ``aminmax`` reduction (NaN propagates into both results, an infinity is
    the minimum or the maximum), no temporary tensor; about 10 GB/s per thread on CPU for bf16, 8x a masked
    bit-pattern check (whose temporary costs page faults)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


class HFCheckpointReader:
    """Validated key -> file index of an HF checkpoint directory; ``get(key)`` reads one tensor (FP8 dequantised,
    values checked). Thread-safe for concurrent ``get`` calls."""

    def __init__(self, hf_dir: str, verify_checksums: bool = True):
        self.hf_dir = hf_dir
        index = os.path.join(hf_dir, INDEX_FILE)
        single = os.path.join(hf_dir, SINGLE_FILE)
        if not os.path.isdir(hf_dir):
            raise CheckpointMismatchError(f"{hf_dir}: no such directory")
        if verify_checksums:
            verify_manifest(hf_dir)
        if os.path.exists(index):
            idx = read_json(index, "the index ")
            wm = idx.get("weight_map") if isinstance(idx, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
                raise CheckpointMismatchError(f"{index}: weight_map must map tensor names to shard file names")
            self.key_to_file = dict(wm)
        elif os.path.exists(single):
            self.key_to_file = None
        else:
            raise CheckpointMismatchError(f"{hf_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
        self._files: Dict[str, SafetensorsFile] = {}
        self._headers: Dict[str, tuple] = {}  # validated headers, reused when a closed file is mapped again
        fnames = [SINGLE_FILE] if self.key_to_file is None else sorted(set(self.key_to_file.values()))
        owner: Dict[str, str] = {}
        blobs = hub_blobs_dir(hf_dir)  # a hub cache snapshot's files are links into its repository's blobs/
        for fname in fnames:
            path = check_inside(hf_dir, fname, index if self.key_to_file is not None else single, blobs)
            if not os.path.isfile(path):
                raise CheckpointMismatchError(f"{hf_dir}: shard {fname} named in the index is missing")
            f = self._files[fname] = SafetensorsFile(path)
            self._headers[fname] = f.header()
            for k in f.keys():
                if k in owner:
                    raise CheckpointMismatchError(f"{hf_dir}: duplicate tensor name {k!r} in {owner[k]} and {fname}")
                owner[k] = fname
        if self.key_to_file is None:
            self.key_to_file = owner
        else:
            for k, fname in self.key_to_file.items():
                if owner.get(k) != fname:
                    where = f"is in {owner[k]}" if k in owner else "is in no shard"
                    raise CheckpointMismatchError(f"{index}: maps {k!r} to {fname}, but it {where}")
            extra = sorted(set(owner) - set(self.key_to_file))
            if extra:
                raise CheckpointMismatchError(f"{hf_dir}: tensor {extra[0]!r} in {owner[extra[0]]} is not in the index"
                                              f"{f' (+{len(extra) - 1} more)' if len(extra) > 1 else ''}")
        self.block_size = _block_size(os.path.join(hf_dir, "config.json"))
        self._check_fp8_pairs()

    # ---------------------------------------------------------------------------------------- header checks
    def _check_fp8_pairs(self):
        for k in self.key_to_file:
            dt = self.dtype(k)
            if k.endswith(SCALE_SUFFIX):
                w = k[: -len(SCALE_SUFFIX)]
                if w not in self.key_to_file:
                    raise CheckpointMismatchError(f"{k}: scale without its weight {w}")
                if self.dtype(w) != FP8_DTYPE:
                    raise CheckpointMismatchError(f"{k}: a weight_scale_inv beside {w}, which is "
                                                  f"{DTYPE_NAMES[self.dtype(w)]}, not FP8")
                if dt not in (torch.float32, torch.bfloat16):
                    raise CheckpointMismatchError(f"{k}: scales must be F32 or BF16, got {DTYPE_NAMES[dt]}")
                self._check_grid(w, k)
            elif dt == FP8_DTYPE:
                if k + SCALE_SUFFIX not in self.key_to_file:
                    raise CheckpointMismatchError(f"{k} is FP8 but {k + SCALE_SUFFIX} is missing")
            elif dt == torch.float8_e5m2:
                raise CheckpointMismatchError(f"{k}: F8_E5M2 weights are not supported (the release uses F8_E4M3)")

    def _check_grid(self, w: str, s: str):
        shape, grid = self.shape(w), self.shape(s)
        if len(shape) != 2 or len(grid) != 2:
            raise CheckpointMismatchError(f"{s}: FP8 weight {shape} and scale grid {grid} must both be 2-D")
        if self.block_size is not None:
            bo, bi = self.block_size
            want = (math.ceil(shape[0] / bo), math.ceil(shape[1] / bi))
            if grid != want:
                raise CheckpointMismatchError(f"{s}: scale grid {grid} does not match weight {shape} with block size "
                                              f"{bo}x{bi} (expected {want})")
        elif not (1 <= grid[0] <= max(shape[0], 1) and 1 <= grid[1] <= max(shape[1], 1)):
            raise CheckpointMismatchError(f"{s}: scale grid {grid} does not fit weight {shape}")

    # ---------------------------------------------------------------------------------------- queries
    def keys(self) -> List[str]:
        return list(self.key_to_file)

    def _file(self, key: str) -> SafetensorsFile:
        fname = self.key_to_file[key]
        files = self._files  # (close() swaps the dict; never mutate a dict another thread may be reading)
        f = files.get(fname)
        if f is None:  # reopened after close()
            f = files[fname] = SafetensorsFile(os.path.join(self.hf_dir, fname), header=self._headers.get(fname))
        return f

    def shape(self, key: str):
        return self._file(key).info(key).shape

    def dtype(self, key: str) -> torch.dtype:
        return self._file(key).info(key).dtype

    def raw(self, key: str) -> torch.Tensor:
        """The stored tensor (a view of the file's private mapping)."""
        return self._file(key).get(key)

    def get(self, key: str, dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The tensor as the model should see it: FP8 weights dequantised (to ``dtype`` or bf16) with checked
        scales; values checked finite; integer dtypes refused. ``out``: where an FP8 weight is dequantised to (a
        contiguous tensor of its shape and the output dtype; unused for other tensors, which are returned as views
        of the file)."""
        t = self.raw(key)
        if t.dtype == FP8_DTYPE:
            scale = self.raw(key + SCALE_SUFFIX)
            out_dtype = dtype or torch.bfloat16
            lo, hi = (float(v) for v in torch.aminmax(scale)) if scale.numel() else (1.0, 1.0)  # NaN propagates
            if not (lo > 0 and hi < math.inf):
                raise CheckpointMismatchError(f"{key + SCALE_SUFFIX}: FP8 scales must be positive and finite "
                                              f"(found {_worst(scale)})")
            nan = fp8_nan_count(t)
            if nan:
                raise CheckpointMismatchError(f"{key}: NaN/inf after FP8 dequantisation ({nan} NaN codes)")
            if hi * FP8_MAX >= torch.finfo(out_dtype).max:
                raise CheckpointMismatchError(f"{key}: NaN/inf after FP8 dequantisation (scale {hi} overflows "
                                              f"{out_dtype})")
            # e4m3 codes are finite and at most FP8_MAX: with these scales every product is finite
            return dequantize_fp8_blockwise(t, scale, out_dtype=out_dtype, block_size=self.block_size, out=out,
                                            checked=hi < 2.0 ** 7 and t.numel() > 0)
        if t.dtype not in FLOAT_DTYPES:
            raise CheckpointMismatchError(f"{key}: stored as {DTYPE_NAMES[t.dtype]}; a floating-point tensor is "
                                          "expected")
        if not all_finite(t):
            raise CheckpointMismatchError(f"{key}: contains NaN/inf ({DTYPE_NAMES[t.dtype]})")
        return t

    def close(self):
        """Drop the file mappings (their pages stop counting as this process's memory); reopened on demand.
        Safe while other threads read: a mapping lives on while a thread or a returned tensor still uses it."""
        self._files = {}

    def has_mtp_weights(self, num_layers: int) -> bool:
        """Whether any key belongs to a layer past the decoder (``layers.{num_layers}.*``: the MTP layer)."""
        prefix = f"model.language_model.layers.{num_layers}."
        return any(k.startswith(prefix) for k in self.key_to_file)


def mtp_notice(hf_dir: str, cfg, reader: HFCheckpointReader, fresh: bool = False) -> Optional[str]:
    """The one notice line for a checkpoint whose config declares MTP but which holds no MTP weights (what
    transformers' ``save_pretrained`` writes): the model goes without MTP, or (``fresh``) with a new MTP layer."""
    if cfg.mtp_num_layers and not reader.has_mtp_weights(cfg.num_layers):
        what = ("writing a freshly initialised MTP layer (--mtp-init)" if fresh else "using the model without MTP")
        return (f"notice: {hf_dir} holds no MTP weights although config.json sets num_nextn_predict_layers = "
                f"{cfg.mtp_num_layers} (as transformers' save_pretrained writes); {what}")
    return None


def _worst(t: torch.Tensor) -> str:
    f = t.float()  # (a small scale grid)
    nonfinite, nonpos = int((~torch.isfinite(f)).sum()), int((f <= 0).sum())
    return ", ".join(p for p in (f"{nonfinite} NaN/inf" if nonfinite else "", f"{nonpos} <= 0" if nonpos else "") if p)


def _tp_slice(full: torch.Tensor, param: torch.nn.Parameter, parts: int) -> torch.Tensor:
    """Slice a full tensor to this TP rank by the param's megatron attributes (fused parts sliced one by one)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return full
    rank = parallel_state.get_tensor_model_parallel_rank()
    dim = param.partition_dim
    if parts > 1 and dim == 0:
        return torch.cat([p.chunk(tp, dim=0)[rank] for p in full.chunk(parts, dim=0)], dim=0)
    return full.chunk(tp, dim=dim)[rank]


def load_hf_checkpoint(model: torch.nn.Module, hf_dir: str, strict: bool = True, verbose: bool = False,
                       reader: Optional[HFCheckpointReader] = None) -> Dict:
    """Copy an HF checkpoint into ``model`` (one PP stage / EP rank / TP rank of it). Returns a report dict.

    Every model parameter must find its HF key(s) with the right shape, and (strict) every HF key of the model's
    layers must be used; otherwise CheckpointMismatchError lists all offenders.
    """
    reader = reader or HFCheckpointReader(hf_dir)
    cfg = model.config
    num_layers = cfg.num_layers
    mtp_layers = cfg.mtp_num_layers or 0
    hf_keys = set(reader.keys())
    used, missing, mismatched = set(), [], []
    state = dict(model.state_dict(keep_vars=True))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for local, tensor in state.items():
            if is_non_persistent(local):
                continue
            name = canonical_name(local, model)
            hf_names = mcore_to_hf(name, num_layers)
            absent = [k for k in hf_names if k not in hf_keys]
            if absent:
                missing.extend(absent)
                continue
            parts = [reader.get(k, dtype=tensor.dtype) for k in hf_names]
            full = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            param = params.get(local, tensor)
            full = _tp_slice(full, param, len(parts))
            if tuple(full.shape) != tuple(tensor.shape):
                mismatched.append(f"{'+'.join(hf_names)}: checkpoint {tuple(full.shape)} vs model {local} "
                                  f"{tuple(tensor.shape)}")
                continue
            tensor.data.copy_(full.to(tensor.dtype))
            used.update(hf_names)
            if verbose:
                print(f"loaded {local} <- {', '.join(hf_names)}")
    unexpected, skipped = split_unused_keys(hf_keys, used, model, num_layers, mtp_layers, strict)
    reader.close()
    raise_if_mismatched(hf_dir, missing, unexpected, mismatched)
    return {"loaded": len(used), "skipped": skipped}


def validate_hf_checkpoint(hf_dir: str, reader: HFCheckpointReader, model: torch.nn.Module, sources) -> Dict:
    """Check every HF key the model needs (present, right shape, a float or FP8 dtype) and that the checkpoint holds
    no key the model would not use, without reading a tensor. ``sources``: name -> object with ``hf_keys``,
    ``shape`` (full, fused parts stacked on dim 0) and ``local``. Raises CheckpointMismatchError listing all
    offenders (the same report as :func:`load_hf_checkpoint`); returns ``{"skipped": [...]}``."""
    cfg = model.config
    hf_keys = set(reader.keys())
    used, missing, mismatched = set(), [], []
    for s in sources.values():
        absent = [k for k in s.hf_keys if k not in hf_keys]
        if absent:
            missing.extend(absent)
            continue
        n = len(s.hf_keys)
        part = s.shape if n == 1 else (s.shape[0] // n, *s.shape[1:])
        for k in s.hf_keys:
            got, dt = reader.shape(k), reader.dtype(k)
            if tuple(got) != tuple(part):
                what = f"part {s.hf_keys.index(k) + 1}/{n} of " if n > 1 else ""
                mismatched.append(f"{k}: checkpoint {tuple(got)} vs model {what}{s.local} {tuple(part)}")
            elif dt not in FLOAT_DTYPES and dt != FP8_DTYPE:
                raise CheckpointMismatchError(f"{k}: stored as {DTYPE_NAMES[dt]}; a floating-point tensor is "
                                              "expected")
        used.update(s.hf_keys)
    unexpected, skipped = split_unused_keys(hf_keys, used, model, cfg.num_layers, cfg.mtp_num_layers or 0)
    raise_if_mismatched(hf_dir, missing, unexpected, mismatched,
                        shape_hint=" - does config.json describe these weights?")
    return {"skipped": skipped}


def split_unused_keys(hf_keys, used, model, num_layers: int, mtp_layers: int, strict: bool = True):
    """HF keys no model tensor consumed -> (unexpected: they belong to this model shard, skipped: they do not —
    other PP stages / EP ranks, MTP weights without an MTP layer, FP8 scales of used weights)."""
    unexpected, skipped = [], []
    for k in sorted(set(hf_keys) - set(used)):
        if k.endswith("weight_scale_inv") and k[: -len("_scale_inv")] in used:
            continue
        target = hf_to_mcore_safe(k, num_layers, mtp_layers)
        if target is not None and strict and _belongs_to_model(target, model):
            unexpected.append(k)
        else:
            skipped.append(k)
    return unexpected, skipped


def raise_if_mismatched(hf_dir: str, missing, unexpected, mismatched, shape_hint: str = "") -> None:
    """One CheckpointMismatchError listing every missing, unexpected and shape-mismatched key."""
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {sorted(missing)}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {unexpected}")
    if mismatched:
        problems.append(f"shape mismatches ({len(mismatched)}){shape_hint}: {mismatched}")
    if problems:
        raise CheckpointMismatchError(f"{hf_dir}: " + "; ".join(problems))


def hf_to_mcore_safe(k, num_layers, mtp_layers):
    try:
        return hf_to_mcore(k, num_layers, mtp_layers)
    except KeyError:
        return ("<unknown>", 0, 1)


def _belongs_to_model(target, model) -> bool:
    """Whether an unused HF key would have belonged to this model shard (PP stage, EP rank), so it is really
    unexpected."""
    name = target[0]
    if name == "<unknown>":
        return True
    import re

    layer = None
    m = re.match(r"decoder\.layers\.(\d+)\.", name)
    if m:
        rng = model.decoder.layer_range
        if int(m.group(1)) not in rng:
            return False
        layer = model.decoder.layers[int(m.group(1)) - rng.start]
    m = re.match(r"mtp\.layers\.(\d+)\.mtp_model_layer\.", name)
    if m and getattr(model, "mtp_process", False):
        layer = model.mtp.layers[int(m.group(1))].mtp_model_layer
    m = re.search(r"mlp\.experts\.local_experts\.(\d+)\.", name)
    if m and layer is not None and int(m.group(1)) not in getattr(layer.mlp, "local_expert_indices", []):
        return False  # another EP rank's expert
    if name.startswith("embedding.") or name.startswith("vision_model."):
        return getattr(model, "pre_process", True)
    if name.startswith(("final_layernorm", "output_layer", "mtp.")):
        return getattr(model, "post_process", True)
    return True
