"""Read HF GLM-5.3 safetensors checkpoints (single file or sharded with ``model.safetensors.index.json``) into a
megatron_glm5 model on one process, tensor by tensor (never the whole checkpoint in memory).

FP8 weights (``*.weight`` float8_e4m3fn + ``*.weight_scale_inv``) are dequantised on the fly. Missing, unexpected
or shape-mismatched keys fail with their full list.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

import torch
from safetensors import safe_open

from megatron_glm5.checkpoint.fp8 import FP8_DTYPE, dequantize_fp8_blockwise
from megatron_glm5.checkpoint.hf_keys import canonical_name, hf_to_mcore, is_non_persistent, mcore_to_hf


class CheckpointMismatchError(RuntimeError):
    """Missing / unexpected / shape-mismatched keys between a checkpoint and the model."""


class HFCheckpointReader:
    """Key -> file index of an HF checkpoint directory; ``get(key)`` reads one tensor (FP8 dequantised)."""

    def __init__(self, hf_dir: str):
        self.hf_dir = hf_dir
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        single = os.path.join(hf_dir, "model.safetensors")
        if os.path.exists(index):
            with open(index) as fh:
                self.key_to_file = dict(json.load(fh)["weight_map"])
        elif os.path.exists(single):
            with safe_open(single, "pt") as f:
                self.key_to_file = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"{hf_dir}: neither model.safetensors.index.json nor model.safetensors found")
        for fname in set(self.key_to_file.values()):
            if not os.path.exists(os.path.join(hf_dir, fname)):
                raise FileNotFoundError(f"{hf_dir}: shard {fname} named in the index is missing")
        cfg_path = os.path.join(hf_dir, "config.json")
        self.block_size = None
        if os.path.exists(cfg_path):
            with open(cfg_path) as fh:
                q = json.load(fh).get("quantization_config") or {}
            self.block_size = q.get("weight_block_size")
        self._handles: Dict[str, object] = {}

    def keys(self) -> List[str]:
        return list(self.key_to_file)

    def _handle(self, fname):
        if fname not in self._handles:
            self._handles[fname] = safe_open(os.path.join(self.hf_dir, fname), "pt")
        return self._handles[fname]

    def raw(self, key: str) -> torch.Tensor:
        return self._handle(self.key_to_file[key]).get_tensor(key)

    def shape(self, key: str):
        return tuple(self._handle(self.key_to_file[key]).get_slice(key).get_shape())

    def get(self, key: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The tensor as the model should see it: FP8 weights dequantised (to ``dtype`` or bf16)."""
        t = self.raw(key)
        if t.dtype == FP8_DTYPE:
            scale_key = key + "_scale_inv"
            if scale_key not in self.key_to_file:
                raise CheckpointMismatchError(f"{key} is FP8 but {scale_key} is missing")
            t = dequantize_fp8_blockwise(t, self.raw(scale_key), out_dtype=dtype or torch.bfloat16,
                                         block_size=self.block_size)
            if not torch.isfinite(t).all():
                raise CheckpointMismatchError(f"{key}: NaN/inf after FP8 dequantisation")
        return t

    def close(self):
        self._handles.clear()


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


def load_hf_checkpoint(model: torch.nn.Module, hf_dir: str, strict: bool = True, verbose: bool = False) -> Dict:
    """Copy an HF checkpoint into ``model`` (one PP stage / EP rank / TP rank of it). Returns a report dict.

    Every model parameter must find its HF key(s) with the right shape, and (strict) every HF key of the model's
    layers must be used; otherwise CheckpointMismatchError lists all offenders.
    """
    reader = HFCheckpointReader(hf_dir)
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
    m = re.match(r"mtp\.layers\.(\d+)\.transformer_layer\.", name)
    if m and getattr(model, "mtp_process", False):
        layer = model.mtp.layers[int(m.group(1))].transformer_layer
    m = re.search(r"mlp\.experts\.local_experts\.(\d+)\.", name)
    if m and layer is not None and int(m.group(1)) not in getattr(layer.mlp, "local_expert_indices", []):
        return False  # another EP rank's expert
    if name.startswith("embedding.") or name.startswith("vision_model."):
        return getattr(model, "pre_process", True)
    if name.startswith(("final_layernorm", "output_layer", "mtp.")):
        return getattr(model, "post_process", True)
    return True
