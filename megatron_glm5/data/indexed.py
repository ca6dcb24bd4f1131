"""Checks of a megatron-core indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``) before megatron reads it.

megatron-core's ``IndexedDataset`` trusts the ``.idx``: a cut or flipped file, another dtype code in the header or
pointers past the end of the ``.bin`` give a traceback at some later read, or rows of garbage. The ``.idx`` layout
(``IndexedDatasetBuilder.finalize``, little-endian)::

    b"MMIDIDX\\x00\\x00"  version u64 (1)  dtype code u8  S = sequence count u64  D = document count u64
    sequence_lengths int32[S]  sequence_pointers int64[S]  document_indices int64[D]

:func:`check_indexed_dataset` reads the header and the three arrays (O(S + D), never the ``.bin``) and refuses,
in one line naming the file, anything but what the builder writes: the exact file size for S and D, a known dtype
code, lengths >= 0, pointers that start at 0 and step by ``length x itemsize`` (so a dtype code other than the
one the ``.bin`` was written with is caught) and end exactly at the ``.bin``'s size, document indices running
from 0 to S, at least one token.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from megatron_glm5.data import DataError

INDEX_HEADER = b"MMIDIDX\x00\x00"
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
           8: np.uint16}  # megatron-core's DType codes
_TOKEN_DTYPES = (1, 3, 4, 5, 8)  # integer token ids (int8 cannot hold a vocabulary)


def check_indexed_dataset(prefix: str) -> int:
    """Check ``prefix.idx`` against itself and ``prefix.bin``; returns the number of sequences. Raises
    :class:`DataError` (one line naming the file) for a missing, truncated, corrupt or mismatched pair."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for path in (bin_, idx):
        if not os.path.isfile(path):
            raise DataError(f"--data-path: {path} not found (write it with tools/preprocess_data.py)")
    rerun = "re-run tools/preprocess_data.py"
    try:
        idx_size, bin_size = os.path.getsize(idx), os.path.getsize(bin_)
        with open(idx, "rb") as f:
            head = f.read(_HEADER_BYTES)
        if len(head) < _HEADER_BYTES:
            raise DataError(f"{idx}: truncated index ({idx_size} bytes, shorter than its header); {rerun}")
        if head[:9] != INDEX_HEADER:
            raise DataError(f"{idx}: not a megatron indexed-dataset index (bad magic bytes)")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
        if version != 1:
            raise DataError(f"{idx}: index version {version}, expected 1")
        if code not in _TOKEN_DTYPES:
            raise DataError(f"{idx}: token dtype code {code} is not an integer token type "
                            f"({', '.join(f'{c}={np.dtype(_DTYPES[c]).name}' for c in _TOKEN_DTYPES)})")
        expected = _HEADER_BYTES + 12 * n_seq + 8 * n_doc
        if n_doc < 1 or expected != idx_size:
            raise DataError(f"{idx}: {idx_size} bytes, but its header announces {n_seq} sequences and "
                            f"{n_doc} document boundaries ({expected} bytes): truncated or corrupt; {rerun}")
        if n_seq == 0 or bin_size == 0:
            raise DataError(f"{idx}: the dataset holds no tokens ({n_seq} sequences, {bin_size}-byte {bin_})")
        mm = np.memmap(idx, mode="r", dtype=np.uint8)
        try:
            off = _HEADER_BYTES
            lengths = np.frombuffer(mm, dtype="<i4", count=n_seq, offset=off)
            pointers = np.frombuffer(mm, dtype="<i8", count=n_seq, offset=off + 4 * n_seq)
            docs = np.frombuffer(mm, dtype="<i8", count=n_doc, offset=off + 12 * n_seq)
            itemsize = np.dtype(_DTYPES[code]).itemsize
            why = None
            if lengths.min() < 0:
                why = "a negative sequence length"
            elif pointers[0] != 0 or pointers.min() < 0 or pointers.max() > bin_size:
                why = f"sequence pointers outside the {bin_size}-byte {bin_}"
            elif not np.array_equal(np.diff(pointers), lengths[:-1].astype(np.int64) * itemsize):
                why = (f"sequence pointers that do not step by length x {itemsize} bytes (the "
                       f"{np.dtype(_DTYPES[code]).name} of its header): another dtype or a corrupt index")
            elif int(pointers[-1]) + int(lengths[-1]) * itemsize != bin_size:
                end = int(pointers[-1]) + int(lengths[-1]) * itemsize
                why = f"sequences that end at byte {end}, but {bin_} has {bin_size} bytes (truncated or mismatched)"
            elif docs[0] != 0 or docs[-1] != n_seq or (np.diff(docs) < 0).any():
                why = "document boundaries that do not run from 0 to the sequence count"
        finally:
            del mm
    except OSError as e:
        raise DataError(f"--data-path: {prefix}: unreadable ({e.strerror or e})") from None
    if why:
        raise DataError(f"{idx}: {why}; {rerun}")
    return int(n_seq)
