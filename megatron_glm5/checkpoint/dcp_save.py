"""Saving a megatron-core torch_dist checkpoint whose tensors are produced while they are written.

megatron-core's ``dist_checkpointing.save`` prepares the state dict (the common, non-sharded state becomes the
``common_state`` ShardedObject) and writes ``metadata.json``; the sharded part goes through
:class:`StreamingTorchDistSaveStrategy`, a ``TorchDistSaveShardedStrategy`` (the only strategy type megatron's
``save`` takes) that translates the ShardedTensors and ShardedObjects with megatron's ``mcore_to_pyt_state_dict``
(the same format as megatron's own torch_dist save) and saves them with torch DCP, using megatron's
``MCoreSavePlanner`` (subclassed so data comes from :class:`LazyTensors`) and :class:`ParallelStreamWriter`:

* ``threads`` files per rank (``__{rank}_{i}.distcp``) are written concurrently, one thread each; every thread
  produces (reads, dequantises, checks, casts) the next tensor of its file and writes it at once, so reading,
  conversion and writing overlap and peak memory stays a few tensors. (megatron's async FileSystemWriterAsync
  stages every tensor in memory first; torch's FileSystemWriter keeps every written tensor of a file.)
* each file's SHA-256 is computed while it is written (for the checksum manifest).

Each tensor is one ``torch.save`` record, as in torch's own
FileSystemWriter: written by :class:`~megatron_glm5.checkpoint.torch_record.TorchRecordWriter` (the same bytes as
``torch.save``, with its Python work per tensor cut to a few calls and the data copied, CRC'd and hashed outside the
GIL), or, for what it does not write (other dtypes, 4 GiB and more, stream transforms), by torch's
``filesystem._write_item``. The non-public parts of torch used: ``_write_item`` and ``_StorageInfo`` (the record
entry of DCP's metadata).
"""

from __future__ import annotations

import os
import queue as queue_mod
import threading
import time
import warnings
from collections import defaultdict
from typing import Callable, Dict, Optional

import torch.distributed as dist

from megatron_glm5.checkpoint.checksums import HashingFile
from megatron_glm5.checkpoint.lazy_sources import LazyTensors, TensorSource, prepare_sharded_state_dict
from megatron_glm5.checkpoint.tracker import CHECKPOINT_VERSION
from megatron_glm5.checkpoint.torch_record import TorchRecordWriter

RECORDS = TorchRecordWriter()  # the process's torch.save record writer (its caches and dtype checks are shared)


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
            self.first_produced: Optional[float] = None  # time.time() of the first tensor asked for
            self._lock = threading.Lock()

        def create_global_plan(self, all_plans):
            # megatron's async saver records the gathered local plans in the metadata (for cached-plan reuse)
            plans, metadata = super().create_global_plan(all_plans)
            metadata.all_local_plans = all_plans
            return plans, metadata

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            if self.first_produced is None:
                self.first_produced = time.time()
            try:
                idx = write_item.index
                t = self.lazy.produce(idx.fqn, tuple(idx.offset))
                t = t.reshape(tuple(write_item.tensor_data.chunk.sizes))
                want = write_item.tensor_data.properties.dtype
                if t.dtype != want:
                    raise RuntimeError(f"{idx.fqn}: produced {t.dtype}, planned {want}")
            except BaseException as e:  # noqa: BLE001 - remembered so the caller sees the original error
                with self._lock:
                    if self.error is None:
                        self.error = e
                raise
            n = t.nbytes
            with self._lock:
                self.bytes_written += n
            if self.on_bytes is not None:
                self.on_bytes(n)
            return t

    return LazySavePlanner


_WRITEBACK_BYTES = 32 * 2 ** 20


def _start_writeback(raw, kicked: int) -> int:
    """Once ``_WRITEBACK_BYTES`` more of ``raw`` are written, ask the kernel to start writing them to disk now
    (``posix_fadvise(DONTNEED)`` starts the writeback of dirty pages without waiting for it, and drops the pages
    already clean): the disk works while the threads convert, instead of the whole file waiting in the page cache
    for the final fsync. Returns the new start of the range not yet kicked."""
    pos = raw.tell()
    if pos - kicked < _WRITEBACK_BYTES or not hasattr(os, "posix_fadvise"):
        return kicked
    raw.flush()
    try:
        os.posix_fadvise(raw.fileno(), kicked, pos - kicked, os.POSIX_FADV_DONTNEED)
    except OSError:  # an advice only
        pass
    return pos


def _writer_cls():
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat, _StorageInfo, _write_item
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    def _result(item, storage_key: str, offset: int, length: int):
        """The WriteResult of a record written at ``offset`` (what _write_item returns without stream transforms)."""
        return WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(storage_key, offset,
                                                                                            length))

    class ParallelStreamWriter(FileSystemWriter):
        """torch's FileSystemWriter writing its ``thread_count`` files concurrently, each strictly one item at a
        time (the tensor dropped right after), hashing every file as it is written (``digests``)."""

        def __init__(self, path: str, thread_count: int, checkpoint_id: Optional[str] = None):
            super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=thread_count,
                             overwrite=True)
            self.final_id = checkpoint_id
            self.digests: Dict[str, str] = {}
            self._abort = threading.Event()  # set by the first failing thread: the others stop at their next item

        def _write_one_file(self, planner, file_name, storage_key, write_items, results):
            direct = not getattr(self.transforms, "extensions", True)  # no stream transforms: RECORDS may write
            with self.fs.create_stream(file_name, "wb") as raw:
                stream = HashingFile(raw)
                for item in [w for w in write_items if w.type == WriteItemType.BYTE_IO]:
                    data = planner.resolve_data(item)
                    if direct:  # what _write_item writes for it: the bytes as they are
                        offset = stream.tell()
                        stream.write(data.getbuffer())
                        results.append(_result(item, storage_key, offset, stream.tell() - offset))
                    else:
                        results.append(_write_item(self.transforms, stream, data, item, storage_key,
                                                   self.serialization_format))
                kicked = 0  # bytes of the file whose writeback has been started
                for item in [w for w in write_items if w.type != WriteItemType.BYTE_IO]:
                    if self._abort.is_set():
                        return
                    t = planner.resolve_data(item).detach().cpu()
                    if t.untyped_storage().nbytes() != t.nbytes:  # a view: save only its own bytes
                        t = t.clone()
                    if direct and RECORDS.supports(t):
                        offset = stream.tell()
                        results.append(_result(item, storage_key, offset, RECORDS.write(stream, t)))
                    else:
                        results.append(_write_item(self.transforms, stream, t, item, storage_key,
                                                   self.serialization_format))
                    del t
                    kicked = _start_writeback(raw, kicked)
                raw.flush()
                os.fsync(raw.fileno())
            self.digests[os.path.basename(str(file_name))] = stream.hexdigest()

        def _write_data(self, planner, file_queue):
            if self.serialization_format != SerializationFormat.TORCH_SAVE:
                raise NotImplementedError("only torch_save serialization is streamed")
            results, errors = [], []

            def work():
                while not self._abort.is_set():
                    try:
                        job = file_queue.get_nowait()
                    except queue_mod.Empty:
                        return
                    try:
                        self._write_one_file(planner, *job, results)
                    except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
                        errors.append(e)
                        self._abort.set()

            threads = [threading.Thread(target=work, daemon=True) for _ in range(max(1, self.thread_count) - 1)]
            for th in threads:
                th.start()
            work()
            for th in threads:
                th.join()
            if errors:
                raise errors[0]
            fut = Future()
            fut.set_result(results)
            return fut

        def storage_meta(self):
            meta = super().storage_meta()
            if self.final_id is not None:  # the final directory, not the temporary one being written
                meta.checkpoint_id = self.final_id
            return meta

    return ParallelStreamWriter


def _group_by_sharded_key(sharded_state_dict) -> Dict[str, list]:
    """ShardedTensors / ShardedObjects of this rank's main replicas, grouped by their checkpoint key."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, is_main_replica

    out = defaultdict(list)
    for sh in nested_values(sharded_state_dict):
        if is_main_replica(sh.replica_id):
            out[sh.unique_key if isinstance(sh, ShardedObject) else sh.key].append(sh)
    return dict(out)


def _strategy_cls():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy, mcore_to_pyt_state_dict
    from torch.distributed.checkpoint import save as dcp_save

    class StreamingTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
        """megatron's torch_dist format (same translation to DCP) written by :class:`ParallelStreamWriter` with
        lazily produced tensors (synchronously: no async save)."""

        def __init__(self, lazy: LazyTensors, on_bytes, threads: int = 2, checkpoint_id: Optional[str] = None):
            super().__init__("torch_dist", 1, thread_count=threads)
            self.lazy, self.on_bytes, self.threads, self.checkpoint_id = lazy, on_bytes, threads, checkpoint_id
            self.planner = None
            self.writer = None

        def async_save(self, sharded_state_dict, checkpoint_dir, async_strategy="nvrx"):
            raise NotImplementedError("the streaming save is synchronous")

        def save(self, sharded_state_dict, checkpoint_dir):
            pyt_state_dict = mcore_to_pyt_state_dict(_group_by_sharded_key(sharded_state_dict), False)
            self.writer = _writer_cls()(str(checkpoint_dir), self.threads, self.checkpoint_id)
            self.planner = _planner_cls()(self.lazy, self.on_bytes)
            # one process: DCP's plan exchange without collectives (it pickles every plan through gloo otherwise);
            # the same planner calls, so the same metadata
            single = dist.get_world_size() == 1
            if single:
                warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                                        "uninitialized", category=UserWarning)
            try:
                dcp_save(pyt_state_dict, storage_writer=self.writer, planner=self.planner, no_dist=single)
            except BaseException:
                if self.planner.error is not None:
                    raise self.planner.error from None
                raise

    return StreamingTorchDistSaveStrategy


def save_streaming(model, sources: Dict[str, TensorSource], reader, out_dir: str,
                   on_bytes: Optional[Callable[[int], None]] = None, final_dir: Optional[str] = None,
                   threads: int = 2) -> Dict:
    """Write the torch_dist checkpoint of ``model`` (meta, TP1) from ``reader`` into the existing empty ``out_dir``
    (``final_dir``: where it will be moved, recorded as the DCP checkpoint id). Collective over the default process
    group (each rank writes the tensors it owns, in ``threads`` files). Returns byte counts, the SHA-256 of each
    file this rank wrote and ``write_span``: (time of the first tensor read, time the last file was synced)."""
    from megatron.core import dist_checkpointing

    rank, world = dist.get_rank(), dist.get_world_size()
    ssd, lazy, mine, total = prepare_sharded_state_dict(model, sources, reader, rank, world)
    ssd["checkpoint_version"] = CHECKPOINT_VERSION  # the common state Megatron-LM's loader reads
    strategy = _strategy_cls()(lazy, on_bytes, threads, final_dir)
    dist_checkpointing.save(ssd, out_dir, sharded_strategy=strategy, validate_access_integrity=True)
    end = time.time()
    written = strategy.planner.bytes_written if strategy.planner else 0
    if written != mine:
        raise RuntimeError(f"rank {rank} wrote {written} tensor bytes, expected {mine}")
    first = strategy.planner.first_produced if strategy.planner else None
    return {"bytes": written, "hf_reads": lazy.hf_reads, "total_bytes": total,
            "digests": dict(strategy.writer.digests) if strategy.writer else {},
            "write_span": (first if first is not None else end, end)}

