"""Where each tensor of a converted checkpoint comes from, produced only when the writer asks for it.

The TP=PP=EP=1 meta model names every tensor (:func:`model_sources`: its HF key(s) through the key table, full
shape, output dtype). :func:`prepare_sharded_state_dict` swaps the data of every megatron ShardedTensor of the
model's ``sharded_state_dict()`` for a meta tensor of the output dtype and registers it with :class:`LazyTensors`,
which produces the real shard when the writer reaches it::

    HF key(s) -> HFCheckpointReader.get (mmap view; FP8 dequantised; scales and values checked)
      -> [gate; up] fused on dim 0 -> cast -> ShardedTensorFactory.build_fn where there is one -> the shard

``produce`` is thread-safe: several writer threads produce (read, dequantise, check, cast) and write concurrently;
the full tensor of a fused pair is kept only until both halves are produced. A dequantised tensor that is not
shared between threads is written into an output buffer of the calling thread, reused by that thread's next
``produce`` call for a tensor of the same shape (fresh allocations of multi-MB tensors cost page faults, as much
CPU time as the dequantisation): a writer must be done with a produced tensor before it asks for the next one. A
source may instead carry ``fresh`` data (``--mtp-init``: a newly initialised MTP layer).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from megatron_glm5.checkpoint.fp8 import FP8_DTYPE
from megatron_glm5.checkpoint.hf_io import CheckpointMismatchError, HFCheckpointReader
from megatron_glm5.checkpoint.hf_keys import canonical_name, is_non_persistent, mcore_to_hf
from megatron_glm5.checkpoint.safetensors_io import nbytes

# drop the reader's file mappings (their pages count as resident memory) after this many bytes were produced
_REMAP_BYTES = 256 * 2 ** 20
# output buffers kept per writer thread (bytes in all, and the largest tensor that gets one)
_SCRATCH_BYTES = 64 * 2 ** 20
_SCRATCH_MAX_TENSOR = 32 * 2 ** 20


@dataclass
class TensorSource:
    """One model tensor and where its data comes from."""

    local: str                # state-dict name in the TP1 meta model (== canonical name)
    hf_keys: List[str]        # one key, or [gate, up] fused on dim 0
    shape: Tuple[int, ...]    # full (TP1) shape
    dtype: torch.dtype        # dtype written to the checkpoint
    fresh: Optional[torch.Tensor] = None  # freshly initialised data instead of the HF keys (--mtp-init)

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


def model_sources(model: torch.nn.Module, dtype: torch.dtype) -> Dict[str, TensorSource]:
    """Every persistent tensor of the (TP1, meta) model -> its HF source key(s), full shape and output dtype."""
    params = dict(model.named_parameters())
    num_layers = model.config.num_layers
    out = {}
    for local, t in model.state_dict(keep_vars=True).items():
        if t is None or not torch.is_tensor(t) or is_non_persistent(local):
            continue
        if local in params:
            target = torch.float32 if getattr(params[local], "keep_fp32", False) else dtype
        else:  # buffers (router expert_bias) keep their own dtype, as Glm5Model.to_dtype does
            target = t.dtype
        hf = mcore_to_hf(canonical_name(local, model), num_layers)
        out[local] = TensorSource(local, hf, tuple(t.shape), target)
    return out


class _Scratch(threading.local):
    """One writer thread's exact-size output buffers by (shape, dtype), least recently used dropped first. Exact
    size: the writer saves a tensor's whole storage."""

    def __init__(self):
        self.bufs: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
        self.bytes = 0

    def take(self, shape, dtype: torch.dtype) -> Optional[torch.Tensor]:
        n = nbytes(shape, dtype)
        if n > _SCRATCH_MAX_TENSOR or n == 0:
            return None
        key = (tuple(shape), dtype)
        t = self.bufs.pop(key, None)
        if t is None:
            t = torch.empty(tuple(shape), dtype=dtype)
            self.bytes += n
            while self.bytes > _SCRATCH_BYTES and self.bufs:
                self.bytes -= self.bufs.popitem(last=False)[1].nbytes
        self.bufs[key] = t
        return t


class LazyTensors:
    """(sharded key, global offset) -> the shard's data, produced on demand (thread-safe) from the HF checkpoint."""

    def __init__(self, reader: HFCheckpointReader):
        self.reader = reader
        self.entries: Dict[Tuple[str, Tuple[int, ...]], Tuple[TensorSource, object, int]] = {}
        self._remaining: Dict[str, int] = {}
        self._cache: Dict[str, torch.Tensor] = {}
        self._locks: Dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._direct: Dict[str, bool] = {}  # fused sources whose factory shards are exactly their HF parts
        self._bytes_since_remap = 0
        self._scratch = _Scratch()
        self.hf_reads = 0

    def register(self, sh_ten, source: TensorSource, factory=None, index: int = 0) -> None:
        key = (sh_ten.key, tuple(sh_ten.global_offset))
        if key in self.entries:
            raise RuntimeError(f"duplicate shard {key}")
        self.entries[key] = (source, factory, index)
        self._remaining[source.local] = self._remaining.get(source.local, 0) + 1
        self._locks.setdefault(source.local, threading.Lock())
        if factory is not None and source.local not in self._direct:
            self._direct[source.local] = _parts_are_shards(source, factory)

    def _get(self, key: str, dtype: torch.dtype, own_buffer: bool) -> torch.Tensor:
        """HF tensor ``key`` as ``dtype``; an FP8 weight dequantised into this thread's buffer when ``own_buffer``
        (the caller hands the result to its own writer only)."""
        out = None
        if own_buffer and self.reader.dtype(key) == FP8_DTYPE:
            out = self._scratch.take(self.reader.shape(key), dtype)
        return self.reader.get(key, dtype=dtype, out=out).to(dtype)

    def _read(self, s: TensorSource, own_buffer: bool = False) -> torch.Tensor:
        if s.fresh is not None:
            full = s.fresh
        else:
            parts = [self._get(k, s.dtype, own_buffer and len(s.hf_keys) == 1) for k in s.hf_keys]
            full = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            del parts
        full = full.to(s.dtype)
        if tuple(full.shape) != s.shape:
            raise CheckpointMismatchError(f"{'+'.join(s.hf_keys)}: read {tuple(full.shape)}, model {s.local} "
                                          f"expects {s.shape}")
        with self._lock:
            self.hf_reads += 0 if s.fresh is not None else len(s.hf_keys)
            self._bytes_since_remap += full.nbytes
            if self._bytes_since_remap > _REMAP_BYTES:
                self.reader.close()  # views already handed out keep their own mapping alive
                self._bytes_since_remap = 0
        return full

    def _full(self, s: TensorSource) -> torch.Tensor:
        with self._locks[s.local]:  # the first half of a fused pair reads; the second finds it cached
            full = self._cache.get(s.local)
            if full is None:
                shared = self._remaining[s.local] > 1
                full = self._read(s, own_buffer=not shared)
                if shared:
                    self._cache[s.local] = full
            return full

    def _part(self, s: TensorSource, index: int) -> torch.Tensor:
        """HF part ``index`` of a fused source on its own (no [gate; up] concatenation, no copy of a half)."""
        t = self._get(s.hf_keys[index], s.dtype, own_buffer=True)
        with self._lock:
            self.hf_reads += 1
            self._bytes_since_remap += t.nbytes
            if self._bytes_since_remap > _REMAP_BYTES:
                self.reader.close()
                self._bytes_since_remap = 0
        return t

    def produce(self, fqn: str, offset: Tuple[int, ...]) -> torch.Tensor:
        source, factory, index = self.entries[(fqn, offset)]
        if factory is not None and source.fresh is None and self._direct.get(source.local):
            return self._part(source, index)
        full = self._full(source)
        if factory is None:
            data = full
        else:
            built = _as_list(factory.build_fn(factory.key, full, factory.replica_id, factory.flattened_range))
            sub = built[index]
            if (sub.key, tuple(sub.global_offset)) != (fqn, offset):
                raise RuntimeError(f"factory of {source.local} rebuilt shard {sub.key}@{sub.global_offset}, "
                                   f"expected {fqn}@{offset}")
            data = sub.data
        with self._locks[source.local]:
            self._remaining[source.local] -= 1
            if self._remaining[source.local] == 0:
                self._cache.pop(source.local, None)
        return data


def _parts_are_shards(source: TensorSource, factory) -> bool:
    """Whether the factory's shard ``i`` is exactly HF part ``i`` of the fused tensor (megatron's SwiGLU factory
    splits [gate; up] into its two halves), checked on a meta tensor: then each shard is read on its own."""
    n = len(source.hf_keys)
    if n < 2 or source.shape[0] % n:
        return False
    full = torch.empty(source.shape, dtype=source.dtype, device="meta")
    built = _as_list(factory.build_fn(factory.key, full, factory.replica_id, factory.flattened_range))
    part = (source.shape[0] // n, *source.shape[1:])
    step = full.numel() // n
    return len(built) == n and all(
        tuple(b.data.shape) == part and b.data.is_contiguous() and b.data.storage_offset() == i * step
        for i, b in enumerate(built))


def _as_list(built) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return list(nested_values(built)) if isinstance(built, (dict, list)) else [built]


def prepare_sharded_state_dict(model: torch.nn.Module, sources: Dict[str, TensorSource], reader,
                               rank: int = 0, world: int = 1):
    """The model's sharded state dict with factories applied, every ShardedTensor's data a meta tensor of its
    output dtype, and ``replica_id`` set so each tensor is saved by exactly one rank.

    Returns (sharded_state_dict, LazyTensors, bytes this rank writes, total bytes)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    by_id = {id(t): name for name, t in model.state_dict(keep_vars=True).items() if t is not None}
    ssd = model.sharded_state_dict()
    lazy = LazyTensors(reader)
    unknown = []
    owned: List[Tuple[object, Optional[TensorSource]]] = []  # (sharded object, source)

    def meta_like(sh: ShardedTensor, dtype):
        sh.data = torch.empty(sh.local_shape, dtype=dtype, device="meta")
        sh.dtype = dtype

    def convert(x):
        if isinstance(x, ShardedTensorFactory):
            local = by_id.get(id(x.data))
            if local not in sources:
                unknown.append(x.key)
                return x
            src = sources[local]
            built = x.build()
            for i, sub in enumerate(_as_list(built)):
                meta_like(sub, src.dtype)
                lazy.register(sub, src, x, i)
                owned.append((sub, src))
            return built
        if isinstance(x, ShardedTensor):
            local = by_id.get(id(x.data))
            if local not in sources:
                unknown.append(x.key)
                return x
            src = sources[local]
            if tuple(x.local_shape) != src.shape or x.flattened_range is not None:
                raise RuntimeError(f"{x.key}: the TP1 shard {x.local_shape} is not the whole tensor {src.shape}")
            meta_like(x, src.dtype)
            lazy.register(x, src)
            owned.append((x, src))
            return x
        if isinstance(x, ShardedObject):
            owned.append((x, None))
        return x

    dict_list_map_inplace(convert, ssd)
    if unknown:
        raise RuntimeError(f"sharded tensors whose data is not a model tensor (cannot find their HF source): "
                           f"{unknown}")
    unsaved = sorted(set(sources) - {src.local for _, src in owned if src is not None})
    if unsaved:
        raise RuntimeError(f"model tensors missing from the model's sharded_state_dict: {unsaved}")

    # one owner per source (both halves of a fused tensor together), greedy by bytes; ShardedObjects on rank 0
    owner: Dict[str, int] = {}
    load = [0] * world
    for s in sorted(sources.values(), key=lambda s: (-s.nbytes, s.local)):
        r = min(range(world), key=lambda i: (load[i], i))
        owner[s.local] = r
        load[r] += s.nbytes
    mine = 0
    for sh, src in owned:
        o = 0 if src is None else owner[src.local]
        sh.replica_id = 0 if o == rank else 1
        if src is not None and o == rank:
            mine += sh.data.nbytes
    # sanity: nothing left in the state dict that is neither sharded nor common
    for v in nested_values(ssd):
        if isinstance(v, ShardedTensorFactory):
            raise RuntimeError(f"unapplied factory {v.key}")
    return ssd, lazy, mine, sum(load)


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""The converter's ``--dtype`` names."""
MTP_INIT_SEED = 1234
"""Seed of a freshly initialised MTP block (``--mtp-init``)."""


def _fresh_mtp_tensors(hf_dir: str) -> Dict[str, torch.Tensor]:
    """A newly initialised MTP block (megatron's own init, fp32, CPU, fixed seed) -> {canonical name: tensor}."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    from megatron_glm5.config import Glm5Config
    from megatron_glm5.models.layer_specs import get_mtp_block_spec

    cfg = Glm5Config.from_hf(hf_dir, use_cpu_initialization=True, perform_initialization=True,
                             params_dtype=torch.float32, kda_backend="torch", dsa_backend="torch")
    torch.manual_seed(MTP_INIT_SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(MTP_INIT_SEED)
    block = MultiTokenPredictionBlock(config=cfg, spec=get_mtp_block_spec(cfg))
    return {"mtp." + k: v.detach() for k, v in block.state_dict().items() if torch.is_tensor(v)}


def conversion_sources(hf_dir: str, dtype: torch.dtype, mtp: bool, mtp_init: bool):
    """(config, meta model, sources) of the converted model; with ``mtp_init`` the MTP sources carry fresh data."""
    from megatron_glm5.models.builder import build_meta_model

    model = build_meta_model(hf_dir, dtype, **({} if mtp else {"mtp_num_layers": None}))
    sources = model_sources(model, dtype)
    if mtp_init:
        fresh = _fresh_mtp_tensors(hf_dir)
        for s in sources.values():
            if s.local.startswith("mtp."):
                s.fresh = fresh[s.local]
    return model.config, model, sources
