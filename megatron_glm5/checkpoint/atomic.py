"""Publishing a tool's output so that nothing is lost: the one helper every checkpoint writer uses.

    with atomic_output_dir(out, inputs=[src], overwrite=args.overwrite, log=print) as tmp:
        ...write everything into tmp...
    # out now is the complete new directory; on any error (or SIGKILL) out is untouched

* ``out`` is refused (one line, :class:`OutputDirError`) when it equals, contains or lies inside an input, when it
  exists and ``overwrite`` is not set, or when it is not a directory.
* A lock (``flock`` on ``.<name>.lock`` beside ``out``) is held for the whole run: a second writer of the same
  ``out`` is refused at once, never silently replaced.
* The work goes into ``.<name>.tmp-XXXX`` beside ``out`` (same filesystem) and is renamed into place only when the
  body finished; an existing ``out`` (``overwrite``) is moved aside first and deleted only after the new one is
  in place (:func:`publish_dir`). Temporaries left by a killed run (``.<name>.tmp-*`` / ``.<name>.old-*``) are
  recognised by the next run of any tool writing ``out`` (it holds the lock, so nobody else owns them), removed
  and named in one notice line; a previous ``out`` moved aside by a run killed between its two renames is put back.
* The published directory and its files get the user's umask permissions (not ``mkdtemp``'s 0700).

:func:`atomic_write_file` does the same for one file (temporary beside it, then ``os.replace``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import os
import shutil
import tempfile
from typing import Callable, Iterator, Optional, Sequence

from megatron_glm5.errors import CheckpointError

TMP_TAG = ".tmp-"
OLD_TAG = ".old-"


class OutputDirError(CheckpointError):
    """An output location that would lose data or that another process is writing."""


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _real(p: str) -> str:
    return os.path.realpath(os.path.abspath(p))


def _inside(child: str, parent: str) -> bool:
    return child != parent and os.path.commonpath([child, parent]) == parent


def check_output_path(out: str, inputs: Sequence[str] = (), overwrite: bool = False, flag: str = "--out",
                      is_dir: bool = True) -> str:
    """Refuse an output that would destroy an input or existing data; returns the absolute ``out``.

    ``inputs``: files or directories the run reads. ``out`` may not equal one, contain one (replacing ``out``
    would delete it) or lie inside one (writing would change it). An existing ``out`` needs ``overwrite``."""
    if not out:
        raise OutputDirError(f"{flag} is empty")
    ro = _real(out)
    for inp in inputs:
        if inp is None:
            continue
        ri = _real(inp)
        if ro == ri:
            raise OutputDirError(f"{flag} {out} is the input {inp}")
        if _inside(ri, ro):
            raise OutputDirError(f"{flag} {out} contains the input {inp}; writing it would delete the input")
        if _inside(ro, ri):
            raise OutputDirError(f"{flag} {out} is inside the input {inp}")
    if os.path.lexists(out):
        if is_dir and not os.path.isdir(out):
            raise OutputDirError(f"{flag} {out} exists and is not a directory")
        if not is_dir and os.path.isdir(out):
            raise OutputDirError(f"{flag} {out} is a directory")
        if not overwrite:
            raise OutputDirError(f"{flag} {out} already exists (pass --overwrite to replace it once the new one is "
                                 "complete)")
    return os.path.abspath(out)


@contextlib.contextmanager
def output_lock(out: str, flag: str = "--out") -> Iterator[str]:
    """Hold an exclusive lock on ``out`` (``.<name>.lock`` beside it) or refuse at once if another process holds it.
    The lock dies with its process (flock), so a killed run never blocks the next one."""
    out = os.path.abspath(out)
    path = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.lock")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666 & ~_umask())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                owner = ""
                try:
                    with open(path) as fh:
                        owner = fh.read().strip()
                except OSError:
                    pass
                who = f" (pid {owner})" if owner.isdigit() else ""
                raise OutputDirError(f"{flag} {out} is being written by another process{who}; refusing to write it "
                                     "at the same time") from None
            raise
        try:  # the file may have been unlinked by its previous holder between our open and flock: retry
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def stale_temporaries(out: str) -> list:
    """Temporaries a killed writer of ``out`` left beside it (only meaningful while holding ``output_lock``)."""
    out = os.path.abspath(out)
    base = os.path.join(os.path.dirname(out), "." + glob.escape(os.path.basename(out)))
    return sorted(glob.glob(base + TMP_TAG + "*") + glob.glob(base + OLD_TAG + "*"))


def remove_stale_temporaries(out: str, log: Optional[Callable[[str], None]] = None) -> list:
    """Clear what a killed writer of ``out`` left (call while holding :func:`output_lock`): its ``.tmp-`` folders
    are removed; a previous ``out`` that :func:`publish_dir` had moved aside (``.old-*/previous``) is put back when
    ``out`` itself is missing (the run died between the two renames), else removed. One notice line through ``log``
    names what was done. Returns the temporaries that were there."""
    out = os.path.abspath(out)
    stale = stale_temporaries(out)
    restored = None
    for p in stale:
        previous = os.path.join(p, "previous")
        if OLD_TAG in os.path.basename(p) and not os.path.lexists(out) and os.path.lexists(previous):
            os.replace(previous, out)
            restored = p
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)
    if stale and log is not None:
        log(f"notice: removed {len(stale)} temporary folder(s) left by an interrupted run: "
            f"{', '.join(os.path.basename(p) for p in stale)}"
            + (f"; put the previous {out} back from {os.path.basename(restored)}" if restored else ""))
    return stale


def fsync_dir(path: str) -> None:
    """fsync a directory's entries (after creating or renaming files in it); best effort."""
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


def publish_dir(tmp: str, out: str) -> None:
    """Make the finished directory ``tmp`` (a sibling of ``out``, same filesystem) appear as ``out`` in one rename.

    An existing ``out`` is first moved into ``.<name>.old-XXXX`` beside it and deleted only once the new one is in
    place, so at every moment ``out`` is either the complete old or the complete new directory (a crash in between
    leaves the old one under ``.old-``, which :func:`remove_stale_temporaries` clears). Directory entries are
    fsynced. The caller holds :func:`output_lock` (or is the only writer, e.g. rank 0 of a collective save)."""
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    fsync_dir(tmp)
    if os.path.lexists(out):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}{OLD_TAG}", dir=parent)
        os.replace(out, os.path.join(old, "previous"))
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    fsync_dir(parent)


@contextlib.contextmanager
def atomic_output_dir(out: str, inputs: Sequence[str] = (), overwrite: bool = False,
                      log: Optional[Callable[[str], None]] = None, flag: str = "--out") -> Iterator[str]:
    """Yield a fresh temporary directory beside ``out``; publish it as ``out`` when the body returns.

    The checks of :func:`check_output_path` run before and again under the lock; the lock is held until the
    directory is published or the temporary removed. Parent folders this call creates are removed again on
    failure. Raises :class:`OutputDirError` (one line) for a refused ``out``."""
    out = check_output_path(out, inputs, overwrite, flag)
    parent = os.path.dirname(out)
    created = []
    d = parent
    while not os.path.exists(d):
        created.append(d)
        d = os.path.dirname(d)
    if os.path.lexists(d) and not os.path.isdir(d):
        raise OutputDirError(f"{flag} {out}: {d} is not a directory")
    os.makedirs(parent, exist_ok=True)
    tmp = None
    try:
        with output_lock(out, flag):
            remove_stale_temporaries(out, log)
            check_output_path(out, inputs, overwrite, flag)  # again: it may have appeared while we waited
            tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}{TMP_TAG}", dir=parent)
            os.chmod(tmp, 0o777 & ~_umask())
            yield tmp
            publish_dir(tmp, out)
            tmp = None
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for c in created:
            with contextlib.suppress(OSError):
                os.rmdir(c)
        raise


def atomic_write_file(path: str, write: Callable[[str], None], inputs: Sequence[str] = (), overwrite: bool = True,
                      flag: str = "--output") -> str:
    """Call ``write(tmp_path)`` and move the result to ``path`` (same checks as directories; ``path`` may not be
    an input or lie inside one). The file gets the user's umask permissions."""
    path = check_output_path(path, inputs, overwrite, flag, is_dir=False)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise OutputDirError(f"{flag} {path}: folder {parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}{TMP_TAG}", dir=parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def write_text_atomic(path: str, text: str) -> None:
    """Replace the small text file ``path`` (a tracker, a manifest) in one rename, fsynced; umask permissions."""
    tmp = f"{path}{TMP_TAG}{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))
