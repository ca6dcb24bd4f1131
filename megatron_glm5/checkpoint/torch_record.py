"""One tensor in ``torch.save``'s format, written without ``torch.save``: the same bytes, far less work under the GIL.

torch DCP's FileSystemWriter stores every tensor of a ``.distcp`` file as one ``torch.save`` record: a small
uncompressed zip archive (``archive/data.pkl`` the pickled tensor, ``archive/data/0`` its bytes, a few constant
records, ``archive/.data/serialization_id``), each entry's data 64-byte aligned, sizes and CRC-32 in a data
descriptor after the data, then the central directory and the zip64 end records. ``torch.save`` into a Python file
object runs a few hundred lines of Python per tensor (pickler, zip writer object, one write callback per zip field,
a class made per call by DCP's stream wrapper) and computes the CRC inside its C++ writer. :class:`TorchRecordWriter`
writes the same archive itself:

* the bytes before the tensor data (all records up to ``archive/data/0``'s local header) depend only on the
  tensor's dtype and shape and are built once per (dtype, shape) (:meth:`TorchRecordWriter.prefix`);
* the tensor's bytes go to the file straight from its memory (one ``write`` of a memoryview to the stream: a
  buffered file passes a buffer this large to the kernel without copying it, and the GIL is released during the
  write), their CRC-32 by ``zlib.crc32`` and the file's SHA-256 by ``hashlib`` (both release the GIL on large
  buffers);
* the bytes after the data (data descriptor, last records, central directory) are a few ``struct.pack`` calls.

torch.load (and so DCP's FileSystemReader and megatron's loader) does not check the CRCs, but they are written
correctly: the output is byte-for-byte what ``torch.save`` writes, serialization id included (its first half hashes
the record names, constant for a one-tensor archive; the second combines the records' CRCs with c10's
``hash_combine``). The record names, constant records and the name hash are taken from a ``torch.save`` of a small
probe tensor; before a dtype is written the first time, a probe of that dtype written both ways must give equal
bytes, else :meth:`TorchRecordWriter.supports` says no and the caller uses ``torch.save`` (so another torch version
with another layout is never written wrongly). Tensors of 4 GiB and more (zip64 entries) are left to ``torch.save``.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import threading
import warnings
import zipfile
import zlib
from typing import Dict, List, Optional, Tuple

import torch

_ALIGN = 64  # torch.save's data alignment (checked against the probe's .storage_alignment record)
_MAX_DATA = 0xFFFFFFFF - (1 << 20)  # records this large need zip64 fields: left to torch.save
_MAX_CACHED_PREFIXES = 4096  # (dtype, shape) record prefixes kept; the cache starts over past this many
_MASK64 = (1 << 64) - 1
_LFH = struct.Struct("<IHHHHHIIIHH")        # local file header (crc and sizes zero: a data descriptor follows)
_DD = struct.Struct("<IIII")                # data descriptor: signature, crc, compressed size, size
_CDH = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header
_FLAGS = 0x0808                             # data descriptor + UTF-8 names (what torch's miniz writer sets)


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64-bit size_t."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _MASK64) + (seed >> 2)) & _MASK64)) & _MASK64


def _local_header(name: bytes, offset: int) -> bytes:
    """Local file header of the entry starting at ``offset``, padded (extra field ``FB``) so its data starts on a
    64-byte boundary."""
    pad = -(offset + _LFH.size + len(name) + 4) % _ALIGN
    return (_LFH.pack(0x04034B50, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(name), pad + 4) + name
            + b"FB" + struct.pack("<H", pad) + b"Z" * pad)


class _StorageStub:
    """Stands for the tensor's storage in the pickle (torch pickles storages by persistent id)."""

    __slots__ = ("pid",)

    def __init__(self, pid: tuple):
        self.pid = pid


class _TensorStub:
    """Pickles like a contiguous CPU tensor of torch.save (``torch._utils._rebuild_tensor_v2`` with its storage,
    offset 0, size, stride, ``requires_grad=False`` and no backward hooks) without a tensor."""

    __slots__ = ("storage", "shape", "stride")

    def __init__(self, storage: _StorageStub, shape: Tuple[int, ...], stride: Tuple[int, ...]):
        self.storage, self.shape, self.stride = storage, shape, stride

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, self.shape, self.stride, False, collections.OrderedDict()))


def _contiguous_stride(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _storage_type(dtype: torch.dtype):
    """torch's legacy storage class for ``dtype`` (what torch.save pickles), or None where torch has none."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated (torch.save still pickles its class)
        try:
            return getattr(torch, torch.TypedStorage(0, dtype=dtype).pickle_storage_type())
        except (RuntimeError, AttributeError, KeyError):
            return None


class _Layout:
    """What a one-tensor ``torch.save`` archive holds besides the tensor, read off a probe archive."""

    def __init__(self):
        buf = io.BytesIO()
        torch.save(torch.zeros(2, 3), buf)
        raw = buf.getvalue()
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            infos = sorted(z.infolist(), key=lambda i: i.header_offset)
            self.records: List[Tuple[bytes, Optional[bytes]]] = []  # (name, constant content or None)
            prefix = infos[0].filename.split("/")[0] + "/"
            for i in infos:
                rel = i.filename[len(prefix):]
                variable = rel in ("data.pkl", "data/0", ".data/serialization_id")
                self.records.append((i.filename.encode(), None if variable else z.read(i.filename)))
            sid = z.read(prefix + ".data/serialization_id")
        self.names = [n for n, _ in self.records]
        rels = [n.decode()[len(prefix):] for n in self.names]
        want_tail = ["data/0", ".data/serialization_id"]
        if (rels[0] != "data.pkl" or "data/0" not in rels or rels[-1] != want_tail[1]
                or dict(self.records).get((prefix + ".storage_alignment").encode(), str(_ALIGN).encode())
                != str(_ALIGN).encode() or len(sid) != 40):
            raise ValueError("unexpected torch.save layout")
        self.data_index = rels.index("data/0")
        self.name_hash = sid[:20]  # hash of the record names: the same for every one-tensor archive
        self.crcs = {n: zlib.crc32(c) for n, c in self.records if c is not None}


class TorchRecordWriter:
    """Writes tensors as ``torch.save`` records to a file descriptor (see the module docstring). One instance per
    process (the prefix cache and dtype checks are shared, thread-safe); :meth:`write` is called by many threads,
    each on its own file."""

    def __init__(self):
        self._lock = threading.Lock()
        self._layout: Optional[_Layout] = None
        self._layout_error = False
        self._dtype_ok: Dict[torch.dtype, bool] = {}
        self._prefixes: Dict[Tuple[torch.dtype, Tuple[int, ...]], Tuple[bytes, int, list]] = {}

    # ---- what it can write
    def supports(self, t: torch.Tensor) -> bool:
        """Whether :meth:`write` writes ``t`` exactly as torch.save would (a contiguous CPU tensor owning its whole
        storage from offset 0, not empty, under 4 GiB, of a dtype whose probe matched torch.save byte for byte)."""
        if (t.device.type != "cpu" or not t.is_contiguous() or t.storage_offset() != 0 or not 0 < t.nbytes <= _MAX_DATA):
            return False  # (torch.save writes an empty tensor without its data record)
        if t.untyped_storage().nbytes() != t.nbytes or t.requires_grad or type(t) is not torch.Tensor:
            return False
        ok = self._dtype_ok.get(t.dtype)
        if ok is None:
            ok = self._check_dtype(t.dtype)
        return ok

    def _layout_or_none(self) -> Optional[_Layout]:
        with self._lock:
            if self._layout is None and not self._layout_error:
                try:
                    self._layout = _Layout()
                except Exception:  # noqa: BLE001 - an unknown layout: torch.save writes everything
                    self._layout_error = True
            return self._layout

    def _check_dtype(self, dtype: torch.dtype) -> bool:
        ok = False
        if self._layout_or_none() is not None and _storage_type(dtype) is not None:
            try:
                probe = (torch.arange(15, dtype=torch.float32) - 7).reshape(3, 5).to(dtype)
                want = io.BytesIO()
                torch.save(probe, want)
                got = io.BytesIO()
                self.write(got, probe)
                ok = got.getvalue() == want.getvalue()
            except Exception:  # noqa: BLE001 - any failure means: leave this dtype to torch.save
                ok = False
        with self._lock:
            self._dtype_ok[dtype] = ok
        return ok

    # ---- the bytes
    def _pickle(self, dtype: torch.dtype, shape: Tuple[int, ...]) -> bytes:
        pid = ("storage", _storage_type(dtype), "0", "cpu", int(torch.Size(shape).numel()))
        buf = io.BytesIO()
        p = pickle.Pickler(buf, protocol=2)  # torch.save's default protocol
        p.persistent_id = lambda obj: obj.pid if isinstance(obj, _StorageStub) else None
        p.dump(_TensorStub(_StorageStub(pid), tuple(shape), _contiguous_stride(tuple(shape))))
        return buf.getvalue()

    def prefix(self, dtype: torch.dtype, shape: Tuple[int, ...]) -> Tuple[bytes, int, list]:
        """(bytes up to the tensor data, combined CRC of the records before it, central directory entries so
        far as (name, crc, size, offset)) for a tensor of ``dtype`` and ``shape``; cached."""
        key = (dtype, tuple(shape))
        hit = self._prefixes.get(key)
        if hit is not None:
            return hit
        lay = self._layout
        if lay is None:
            raise RuntimeError("TorchRecordWriter: write only tensors that supports() accepted")
        pkl = self._pickle(dtype, tuple(shape))
        parts, entries, pos, combined = [], [], 0, 0
        for name, content in lay.records[:lay.data_index]:
            data = pkl if content is None else content
            crc = zlib.crc32(data) if content is None else lay.crcs[name]
            hdr = _local_header(name, pos)
            parts += [hdr, data, _DD.pack(0x08074B50, crc, len(data), len(data))]
            entries.append((name, crc, len(data), pos))
            pos += len(hdr) + len(data) + _DD.size
            combined = _hash_combine(combined, crc)
        data_name = lay.records[lay.data_index][0]
        parts.append(_local_header(data_name, pos))
        entries.append((data_name, None, None, pos))
        out = (b"".join(parts), combined, entries)
        with self._lock:
            if len(self._prefixes) > _MAX_CACHED_PREFIXES:
                self._prefixes.clear()
            self._prefixes[key] = out
        return out

    def _suffix(self, prefix_len: int, combined: int, entries: list, crc: int, size: int) -> bytes:
        """Everything after the tensor data: its data descriptor, the records after it (serialization id last),
        the central directory, the zip64 end record and locator, the end record."""
        lay = self._layout
        entries = list(entries)
        name, _, _, off = entries[-1]
        entries[-1] = (name, crc, size, off)
        combined = _hash_combine(combined, crc)
        parts = [_DD.pack(0x08074B50, crc, size, size)]
        pos = prefix_len + size + _DD.size
        for name, content in lay.records[lay.data_index + 1:]:
            if content is None:  # the serialization id: name hash + the records' combined CRC
                content = lay.name_hash + b"%020d" % combined
                c = zlib.crc32(content)
            else:
                c = lay.crcs[name]
                combined = _hash_combine(combined, c)
            hdr = _local_header(name, pos)
            parts += [hdr, content, _DD.pack(0x08074B50, c, len(content), len(content))]
            entries.append((name, c, len(content), pos))
            pos += len(hdr) + len(content) + _DD.size
        cd_start = pos
        for name, c, n, off in entries:
            parts += [_CDH.pack(0x02014B50, 0, 0, _FLAGS, 0, 0, 0, c, n, n, len(name), 0, 0, 0, 0, 0, off), name]
            pos += _CDH.size + len(name)
        cd_size, k = pos - cd_start, len(entries)
        parts.append(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x2D, 0, 0, k, k, cd_size, cd_start))
        parts.append(struct.pack("<IIQI", 0x07064B50, 0, pos, 1))
        parts.append(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, k, k, cd_size, cd_start, 0))
        return b"".join(parts)

    def write(self, stream, t: torch.Tensor) -> int:
        """Write ``t`` (for which :meth:`supports` is true) to ``stream`` (a binary file object that writes all it
        is given, e.g. a :class:`~megatron_glm5.checkpoint.checksums.HashingFile` over a buffered file: the tensor
        bytes, larger than its buffer, go from the tensor's memory to the kernel) as one torch.save archive.
        Returns the archive's length."""
        head, combined, entries = self.prefix(t.dtype, tuple(t.shape))
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        crc = zlib.crc32(data)  # (releases the GIL on large buffers, as hashlib and file writes do)
        tail = self._suffix(len(head), combined, entries, crc, len(data))
        stream.write(head)
        stream.write(data)
        stream.write(tail)
        return len(head) + len(data) + len(tail)
