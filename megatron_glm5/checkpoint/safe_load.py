"""Reading checkpoint files without running code taken from them.

torch's distributed checkpoint (DCP, megatron-core's ``torch_dist`` format) stores its global index as a pickle
(``.metadata``); ``pickle.load`` of a crafted file runs arbitrary code. :func:`load_dcp_metadata` unpickles it with
an unpickler that admits only the classes DCP metadata is made of (the ``torch.distributed.checkpoint`` metadata
and planner dataclasses, ``torch.Size``, dtypes, layouts, memory formats, ``pathlib`` paths) and refuses anything
else with one line, then checks that every storage file the index names is a plain file name inside the
checkpoint directory. Tensor files are read with ``torch.load(weights_only=True)`` (:func:`torch_load_weights_only`).
A DCP checkpoint's byte items (megatron-core's ``ShardedObject``s: the common state with ``args``, optimizer and
scheduler state, the RNG state, every layer's ``_extra_state``) are ``torch.save`` bytes, which torch DCP's
``DefaultLoadPlanner.load_bytes`` loads with ``weights_only=False``; :func:`load_byte_item` loads them through
torch's weights-only unpickler instead (tensors, containers, and the classes megatron-core registers as safe in
``megatron.core.safe_globals``: ``argparse.Namespace``, numpy arrays, its enums and ``RerunState``).

:func:`install_dcp_read_guards` makes every torch DCP read in the process go through these (megatron-core's
``torch_dist`` load, its cached-metadata reader, the legacy ``common.pt``): ``FileSystemReader.read_metadata``
unpickles the bytes it read once with the restricted unpickler, and ``DefaultLoadPlanner.load_bytes`` (which
megatron-core's ``MCoreLoadPlanner`` inherits) parses the bytes the reader handed it; nothing is opened twice.

    md = load_dcp_metadata(ckpt_dir)              # raises UnsafeCheckpointError / CheckpointError, one line
    reader = SafeFileSystemReader(ckpt_dir)       # a torch DCP FileSystemReader reading .metadata this way
    install_dcp_read_guards()                     # every DCP read of this process, megatron-core's included
"""

from __future__ import annotations

import io
import os
import pickle
import re
from typing import Optional

import torch
from torch.distributed.checkpoint import FileSystemReader

from megatron_glm5.errors import CheckpointError, one_line

DCP_METADATA_FILE = ".metadata"
_MAX_METADATA_BYTES = 1 << 30

# (module, name) of every class a torch DCP / megatron-core torch_dist .metadata pickle refers to
_DCP = "torch.distributed.checkpoint"
ALLOWED_GLOBALS = frozenset({
    (f"{_DCP}.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    (f"{_DCP}.planner", n) for n in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem", "LoadItemType",
        "BytesIOWriteData")
} | {
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
})


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that asks to load something other than plain checkpoint metadata."""


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, fh, path: str):
        super().__init__(fh)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch":  # dtypes (torch.bfloat16), layouts (torch.strided), memory formats
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise UnsafeCheckpointError(f"{self.path}: refused to load {module}.{name} (not a class of torch "
                                    "distributed-checkpoint metadata; the file may be crafted to run code)")

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"{self.path}: persistent ids are not allowed in checkpoint metadata")


def restricted_unpickle(data: bytes, path: str):
    """Unpickle ``data`` admitting only :data:`ALLOWED_GLOBALS` (plus torch dtypes, layouts, memory formats)."""
    return _RestrictedUnpickler(io.BytesIO(data), path).load()


def load_dcp_metadata(path: str):
    """The ``torch.distributed.checkpoint.metadata.Metadata`` of a DCP / torch_dist checkpoint, read safely.

    ``path``: the checkpoint directory or its ``.metadata`` file. Raises :class:`UnsafeCheckpointError` for a class
    outside the allow-list and :class:`CheckpointError` for an unreadable or malformed file or a storage file name
    that is not a plain name inside the directory (``../x``, ``/abs``, a symlink out). Both are one line."""
    from torch.distributed.checkpoint.metadata import Metadata

    mpath = os.path.join(path, DCP_METADATA_FILE) if os.path.isdir(path) else path
    ckpt_dir = os.path.dirname(os.path.abspath(mpath))
    try:
        with open(mpath, "rb") as fh:
            data = fh.read(_MAX_METADATA_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"{mpath}: cannot read ({one_line(e)})") from None
    if len(data) > _MAX_METADATA_BYTES:
        raise CheckpointError(f"{mpath}: larger than {_MAX_METADATA_BYTES >> 20} MiB; not DCP metadata")
    try:
        md = restricted_unpickle(data, mpath)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated / random bytes: any unpickling failure is a broken file
        raise CheckpointError(f"{mpath}: not readable torch distributed-checkpoint metadata "
                              f"({type(e).__name__}: {one_line(e, 200)})") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise CheckpointError(f"{mpath}: not torch distributed-checkpoint metadata (holds {type(md).__name__})")
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str):
            raise CheckpointError(f"{mpath}: a storage entry has no file name")
        check_inside(ckpt_dir, rel, mpath)
    return md


def check_storage_extents(md, ckpt_dir: str) -> None:
    """Every item the DCP metadata ``md`` places in a storage file of ``ckpt_dir`` lies within that file: a
    truncated ``.distcp`` is one CheckpointError line naming it (torch would fail mid-load with a bare EOFError)."""
    ends = {}
    for info in (md.storage_data or {}).values():
        end = int(getattr(info, "offset", 0) or 0) + int(getattr(info, "length", 0) or 0)
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), end)
    for rel, end in sorted(ends.items()):
        path = os.path.join(ckpt_dir, rel)
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise CheckpointError(f"{path}: named by {os.path.join(ckpt_dir, DCP_METADATA_FILE)} but unreadable "
                                  f"({e.strerror or e})") from None
        if size < end:
            raise CheckpointError(f"{path}: truncated ({size} bytes; the checkpoint's items reach byte {end})")


def check_inside(root: str, rel: str, source: str, also_inside: Optional[str] = None) -> str:
    """The real path of ``rel`` if it is a relative path that stays inside ``root`` (symlinks resolved; a link may
    also point into ``also_inside``); otherwise CheckpointError naming ``source`` (the file that named ``rel``)."""
    if not rel or os.path.isabs(rel) or "\x00" in rel:
        raise CheckpointError(f"{source}: refers to {rel!r}, not a relative path inside {root}")
    parts = rel.replace("\\", "/").split("/")
    if ".." in parts:
        raise CheckpointError(f"{source}: refers to {rel!r}, outside {root}")
    real = os.path.realpath(os.path.join(root, rel))
    for allowed in (root, also_inside):
        if allowed is not None:
            real_allowed = os.path.realpath(allowed)
            if os.path.commonpath([real_allowed, real]) == real_allowed:
                return real
    raise CheckpointError(f"{source}: {rel!r} resolves to {real}, outside {root}")


def hub_blobs_dir(ckpt_dir: str) -> Optional[str]:
    """For a Hugging Face hub cache snapshot (``.../models--org--name/snapshots/<rev>``), the repository's
    ``blobs`` folder its files link into; else None."""
    d = os.path.abspath(ckpt_dir)
    if os.path.basename(os.path.dirname(d)) == "snapshots":
        blobs = os.path.join(os.path.dirname(os.path.dirname(d)), "blobs")
        return blobs if os.path.isdir(blobs) else None
    return None


def torch_load_weights_only(path: str, what: Optional[str] = None):
    """``torch.load(path, weights_only=True)`` on the CPU; any failure is one CheckpointError line."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling errors of every kind mean an unusable file
        raise CheckpointError(f"{what or path}: cannot load ({type(e).__name__}: {one_line(e, 300)})") from None


class SafeFileSystemReader(FileSystemReader):
    """torch DCP's FileSystemReader, reading the global ``.metadata`` once through :func:`load_dcp_metadata`
    (torch_dist checkpoints have no per-rank metadata files). Tensor data is read by torch with
    ``weights_only=True``."""

    _md = None

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:
            raise FileNotFoundError("torch_dist checkpoints have no per-rank metadata")
        if self._md is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            md = load_dcp_metadata(str(self.path))
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            self._md = md
        return self._md


def check_dist_checkpoint(path: str):
    """Vet a torch_dist checkpoint directory before megatron-core's ``dist_checkpointing.load`` reads it: its
    manifest (``checksums.sha256`` / ``integrity.json``) matches when there is one, and ``.metadata`` holds only DCP
    metadata classes with storage files inside the directory. Returns the Metadata; raises one CheckpointError line
    otherwise. (megatron-core's own reads unpickle safely once :func:`install_dcp_read_guards` ran.)"""
    from megatron_glm5.checkpoint.checksums import verify_manifest

    verify_manifest(path)
    return load_dcp_metadata(path)


_WO_GLOBAL = re.compile(r"(?:GLOBAL|global) ([\w.]+)")


def load_byte_item(data: io.BytesIO, source: str):
    """A torch DCP byte item (``torch.save`` bytes of a megatron-core ``ShardedObject``) loaded with
    ``torch.load(weights_only=True)``: tensors, containers and the globals torch and megatron-core allow
    (``torch.serialization.add_safe_globals``). A pickle that names anything else raises
    :class:`UnsafeCheckpointError`, unreadable bytes :class:`CheckpointError` (one line naming ``source``)."""
    try:
        return torch.load(data, weights_only=True)
    except pickle.UnpicklingError as e:
        found = _WO_GLOBAL.search(str(e))
        what = found.group(1) if found else one_line(e, 200)
        raise UnsafeCheckpointError(f"{source}: refused to load {what} (not a tensor or a class of megatron-core's "
                                    "checkpoint state; the file may be crafted to run code)") from None
    except Exception as e:  # noqa: BLE001 - truncated / random bytes: any failure is a broken item
        raise CheckpointError(f"{source}: unreadable checkpoint item ({type(e).__name__}: {one_line(e, 200)})") from None


def _item_source(metadata, read_item) -> str:
    """'DIR/FILE (item FQN)' for a DCP read item, as far as the metadata tells."""
    info = (getattr(metadata, "storage_data", None) or {}).get(read_item.storage_index)
    where = getattr(metadata, "_glm5_dir", None)
    name = getattr(info, "relative_path", "?")
    path = os.path.join(where, name) if where else name
    return f"{path} (item {read_item.dest_index.fqn})"


def install_dcp_read_guards() -> bool:
    """Make torch DCP's ``FileSystemReader.read_metadata`` use :func:`load_dcp_metadata` (one read, restricted
    unpickler, storage files inside the checkpoint), ``DefaultLoadPlanner.load_bytes`` use :func:`load_byte_item`,
    and megatron-core's legacy ``common.pt`` reader ``weights_only=True``. Idempotent; returns whether it installed
    them now."""
    from torch.distributed.checkpoint import default_planner

    from megatron_glm5 import extensions

    record = extensions.BY_NAME["dcp_read_guards"]
    read_target, bytes_target, common_target = record.targets
    upstream_read, upstream_bytes = extensions.current(record, read_target), extensions.current(record, bytes_target)

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = str(self._get_metadata_path(kwargs.get("rank")))
        md = load_dcp_metadata(path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        md._glm5_dir = os.path.dirname(os.path.abspath(path))
        return md

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = load_byte_item(value, _item_source(self.metadata, read_item))
        if self.flatten_state_dict:
            default_planner.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

    read_metadata.upstream = upstream_read  # torch's (tests show what they would run)
    load_bytes.upstream = upstream_bytes
    now = extensions.apply(record, read_metadata, read_target)
    extensions.apply(record, load_bytes, bytes_target)
    try:
        from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
    except ImportError:  # the converters' lean import: no megatron-core checkpoint loading here
        return now

    def load_common(checkpoint_dir: str):
        return torch_load_weights_only(os.path.join(checkpoint_dir, COMMON_STATE_FNAME))

    extensions.apply(record, load_common, common_target)
    return now
