"""The safetensors format, read and written by the package itself: validated headers, mmap reads, streamed writes.

A file is ``<u64 little-endian header length N><N bytes of JSON header><data>``; the header maps each tensor name
to ``{"dtype", "shape", "data_offsets": [begin, end]}`` relative to the data section, plus an optional
``__metadata__`` of strings. :class:`SafetensorsFile` checks everything a reader relies on before any tensor is
touched (header length within the file, JSON object without duplicate names, known dtypes, non-negative integer
shapes, offsets that match the shape and lie inside the file without overlapping) and raises
:class:`SafetensorsError` (one line naming the file and the reason) otherwise. Tensors are zero-copy views of a
private (copy-on-write) ``mmap`` of the file: reading costs page faults only, and the views may be modified without
touching the file. :class:`SafetensorsStreamWriter` writes a file tensor by tensor, the header known up front.

:func:`nbytes` is the package's one "bytes of a tensor of this shape and dtype".
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_glm5.checkpoint.checksums import HashingFile
from megatron_glm5.errors import CheckpointError

DTYPES: Dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20


class SafetensorsError(CheckpointError):
    """A safetensors file that is not well formed."""


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * dtype.itemsize


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


def _no_duplicates(path):
    def hook(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise SafetensorsError(f"{path}: header names tensor {k!r} twice")
            seen.add(k)
        return dict(pairs)
    return hook


def parse_header(path: str, fh, size: int) -> Tuple[Dict[str, TensorInfo], Dict[str, str]]:
    """Validated header of the open file ``fh`` of ``size`` bytes -> (name -> TensorInfo, __metadata__)."""
    if size < 8:
        raise SafetensorsError(f"{path}: {size} bytes, too short for a safetensors file (truncated?)")
    (n,) = struct.unpack("<Q", fh.read(8))
    if n > size - 8:
        raise SafetensorsError(f"{path}: header length {n} exceeds the file size {size} (truncated or not "
                               "safetensors)")
    if n > MAX_HEADER_BYTES:
        raise SafetensorsError(f"{path}: header length {n} is larger than {MAX_HEADER_BYTES >> 20} MiB")
    raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates(path))
    except SafetensorsError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise SafetensorsError(f"{path}: header is not valid JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise SafetensorsError(f"{path}: __metadata__ must map strings to strings")
    data_start, data_size = 8 + n, size - 8 - n
    out, spans = {}, []
    for name, e in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(e, dict):
            raise SafetensorsError(f"{where}: entry is a {type(e).__name__}, not an object")
        dt, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if not isinstance(dt, str) or dt not in DTYPES:
            raise SafetensorsError(f"{where}: unknown dtype {dt!r}")
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise SafetensorsError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise SafetensorsError(f"{where}: data_offsets {offs!r} are not [begin, end] with 0 <= begin <= end")
        want = nbytes(shape, DTYPES[dt])
        if offs[1] - offs[0] != want:
            raise SafetensorsError(f"{where}: data_offsets span {offs[1] - offs[0]} bytes, shape {shape} {dt} "
                                   f"needs {want}")
        if offs[1] > data_size:
            raise SafetensorsError(f"{where}: data ends at byte {offs[1]} but the file has {data_size} data bytes "
                                   "(truncated?)")
        out[name] = TensorInfo(name, DTYPES[dt], tuple(shape), data_start + offs[0], data_start + offs[1])
        if want:
            spans.append((offs[0], offs[1], name))
    spans.sort()
    for (b0, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise SafetensorsError(f"{path}: tensors {n0!r} and {n1!r} overlap")
    return out, meta


class SafetensorsFile:
    """One safetensors file: validated header at open, tensors as views of a private mmap.

    ``header``: the :meth:`header` of an earlier opening of the same path, reused (not parsed again) when the file
    is still the same one (device, inode, size, modification time)."""

    def __init__(self, path: str, header: Optional[tuple] = None):
        self.path = path
        try:
            fh = open(path, "rb")
        except OSError as e:
            raise SafetensorsError(f"{path}: cannot open ({e.strerror or e})") from None
        with fh:
            st = os.fstat(fh.fileno())
            size = st.st_size
            self._identity = (st.st_dev, st.st_ino, size, st.st_mtime_ns)
            if header is not None and header[0] == self._identity:
                self.tensors, self.metadata = header[1], header[2]
            else:
                self.tensors, self.metadata = parse_header(path, fh, size)
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) if size else None

    def header(self) -> tuple:
        """(file identity, tensors, metadata): reopen with ``SafetensorsFile(path, header=...)`` without parsing."""
        return self._identity, self.tensors, self.metadata

    def keys(self) -> List[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name``: a view of the file's private mapping (no copy; writes never reach the file)."""
        t = self.tensors[name]
        if t.end == t.begin:
            return torch.empty(t.shape, dtype=t.dtype)
        mm = self._mm
        if mm is None:
            raise SafetensorsError(f"{self.path}: read after close()")
        # (a private mapping is writable: torch.frombuffer does not warn; no warnings.catch_warnings, which costs
        # time under the GIL on every call and is not thread-safe)
        flat = torch.frombuffer(mm, dtype=torch.uint8, count=t.end - t.begin, offset=t.begin)
        return flat.view(t.dtype).view(t.shape)

    def close(self):
        """Stop reading; the mapping is unmapped once the last tensor viewing it is gone."""
        self._mm = None


class SafetensorsStreamWriter:
    """Writes one .safetensors file tensor by tensor: the header (all names, dtypes, shapes, offsets) is known up
    front, so each tensor goes to disk as soon as it is produced and is never held together with the others.
    The file's SHA-256 is computed while writing (``sha256``, after ``close``)."""

    def __init__(self, path: str, specs: Iterable[Tuple[str, Sequence[int], torch.dtype]], metadata=None):
        self.path = path
        self.specs = [(n, tuple(s), d) for n, s, d in specs]  # in write order
        header, offset = {}, 0
        for name, shape, dtype in self.specs:
            n = nbytes(shape, dtype)
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        header["__metadata__"] = dict(metadata or {"format": "pt"})
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self.data_bytes = offset
        self._raw = open(path, "wb")
        self._fh = HashingFile(self._raw)
        self._fh.write(struct.pack("<Q", len(raw)))
        self._fh.write(raw)
        self._next = 0
        self.sha256: Optional[str] = None

    def write(self, name: str, tensor: torch.Tensor) -> int:
        exp_name, shape, dtype = self.specs[self._next]
        if name != exp_name or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise RuntimeError(f"{self.path}: expected {exp_name} {shape} {dtype}, got {name} "
                               f"{tuple(tensor.shape)} {tensor.dtype}")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        if flat.numel():
            self._fh.write(flat.view(torch.uint8).numpy().data)
        self._next += 1
        return flat.nbytes

    def close(self):
        if self._next != len(self.specs):
            self._raw.close()
            raise RuntimeError(f"{self.path}: {len(self.specs) - self._next} tensors were not written")
        self._raw.flush()
        os.fsync(self._raw.fileno())
        self._raw.close()
        self.sha256 = self._fh.hexdigest()

    def abort(self):
        self._raw.close()
