"""megatron-core's dataset index caches, read without pickle, checked against what they were built from, and
written so that a killed build leaves nothing a later run accepts.

megatron-core's ``GPTDataset`` caches its ``document_index`` / ``sample_index`` / ``shuffle_index`` and
``BlendedDataset`` its ``dataset_index`` / ``dataset_sample_index`` as ``.npy`` files named
``<md5 of the description>-<class>-<split>-<name>.npy`` beside a ``...-description.txt`` (in ``--data-cache-path``,
or ``PREFIX/cache/GPTDataset_indices/`` next to the data). Upstream loads them with ``allow_pickle=True`` as soon as
the four files exist, trusting their names: a crafted ``.npy`` runs code, a truncated one is a traceback, and a
cache built from an earlier version of the data (same path, same flags) is used for the new data.

:func:`cached_indices` (installed over both classes' index builders by :mod:`megatron_glm5.mcore_fixes`):

* **Read**: every array with ``numpy.load(allow_pickle=False, mmap_mode="r")``; an array holding Python objects is
  refused in one line (:class:`~megatron_glm5.data.DataError`) and left in place.
* **Checked**: the description must be the dataset's own, a ``...-source.json`` written beside the arrays must name
  the same source (``GPTDataset``: the ``.idx`` file's SHA-256 and the ``.bin`` size; ``BlendedDataset``: the
  sizes of the blended datasets), and the arrays must fit the dataset (dtype, shape, index ranges; O(length)).
* **Rebuilt** on rank 0 when the cache is incomplete, truncated, stale or from a build without a source record,
  with one notice line naming the file and the reason; other ranks (which read after rank 0 built) refuse a cache
  that does not check out in one line.
* **Written atomically**: megatron-core's builder writes into ``.<base>.tmp-<pid>-*`` inside the cache folder; the
  arrays, then the source record, then the description (the file whose presence makes a cache) are renamed into
  place. A build killed at any point leaves a temporary folder (removed by the next build once its process is
  gone) or an incomplete set, which is rebuilt.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import os
import shutil
import tempfile
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from megatron_glm5.data import DataError

_DESCRIPTION_LIMIT = 16 << 20  # bytes of a description file worth reading


def _rank() -> int:
    import torch

    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _notice(msg: str) -> None:
    print(f"notice: {msg}", flush=True)


@functools.lru_cache(maxsize=64)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def file_sha256(path: str) -> str:
    """SHA-256 of ``path`` (memoised per size and modification time)."""
    st = os.stat(path)
    return _sha256(os.path.abspath(path), st.st_size, st.st_mtime_ns)


def load_index_array(path: str) -> np.ndarray:
    """A cached index array, memory-mapped, never unpickled. :class:`DataError` (one line naming ``path``) when it
    holds Python objects; other load failures raise ``ValueError`` / ``OSError`` (a damaged file)."""
    with open(path, "rb") as f:  # the header is a Python literal (numpy parses it without eval)
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        dtype = read_header(f)[2]
    if dtype.hasobject:
        raise DataError(f"{path}: this dataset index cache holds pickled Python objects, not a numeric index; "
                        f"refusing to load it (delete it to have it rebuilt)")
    return np.load(path, allow_pickle=False, mmap_mode="r")


def _stale_temporaries(cache_dir: str, base: str) -> None:
    """Remove the temporary folders of builds of ``base`` whose process is gone."""
    for p in glob.glob(os.path.join(cache_dir, f".{glob.escape(base)}.tmp-*")):
        pid = os.path.basename(p)[len(base) + 6:].split("-", 1)[0]
        if pid.isdigit():
            try:
                os.kill(int(pid), 0)
                continue  # a live build
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        shutil.rmtree(p, ignore_errors=True)


def _read_cache(paths: Dict[str, str], description: str, source: dict, names: Sequence[str],
                check: Callable[[Tuple[np.ndarray, ...]], Optional[str]]):
    """(arrays, None) for a cache that checks out, else (None, why not). Raises DataError for pickled arrays."""
    if not all(os.path.isfile(paths[n]) for n in ("description", *names)):
        return None, "incomplete"
    try:
        if os.path.getsize(paths["description"]) > _DESCRIPTION_LIMIT:
            return None, f"{paths['description']} is not its description"
        with open(paths["description"], "r", encoding="utf-8") as f:
            if f.read() != description:
                return None, f"{paths['description']} is not this dataset's description"
        try:
            with open(paths["source"], "r", encoding="utf-8") as f:
                recorded = json.load(f)
        except FileNotFoundError:
            return None, "built without a record of its source data"
        if recorded != source:
            return None, "built from other data (the data files changed since)"
        arrays = tuple(load_index_array(paths[n]) for n in names)
    except DataError:
        raise
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:  # truncated / damaged files
        return None, f"unreadable ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    try:
        why = check(arrays)
    except (IndexError, ValueError, TypeError, OSError) as e:  # arrays of shapes the checks did not foresee
        why = f"unusable ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    return (None, why) if why else (arrays, None)


def cached_indices(owner, upstream: Callable, cache_dir: str, base: str, names: Sequence[str], source: dict,
                   check: Callable[[Tuple[np.ndarray, ...]], Optional[str]]) -> Tuple[np.ndarray, ...]:
    """The index arrays ``names`` of ``owner`` (a megatron ``GPTDataset`` / ``BlendedDataset``) from the cache in
    ``cache_dir`` (file names ``base-NAME.npy``), or built by ``upstream(owner)`` and cached (see the module
    docstring). ``source``: what the arrays were built from (JSON-able); ``check(arrays)``: None if they fit the
    dataset, else the reason."""
    paths = {n: os.path.join(cache_dir, f"{base}-{n}.npy") for n in names}
    paths["description"] = os.path.join(cache_dir, f"{base}-description.txt")
    paths["source"] = os.path.join(cache_dir, f"{base}-source.json")
    arrays, why = _read_cache(paths, owner.unique_description, source, names, check)
    if arrays is not None:
        return arrays
    if _rank() != 0:
        e = DataError(f"{paths['description']}: the dataset index cache rank 0 built is {why} on rank {_rank()} "
                      f"(is --data-cache-path on a file system every rank shares?)")
        e.rank_local = True  # only this rank sees it: it prints the line
        raise e
    if why != "incomplete":
        _notice(f"{paths['description']}: dataset index cache {why}: rebuilding it")
    try:
        return _build(owner, upstream, cache_dir, base, names, source, paths)
    except OSError as e:  # a read-only or full cache folder
        raise DataError(f"{cache_dir}: cannot write the dataset index cache ({e.strerror or e}); give a writable "
                        f"--data-cache-path") from None


def _build(owner, upstream, cache_dir, base, names, source, paths) -> Tuple[np.ndarray, ...]:
    os.makedirs(cache_dir, exist_ok=True)
    _stale_temporaries(cache_dir, base)
    tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-{os.getpid()}-", dir=cache_dir)
    saved = owner.config.path_to_cache
    try:
        owner.config.path_to_cache = tmp  # upstream builds and writes its files there
        try:
            built = tuple(upstream(owner))
        finally:
            owner.config.path_to_cache = saved
        with open(os.path.join(tmp, os.path.basename(paths["source"])), "w", encoding="utf-8") as f:
            json.dump(source, f)
        for key in (*names, "source", "description"):  # the description last: its presence makes a cache
            src = os.path.join(tmp, os.path.basename(paths[key]))
            with open(src, "rb") as f:
                os.fsync(f.fileno())
            os.replace(src, paths[key])
        from megatron_glm5.checkpoint.atomic import fsync_dir

        fsync_dir(cache_dir)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
    return built


# ------------------------------------------------------------------------------------------- the two datasets
def _int_array(a: np.ndarray, ndim: int, name: str) -> Optional[str]:
    if a.ndim != ndim or not np.issubdtype(a.dtype, np.integer):
        return f"{name} is a {a.dtype} array of shape {a.shape}, not an integer index"
    return None


def gpt_check(ds) -> Callable:
    """The fit of a ``GPTDataset``'s (document, sample, shuffle) index to the dataset ``ds``."""
    def check(arrays) -> Optional[str]:
        doc, sample, shuffle = arrays
        for a, name, nd in ((doc, "document_index", 1), (sample, "sample_index", 2), (shuffle, "shuffle_index", 1)):
            why = _int_array(a, nd, name)
            if why:
                return why
        n_docs = len(ds.indices)
        epochs = ds._get_num_epochs(ds._get_num_tokens_per_epoch())
        if len(doc) != epochs * n_docs:
            return f"document_index has {len(doc)} entries, not {epochs} epoch(s) x {n_docs} documents"
        d = np.asarray(doc)
        if len(d) and (d.min() < 0 or d.max() >= len(ds.dataset)):
            return "document_index names documents outside the dataset"
        expected = np.zeros(len(ds.dataset), dtype=np.int64)
        expected[ds.indices] = epochs
        if len(d) and not np.array_equal(np.bincount(d, minlength=len(ds.dataset)), expected):
            return "document_index does not hold this split's documents"
        if sample.shape[0] < 2 or sample.shape[1] != 2:
            return f"sample_index has shape {sample.shape}"
        pos, off = np.asarray(sample[:, 0]), np.asarray(sample[:, 1])
        if pos.min() < 0 or pos.max() >= len(doc) or (np.diff(pos) < 0).any():
            return "sample_index points outside the document index"
        lengths = ds.dataset.sequence_lengths[np.asarray(doc)[pos]]
        if off.min() < 0 or (off > lengths).any():
            return "sample_index offsets lie outside their documents"
        n = sample.shape[0] - 1
        if ds.num_samples is not None and n < ds.num_samples:
            return f"sample_index has {n} samples, fewer than the {ds.num_samples} asked for"
        if len(shuffle) != n or (n and (shuffle.min() < 0 or shuffle.max() >= n)):
            return "shuffle_index does not fit the sample index"
        return None
    return check


def blended_check(ds) -> Callable:
    """The fit of a ``BlendedDataset``'s (dataset, dataset sample) index to ``ds``."""
    def check(arrays) -> Optional[str]:
        which, sample = arrays
        for a, name in ((which, "dataset_index"), (sample, "dataset_sample_index")):
            why = _int_array(a, 1, name)
            if why:
                return why
        size = ds.size if ds.size is not None else sum(ds.weights)
        if len(which) != size or len(sample) != size:
            return f"the indices have {len(which)} / {len(sample)} entries, not {size}"
        which, sample = np.asarray(which), np.asarray(sample)
        if size and (which.min() < 0 or which.max() >= len(ds.datasets)):
            return "dataset_index names datasets outside the blend"
        for i, d in enumerate(ds.datasets):
            s = sample[which == i]
            if len(s) and (s.min() < 0 or s.max() >= len(d)):
                return f"dataset_sample_index points past the {len(d)} samples of dataset {i}"
        return None
    return check


def gpt_indices(self, upstream: Callable):
    """``GPTDataset._build_document_sample_shuffle_indices`` (``upstream``) through :func:`cached_indices`."""
    cfg = self.config
    if cfg.defer_npy_index_mmap or cfg.fast_cache_load or cfg.mock:
        return upstream(self)
    cache_dir = cfg.path_to_cache or os.path.join(self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices")
    prefix = self.dataset.path_prefix
    source = {"idx_sha256": file_sha256(prefix + ".idx"), "bin_bytes": os.path.getsize(prefix + ".bin")}
    base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
    return cached_indices(self, upstream, cache_dir, base, ("document_index", "sample_index", "shuffle_index"),
                          source, gpt_check(self))


def blended_indices(self, upstream: Callable):
    """``BlendedDataset._build_indices`` (``upstream``) through :func:`cached_indices`."""
    cfg = self.config
    if cfg.defer_npy_index_mmap or cfg.fast_cache_load or not cfg.path_to_cache:
        return upstream(self)
    source = {"dataset_sizes": [len(d) for d in self.datasets]}
    base = f"{self.unique_description_hash}-{type(self).__name__}-{self.split.name}"
    return cached_indices(self, upstream, cfg.path_to_cache, base, ("dataset_index", "dataset_sample_index"),
                          source, blended_check(self))


def safe_numpy_load(path, **kwargs):
    """megatron-core's ``safe_numpy_load`` for its deferred index reads, without pickle."""
    kwargs["allow_pickle"] = False
    return np.load(path, **kwargs)
