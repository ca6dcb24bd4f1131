"""Stream an HF GLM-5.3 checkpoint into a megatron-core ``dist_checkpointing`` (torch_dist) checkpoint.

The model is never materialised. Its layout comes from a TP=PP=EP=1 model built on the meta device: its
``sharded_state_dict()`` names every megatron ShardedTensor (ShardedTensorFactory for the fused SwiGLU
``linear_fc1``, one shard per routed expert on a prepended expert axis) and ShardedObject with the keys, global
shapes and offsets that ``dist_checkpointing.load`` expects. Each ShardedTensor's data is swapped for a meta tensor
of the target dtype, and the checkpoint is saved through megatron's own ``dist_checkpointing.save`` (so
``common.pt``, ``metadata.json`` and the ShardedObjects are written by megatron itself) with a sharded strategy
that hands torch DCP a :class:`LazySavePlanner`: its ``resolve_data`` produces a shard's real data only when the
single-threaded ``FileSystemWriter`` is about to write it::

    HF key(s) from the key table (hf_keys.mcore_to_hf) -> HFCheckpointReader.get (FP8 dequantised, NaN/inf fatal)
      -> [gate; up] fused on dim 0 -> cast to the target dtype -> ShardedTensorFactory.build_fn where there is one
      -> the shard -> written and dropped

so peak memory is the meta model plus one or two tensors. The target dtype is bf16 (or fp32); parameters marked
``keep_fp32`` and buffers (the router ``expert_bias``) keep fp32, as the model keeps them.

Several processes (``workers``) form a gloo group; every tensor (a fused pair counts as one) is owned by exactly one
rank (``replica_id`` 0 there, 1 elsewhere), balanced by bytes, and each rank writes its own ``__{rank}_0.distcp``.

Files in the output directory: ``.metadata`` + ``__*_*.distcp`` (torch DCP), ``common.pt`` and ``metadata.json``
(megatron), ``hf_config.json`` (``Glm5Config.to_hf_dict()``, read by the exporter) and ``conversion_info.json``.
The checkpoint is layout-free: ``dist_checkpointing.load(model.sharded_state_dict(), dir)`` reshards it for any
TP/PP/EP; the requested layout is only validated and recorded. Everything is written into a temporary sibling
directory that is renamed into place only when complete.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import queue as queue_mod
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_glm5.checkpoint.hf_io import (
    CheckpointMismatchError,
    HFCheckpointReader,
    raise_if_mismatched,
    split_unused_keys,
)
from megatron_glm5.checkpoint.hf_keys import canonical_name, is_non_persistent, mcore_to_hf
from megatron_glm5.config import Glm5Config, Glm5ConfigError

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
HF_CONFIG_FNAME = "hf_config.json"
INFO_FNAME = "conversion_info.json"
# close the reader's safetensors handles (their mmaps count as resident memory) after this many bytes read
_REOPEN_BYTES = 256 * 2 ** 20


class ConversionInputError(ValueError):
    """A bad argument (paths, dtype, parallel layout) detected before any tensor is read."""


# every error that means "bad input" (the CLI exits 2 with one line for these)
INPUT_ERRORS = (ConversionInputError, CheckpointMismatchError, Glm5ConfigError, FileNotFoundError)


# ----------------------------------------------------------------------------------------------- validation
def validate_layout(hf_config, tp: int = 1, pp: int = 1, ep: int = 1, pipeline_layout: Optional[str] = None,
                    first_stage_layers: Optional[int] = None, last_stage_layers: Optional[int] = None) -> None:
    """Raise ConversionInputError unless the model of ``hf_config`` (an HF checkpoint dir, config.json path or dict)
    can be built at TP=tp, PP=pp, EP=ep with the given pipeline layout (megatron's layout string, or the number of
    decoder layers on the first / last stage; none: even, refused when PP does not divide the layers; see
    ``megatron_glm5.models.parallel_layout``). Glm5ConfigError if the config itself is invalid."""
    cfg = Glm5Config.from_hf(hf_config)
    for name, v in (("tp", tp), ("pp", pp), ("ep", ep)):
        if not isinstance(v, int) or v < 1:
            raise ConversionInputError(f"--{name} must be a positive integer, got {v!r}")
    if tp > 1:
        need = [("num_attention_heads", cfg.num_attention_heads), ("linear_num_heads", cfg.linear_num_heads),
                ("vocab_size (embedding and output layer rows)", cfg.vocab_size),
                ("intermediate_size", cfg.ffn_hidden_size)]
        if cfg.num_moe_experts:
            need.append(("moe_intermediate_size", cfg.moe_ffn_hidden_size))
            if cfg.moe_shared_expert_intermediate_size:
                need.append(("shared expert size", cfg.moe_shared_expert_intermediate_size))
        bad = [f"{n} = {v}" for n, v in need if v % tp]
        if bad:
            raise ConversionInputError(f"--tp {tp} does not divide {', '.join(bad)}")
    if ep > 1:
        if not cfg.num_moe_experts:
            raise ConversionInputError(f"--ep {ep}: the model has no MoE layers")
        if cfg.num_moe_experts % ep:
            raise ConversionInputError(f"--ep {ep} does not divide n_routed_experts = {cfg.num_moe_experts}")
    if pp > 1 and cfg.num_layers < pp:
        raise ConversionInputError(f"--pp {pp} exceeds num_hidden_layers = {cfg.num_layers}")
    # the pipeline layout (stages, MTP on the last stage, shared-indexer DSA layers kept with their full layer) and
    # megatron's own checks (TransformerConfig.__post_init__)
    layout = dict(pipeline_model_parallel_layout=pipeline_layout, num_layers_in_first_pipeline_stage=first_stage_layers,
                  num_layers_in_last_pipeline_stage=last_stage_layers)
    try:
        Glm5Config.from_hf(hf_config, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                           expert_model_parallel_size=ep, pipeline_dtype=torch.bfloat16,
                           **{k: v for k, v in layout.items() if v is not None})
    except (AssertionError, ValueError) as e:
        raise ConversionInputError(f"--tp {tp} --pp {pp} --ep {ep}: {' '.join(str(e).split())}") from None


@dataclass
class TensorSource:
    """One model tensor and where its data comes from."""

    local: str                # state-dict name in the TP1 meta model (== canonical name)
    hf_keys: List[str]        # one key, or [gate, up] fused on dim 0
    shape: Tuple[int, ...]    # full (TP1) shape
    dtype: torch.dtype        # dtype written to the checkpoint

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


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


def _hf_dtype(reader: HFCheckpointReader, key: str) -> str:
    """The safetensors dtype string of ``key`` (header only)."""
    return reader._handle(reader.key_to_file[key]).get_slice(key).get_dtype()


def validate_hf_checkpoint(hf_dir: str, reader: HFCheckpointReader, model: torch.nn.Module,
                           sources: Dict[str, TensorSource]) -> Dict:
    """Check every HF key the model needs (present, right shape, FP8 scale present) and that the checkpoint holds no
    key the model would not use, without reading a tensor. Raises CheckpointMismatchError listing all offenders
    (the same report as ``load_hf_checkpoint``); returns ``{"skipped": [...]}`` (e.g. MTP keys without MTP config)."""
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
            got = reader.shape(k)
            if tuple(got) != tuple(part):
                what = f"part {s.hf_keys.index(k) + 1}/{n} of " if n > 1 else ""
                mismatched.append(f"{k}: checkpoint {tuple(got)} vs model {what}{s.local} {tuple(part)}")
            elif _hf_dtype(reader, k) == "F8_E4M3" and k + "_scale_inv" not in hf_keys:
                missing.append(k + "_scale_inv")
        used.update(s.hf_keys)
    unexpected, skipped = split_unused_keys(hf_keys, used, model, cfg.num_layers, cfg.mtp_num_layers or 0)
    raise_if_mismatched(hf_dir, missing, unexpected, mismatched,
                        shape_hint=" - does config.json describe these weights?")
    return {"skipped": skipped}


# ----------------------------------------------------------------------------------------------- meta model
def ensure_single_process_megatron() -> None:
    """A 1-process group with megatron parallel state TP=PP=EP=CP=1 (created if absent)."""
    from megatron.core import parallel_state as ps

    if dist.is_initialized() and dist.get_world_size() != 1:
        raise RuntimeError("convert_hf_to_mcore runs in one process (world size "
                           f"{dist.get_world_size()} found); use workers=N for parallel conversion")
    if ps.model_parallel_is_initialized():
        sizes = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                 ps.get_expert_model_parallel_world_size(), ps.get_context_parallel_world_size())
        if sizes != (1, 1, 1, 1):
            raise RuntimeError(f"convert_hf_to_mcore needs megatron parallel state TP=PP=EP=CP=1, found {sizes}")
        return
    from megatron_glm5.initialize import initialize_megatron

    initialize_megatron()


def build_meta_model(hf_dir: str, dtype: torch.dtype):
    """(config, Glm5Model on the meta device at TP=PP=EP=1). Parallel state must be initialised."""
    from megatron_glm5.models.builder import build_meta_model as _build_meta

    cfg = Glm5Config.from_hf(hf_dir, use_cpu_initialization=True, perform_initialization=False, params_dtype=dtype)
    return cfg, _build_meta(cfg)


# ----------------------------------------------------------------------------------------------- lazy data
class LazyTensors:
    """(sharded key, global offset) -> the shard's data, produced on demand from the HF checkpoint.

    A fused tensor feeds two shards (the SwiGLU factory's w and v halves): its full tensor is kept until both are
    produced, then dropped."""

    def __init__(self, reader: HFCheckpointReader):
        self.reader = reader
        self.entries: Dict[Tuple[str, Tuple[int, ...]], Tuple[TensorSource, object, int]] = {}
        self._remaining: Dict[str, int] = {}
        self._cache: Dict[str, torch.Tensor] = {}
        self._bytes_since_reopen = 0
        self.hf_reads = 0

    def register(self, sh_ten, source: TensorSource, factory=None, index: int = 0) -> None:
        key = (sh_ten.key, tuple(sh_ten.global_offset))
        if key in self.entries:
            raise RuntimeError(f"duplicate shard {key}")
        self.entries[key] = (source, factory, index)
        self._remaining[source.local] = self._remaining.get(source.local, 0) + 1

    def _full(self, s: TensorSource) -> torch.Tensor:
        if s.local in self._cache:
            return self._cache[s.local]
        parts = [self.reader.get(k, dtype=s.dtype) for k in s.hf_keys]
        self.hf_reads += len(parts)
        full = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        del parts
        full = full.to(s.dtype)
        if tuple(full.shape) != s.shape:
            raise CheckpointMismatchError(f"{'+'.join(s.hf_keys)}: read {tuple(full.shape)}, model {s.local} "
                                          f"expects {s.shape}")
        self._bytes_since_reopen += full.numel() * full.element_size()
        if self._bytes_since_reopen > _REOPEN_BYTES:
            # drop the safetensors handles so the pages of their mmaps stop counting as resident memory
            self.reader.close()
            self._bytes_since_reopen = 0
        if self._remaining[s.local] > 1:
            self._cache[s.local] = full
        return full

    def produce(self, fqn: str, offset: Tuple[int, ...]) -> torch.Tensor:
        source, factory, index = self.entries[(fqn, offset)]
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
        self._remaining[source.local] -= 1
        if self._remaining[source.local] == 0:
            self._cache.pop(source.local, None)
        return data


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
            mine += sh.data.numel() * sh.data.element_size()
    # sanity: nothing left in the state dict that is neither sharded nor common
    for v in nested_values(ssd):
        if isinstance(v, ShardedTensorFactory):
            raise RuntimeError(f"unapplied factory {v.key}")
    return ssd, lazy, mine, sum(load)


# ----------------------------------------------------------------------------------------------- DCP plumbing
def _planner_cls():
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class LazySavePlanner(MCoreSavePlanner):
        """MCoreSavePlanner whose tensors are produced by :class:`LazyTensors` when the writer asks for them."""

        def __init__(self, lazy: LazyTensors, on_bytes: Optional[Callable[[int], None]] = None):
            super().__init__(dedup_replicated_tensors=False, flatten_state_dict=False)
            self.lazy = lazy
            self.on_bytes = on_bytes
            self.error: Optional[BaseException] = None
            self.bytes_written = 0

        def create_global_plan(self, all_plans):
            # megatron's async saver records the gathered local plans in the metadata (for cached-plan reuse)
            plans, metadata = super().create_global_plan(all_plans)
            metadata.all_local_plans = all_plans
            return plans, metadata

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            try:
                idx = write_item.index
                t = self.lazy.produce(idx.fqn, tuple(idx.offset))
                t = t.reshape(tuple(write_item.tensor_data.chunk.sizes))
                want = write_item.tensor_data.properties.dtype
                if t.dtype != want:
                    raise RuntimeError(f"{idx.fqn}: produced {t.dtype}, planned {want}")
            except BaseException as e:  # noqa: BLE001 - remembered so the caller sees the original error
                if self.error is None:
                    self.error = e
                raise
            n = t.numel() * t.element_size()
            self.bytes_written += n
            if self.on_bytes is not None:
                self.on_bytes(n)
            return t

    return LazySavePlanner


def _strategy(lazy: LazyTensors, on_bytes, checkpoint_id: Optional[str] = None):
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.planner import WriteItemType

    planner_cls = _planner_cls()

    class Writer(FileSystemWriter):
        """torch's FileSystemWriter, writing each file strictly one item at a time.

        torch 2.13's ``_write_files_from_queue`` keeps every tensor it has written in a dict until its file is done
        (for its safetensors format), which would hold the whole converted model (and, through safetensors' mmaps,
        every HF shard) in memory; this loop writes the same records with torch's ``_write_item`` and drops each
        tensor right after."""

        def _write_data(self, planner, file_queue):
            from torch.distributed.checkpoint.filesystem import SerializationFormat, _write_item
            from torch.futures import Future

            if self.serialization_format != SerializationFormat.TORCH_SAVE:
                return super()._write_data(planner, file_queue)
            results = []
            while True:
                try:
                    file_name, storage_key, write_items = file_queue.get_nowait()
                except queue_mod.Empty:
                    break
                with self.fs.create_stream(file_name, "wb") as stream:
                    for item in [w for w in write_items if w.type == WriteItemType.BYTE_IO]:
                        data = planner.resolve_data(item)
                        results.append(_write_item(self.transforms, stream, data, item, storage_key,
                                                   self.serialization_format))
                    for item in [w for w in write_items if w.type != WriteItemType.BYTE_IO]:
                        t = planner.resolve_data(item).detach().cpu()
                        if t.untyped_storage().size() != t.nbytes:  # a view: save only its own bytes
                            t = t.clone()
                        results.append(_write_item(self.transforms, stream, t, item, storage_key,
                                                   self.serialization_format))
                        del t
                    if self.sync_files:
                        try:
                            os.fsync(stream.fileno())
                        except (AttributeError, OSError):
                            os.sync()
            fut = Future()
            fut.set_result(results)
            return fut

        def storage_meta(self):
            meta = super().storage_meta()
            if checkpoint_id is not None:  # the final directory, not the temporary one being written
                meta.checkpoint_id = checkpoint_id
            return meta

    class StreamingTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
        """megatron's torch_dist save (same translation to DCP, same format) with a serial FileSystemWriter and
        lazily produced tensors instead of megatron's async writer (which stages every tensor in memory first)."""

        def __init__(self):
            super().__init__("torch_dist", 1, keep_only_main_replica=True, thread_count=1)
            self.planner = None

        def save(self, sharded_state_dict, checkpoint_dir):
            sd, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
            pyt_state_dict = mcore_to_pyt_state_dict(sd, False)
            writer = Writer(str(checkpoint_dir), single_file_per_rank=True, sync_files=True, thread_count=1,
                            overwrite=True)
            self.planner = planner_cls(lazy, on_bytes)
            try:
                dcp_save(pyt_state_dict, storage_writer=writer, planner=self.planner)
            except BaseException:
                if self.planner.error is not None:
                    raise self.planner.error from None
                raise

    return StreamingTorchDistSaveStrategy()


def save_streaming(model, sources: Dict[str, TensorSource], reader: HFCheckpointReader, out_dir: str,
                   on_bytes: Optional[Callable[[int], None]] = None, final_dir: Optional[str] = None) -> Dict:
    """Write the torch_dist checkpoint of ``model`` (meta, TP1) from ``reader`` into the existing empty ``out_dir``
    (``final_dir``: where it will be moved, recorded as the DCP checkpoint id). Collective over the default process
    group (each rank writes the tensors it owns)."""
    from megatron.core import dist_checkpointing

    rank, world = dist.get_rank(), dist.get_world_size()
    ssd, lazy, mine, total = prepare_sharded_state_dict(model, sources, reader, rank, world)
    strategy = _strategy(lazy, on_bytes, final_dir)
    dist_checkpointing.save(ssd, out_dir, sharded_strategy=strategy, validate_access_integrity=True)
    written = strategy.planner.bytes_written if strategy.planner else 0
    if written != mine:
        raise RuntimeError(f"rank {rank} wrote {written} tensor bytes, expected {mine}")
    return {"bytes": written, "hf_reads": lazy.hf_reads, "total_bytes": total}


# ----------------------------------------------------------------------------------------------- workers
def _worker_entry(rank: int, world: int, port: int, hf_dir: str, out_dir: str, dtype_name: str, q,
                  final_dir: Optional[str] = None) -> None:
    """One of ``workers`` processes: gloo group of ``world``, meta model, write the owned tensors."""
    import warnings

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from megatron_glm5.initialize import destroy_megatron, initialize_megatron

    try:
        initialize_megatron()
        _, model = build_meta_model(hf_dir, DTYPES[dtype_name])
        sources = model_sources(model, DTYPES[dtype_name])
        reader = HFCheckpointReader(hf_dir)
        stats = save_streaming(model, sources, reader, out_dir, on_bytes=lambda n: q.put(("bytes", rank, n)),
                               final_dir=final_dir)
        reader.close()
        q.put(("done", rank, stats))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which prints the one error
        q.put(("error", rank, type(e).__name__, str(e)))
        code = 1
    else:
        code = 0
    finally:
        destroy_megatron()
    if code:
        raise SystemExit(code)  # a quiet non-zero exit (no second traceback on the console)


def _run_workers(workers: int, hf_dir: str, out_dir: str, dtype_name: str, on_bytes,
                 final_dir: Optional[str] = None) -> Dict:
    import torch.multiprocessing as tmp

    from megatron_glm5.initialize import _free_port

    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    # the workers import megatron-core before any code of theirs runs: keep its import-time notices (no Transformer
    # Engine / Apex, deprecations) off the console, as the CLI does for itself
    saved = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = "ignore::UserWarning" + ("," + saved if saved else "")
    try:
        pc = tmp.start_processes(_worker_entry, args=(workers, _free_port(), hf_dir, out_dir, dtype_name, q,
                                                      final_dir), nprocs=workers, join=False, start_method="spawn")
    finally:
        if saved is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = saved
    stats, errors = {}, []

    def drain(block: float = 0.0):
        while True:
            try:
                msg = q.get(timeout=block) if block else q.get_nowait()
            except queue_mod.Empty:
                return
            block = 0.0
            if msg[0] == "bytes" and on_bytes is not None:
                on_bytes(msg[2])
            elif msg[0] == "done":
                stats[msg[1]] = msg[2]
            elif msg[0] == "error":
                errors.append(msg)

    try:
        while True:
            drain(0.2)
            try:
                if pc.join(timeout=0.1):
                    break
            except Exception as e:  # noqa: BLE001 - a worker died; torch has terminated the others
                drain(0.5)
                for _, rank, name, text in errors:
                    if name == CheckpointMismatchError.__name__:
                        raise CheckpointMismatchError(text) from None
                if errors:
                    _, rank, name, text = errors[0]
                    raise RuntimeError(f"conversion worker {rank} failed: {name}: {text}") from None
                raise RuntimeError(f"conversion worker failed: {e}") from None
        drain()
    finally:
        for p in pc.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
    if len(stats) != workers:
        raise RuntimeError(f"only {len(stats)} of {workers} conversion workers reported completion")
    return {"bytes": sum(s["bytes"] for s in stats.values()), "hf_reads": sum(s["hf_reads"] for s in stats.values()),
            "total_bytes": stats[0]["total_bytes"]}


# ----------------------------------------------------------------------------------------------- entry point
def convert_hf_to_mcore(hf_dir: str, out_dir: str, dtype: str = "bf16", tp: int = 1, pp: int = 1, ep: int = 1,
                        workers: int = 1, progress: bool = True, overwrite: bool = False,
                        pipeline_layout: Optional[str] = None, first_stage_layers: Optional[int] = None,
                        last_stage_layers: Optional[int] = None) -> Dict:
    """Convert ``hf_dir`` (HF GLM-5.3 safetensors, FP8 or not) into a torch_dist checkpoint at ``out_dir``.
    The checkpoint is layout-free; ``tp`` / ``pp`` / ``ep`` and the pipeline layout are validated and recorded.

    All validation (arguments, config, layout, every key and shape) happens before a tensor is read; bad input
    raises one of :data:`INPUT_ERRORS`. ``out_dir`` appears only when the checkpoint is complete. Returns the
    ``conversion_info.json`` dict."""
    t0 = time.time()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if dtype not in DTYPES:
        raise ConversionInputError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not isinstance(workers, int) or workers < 1:
        raise ConversionInputError(f"--workers must be a positive integer, got {workers!r}")
    if not os.path.isdir(hf_dir):
        raise ConversionInputError(f"--hf-dir {hf_dir} is not a directory")
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not overwrite:
        raise ConversionInputError(f"--out {out_dir} already exists")
    if os.path.abspath(hf_dir) == out_dir:
        raise ConversionInputError("--out must differ from --hf-dir")
    torch_dtype = DTYPES[dtype]

    try:
        validate_layout(hf_dir, tp, pp, ep, pipeline_layout, first_stage_layers, last_stage_layers)
        reader = HFCheckpointReader(hf_dir)
    except json.JSONDecodeError as e:
        raise ConversionInputError(f"{hf_dir}: unreadable JSON ({e})") from None
    ensure_single_process_megatron()
    cfg, model = build_meta_model(hf_dir, torch_dtype)
    sources = model_sources(model, torch_dtype)
    report = validate_hf_checkpoint(hf_dir, reader, model, sources)
    total = sum(s.nbytes for s in sources.values())

    parent = os.path.dirname(out_dir)
    created = []  # parent folders this call creates (removed again if the conversion fails)
    d = parent
    while not os.path.exists(d):
        created.append(d)
        d = os.path.dirname(d)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc="convert", dynamic_ncols=True,
                   smoothing=0.1)
    on_bytes = bar.update if bar is not None else None
    try:
        if workers == 1:
            stats = save_streaming(model, sources, reader, tmp, on_bytes=on_bytes, final_dir=out_dir)
        else:
            del model
            gc.collect()
            stats = _run_workers(workers, hf_dir, tmp, dtype, on_bytes, final_dir=out_dir)
        reader.close()
        if bar is not None:
            bar.close()
            bar = None
        with open(os.path.join(tmp, HF_CONFIG_FNAME), "w") as fh:
            json.dump(cfg.to_hf_dict(), fh, indent=2)
        disk = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(tmp) for f in fs)
        info = {
            "source": os.path.abspath(hf_dir), "format": "torch_dist", "dtype": dtype,
            "layout": {"tp": tp, "pp": pp, "ep": ep, **{k: v for k, v in (
                ("pipeline_layout", pipeline_layout), ("first_stage_layers", first_stage_layers),
                ("last_stage_layers", last_stage_layers)) if v is not None}}, "workers": workers, "started": started,
            "seconds": round(time.time() - t0, 3), "tensor_bytes": stats["bytes"], "checkpoint_bytes": disk,
            "num_tensors": len(sources), "hf_keys_skipped": report["skipped"],
            "versions": {"torch": torch.__version__, "megatron_core": _mcore_version()},
        }
        with open(os.path.join(tmp, INFO_FNAME), "w") as fh:
            json.dump(info, fh, indent=2)
        _dir_fsync(tmp)
        if os.path.exists(out_dir):  # overwrite=True: swap, then delete the old one
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
            os.replace(out_dir, os.path.join(old, "ckpt"))
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
        _dir_fsync(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in created:
            try:
                os.rmdir(d)
            except OSError:
                pass
        raise
    finally:
        if bar is not None:
            bar.close()
        reader.close()
    return info


def _mcore_version() -> str:
    try:
        from megatron.core import package_info

        return package_info.__version__
    except Exception:  # noqa: BLE001
        return "unknown"


def _dir_fsync(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
