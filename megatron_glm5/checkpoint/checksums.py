"""SHA-256 manifest of a written checkpoint, verified by every reader: a flipped byte is an error, not wrong weights.

The manifest ``checksums.sha256`` is in ``sha256sum`` format (``sha256sum -c checksums.sha256`` checks it too)::

    9f2c...e1  __0_0.distcp
    51aa...07  .metadata

Writers hash each file while they write it where they can (:class:`HashingFile`), else afterwards
(:func:`write_manifest` hashes the files it is not given digests for, in threads: hashlib releases the GIL).
:func:`verify_manifest` re-hashes every listed file and refuses a mismatch, a listed file that is missing, and a
checkpoint data file (``*.distcp``, ``*.safetensors``, ``.metadata``, and the files megatron-core and the trainer read:
``metadata.json``, ``common.pt``, ``hf_config.json``, ``parallel_layout.json``) that the manifest does not list. A
directory without a manifest (written by other software) is accepted as it is.

Training checkpoints carry megatron-core's own manifest instead, ``integrity.json`` (``--verify-integrity``, written
by ``megatron.core.dist_checkpointing.validation.save_integrity_manifest`` after the checkpoint's files are complete):
``{"algorithm": "sha256", "files": {name: digest}}``. :func:`verify_manifest` checks it the same way
(:func:`read_integrity_manifest`).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import os
import re
from typing import Dict, Iterable, Optional, Tuple

from megatron_glm5.checkpoint.cpus import usable_cpus
from megatron_glm5.errors import CheckpointError

MANIFEST_FILE = "checksums.sha256"
INTEGRITY_FILE = "integrity.json"  # megatron-core's manifest (dist_checkpointing.validation.INTEGRITY_FNAME)
DATA_FILE = re.compile(r"(\.distcp|\.safetensors|^\.metadata|^metadata\.json|^common\.pt|^hf_config\.json"
                       r"|^parallel_layout\.json)$")
_MAX_INTEGRITY_BYTES = 64 << 20
_HEX64 = re.compile(r"[0-9a-f]{64}")
_BUF = 8 << 20
_LINE = re.compile(r"([0-9a-f]{64}) [ *](.+)")


class ChecksumError(CheckpointError):
    """A checkpoint file whose bytes differ from its manifest entry (or a malformed manifest)."""


class HashingFile:
    """Wraps a binary file opened for writing: every ``write`` also feeds a SHA-256 (``hexdigest()``)."""

    def __init__(self, fh):
        self._fh = fh
        self._h = hashlib.sha256()

    def write(self, data) -> int:
        self._h.update(data)
        return self._fh.write(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def __getattr__(self, name):  # tell, fileno, flush, close ... of the wrapped file
        return getattr(self._fh, name)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(_BUF)
        view = memoryview(buf)
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def _threads(n: int) -> int:
    return max(1, min(n, usable_cpus(), 8))


def hash_files(paths: Iterable[str]) -> Dict[str, str]:
    """path -> SHA-256 hex digest, files hashed in parallel threads."""
    paths = list(paths)
    if not paths:
        return {}
    with cf.ThreadPoolExecutor(_threads(len(paths))) as ex:
        return dict(zip(paths, ex.map(sha256_file, paths)))


def write_manifest(directory: str, known: Optional[Dict[str, str]] = None) -> str:
    """Write ``directory/checksums.sha256`` covering every regular file in it (not subfolders, not the manifest).
    ``known``: file name -> digest already computed while writing (those files are not read again)."""
    known = dict(known or {})
    names = sorted(n for n in os.listdir(directory)
                   if n != MANIFEST_FILE and os.path.isfile(os.path.join(directory, n)))
    todo = [os.path.join(directory, n) for n in names if n not in known]
    for path, digest in hash_files(todo).items():
        known[os.path.basename(path)] = digest
    from megatron_glm5.checkpoint.atomic import write_text_atomic

    path = os.path.join(directory, MANIFEST_FILE)
    write_text_atomic(path, "".join(f"{known[n]}  {n}\n" for n in names))
    return path


def read_manifest(directory: str) -> Optional[Dict[str, str]]:
    """file name -> digest, or None when ``directory`` has no manifest. Malformed lines or names that are not
    plain file names in the directory raise ChecksumError."""
    path = os.path.join(directory, MANIFEST_FILE)
    if not os.path.exists(path):
        return None
    out = {}
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ChecksumError(f"{path}: unreadable ({e})") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        m = _LINE.fullmatch(line)
        if not m:
            raise ChecksumError(f"{path}: line {i} is not '<sha256>  <file>'")
        name = m.group(2)
        if "/" in name or "\\" in name or name in (".", "..") or "\x00" in name:
            raise ChecksumError(f"{path}: line {i} names {name!r}, not a file of this directory")
        out[name] = m.group(1)
    return out


def _plain_name(name, where: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") or "\x00" in name:
        raise ChecksumError(f"{where} names {name!r}, not a file of this directory")
    return name


def read_integrity_manifest(directory: str) -> Optional[Dict[str, str]]:
    """file name -> SHA-256 digest from megatron-core's ``integrity.json``, or None when ``directory`` has none.
    Anything but ``{"algorithm": "sha256", "files": {plain file name: 64 hex digits}}`` raises ChecksumError."""
    import json

    path = os.path.join(directory, INTEGRITY_FILE)
    if not os.path.lexists(path):
        return None
    if os.path.islink(path) or not os.path.isfile(path):
        raise ChecksumError(f"{path}: not a regular file")
    try:
        with open(path, "rb") as fh:
            data = fh.read(_MAX_INTEGRITY_BYTES + 1)
        if len(data) > _MAX_INTEGRITY_BYTES:
            raise ValueError(f"larger than {_MAX_INTEGRITY_BYTES >> 20} MiB")
        obj = json.loads(data.decode("utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise ChecksumError(f"{path}: unreadable ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    files = obj.get("files") if isinstance(obj, dict) else None
    if not isinstance(files, dict) or obj.get("algorithm", "sha256") != "sha256":
        raise ChecksumError(f"{path}: not megatron-core's integrity manifest "
                            '({"algorithm": "sha256", "files": {name: digest}})')
    out = {}
    for name, digest in files.items():
        _plain_name(name, path)
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise ChecksumError(f"{path}: the digest of {name!r} is not 64 hex digits")
        out[name] = digest
    return out


def write_integrity_manifest(directory: str) -> str:
    """Write megatron-core's ``integrity.json`` for ``directory`` (every regular file in it but the manifest), as
    ``megatron.core.dist_checkpointing.validation.save_integrity_manifest`` does, with the files hashed in parallel
    threads and the manifest published atomically (a kill leaves none or the whole one). Returns its path."""
    import json

    from megatron_glm5.checkpoint.atomic import write_text_atomic

    names = sorted(n for n in os.listdir(directory)
                   if n != INTEGRITY_FILE and os.path.isfile(os.path.join(directory, n)))
    digests = hash_files(os.path.join(directory, n) for n in names)
    files = {n: digests[os.path.join(directory, n)] for n in names}
    path = os.path.join(directory, INTEGRITY_FILE)
    write_text_atomic(path, json.dumps({"algorithm": "sha256", "files": files}, indent=2))
    return path


def verify_manifest(directory: str, required: bool = False, share: Tuple[int, int] = (0, 1)) -> bool:
    """Re-hash every file the manifest (``checksums.sha256`` and / or megatron-core's ``integrity.json``) lists
    (threads). Returns False when there is none (True when all match); raises ChecksumError for a mismatch, a missing
    listed file, an unlisted checkpoint data file, or, with ``required``, a missing manifest. ``share`` = (i, n):
    re-hash only every n-th listed file from the i-th (in name order), so that n processes verify a checkpoint
    together; the listing checks run in every share."""
    ours, megatron = read_manifest(directory), read_integrity_manifest(directory)
    if ours is None and megatron is None:
        if required:
            raise ChecksumError(f"{directory}: no {MANIFEST_FILE}")
        return False
    manifest = MANIFEST_FILE if ours is not None else INTEGRITY_FILE
    want = dict(megatron or {})
    for name, digest in (ours or {}).items():
        if want.setdefault(name, digest) != digest:
            raise ChecksumError(f"{directory}: {MANIFEST_FILE} and {INTEGRITY_FILE} differ on {name}")
    present = set(os.listdir(directory))
    missing = sorted(n for n in want if n not in present)
    if missing:
        raise ChecksumError(f"{os.path.join(directory, missing[0])}: listed in {manifest} but missing"
                            f"{f' (+{len(missing) - 1} more)' if len(missing) > 1 else ''}")
    unlisted = sorted(n for n in present if DATA_FILE.search(n) and n not in want)
    if unlisted:
        raise ChecksumError(f"{os.path.join(directory, unlisted[0])}: not listed in {manifest} (a file added to the "
                            "checkpoint after it was written)")
    for n in want:
        if os.path.islink(os.path.join(directory, n)) or not os.path.isfile(os.path.join(directory, n)):
            raise ChecksumError(f"{directory}/{n}: listed in {manifest} but not a regular file")
    try:
        got = hash_files(os.path.join(directory, n) for n in sorted(want)[share[0]::share[1]])
    except OSError as e:
        raise ChecksumError(f"{e.filename or directory}: unreadable ({e.strerror or e})") from None
    for path, digest in got.items():
        if digest != want[os.path.basename(path)]:
            raise ChecksumError(f"{path}: checksum mismatch (the file changed or is corrupt since it was written)")
    return True
