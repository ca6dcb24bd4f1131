"""``--save`` never loses anything: what a training run may write into, checked before any work, and the hooks that
keep Megatron-LM's checkpoint writer from replacing or deleting what this run did not write.

**This model's training checkpoints** (a *save root*, what Megatron-LM's ``save_checkpoint`` with the hooks of
:mod:`megatron_glm5.training.megatron_hooks` writes)::

    SAVE/latest_checkpointed_iteration.txt   the tracker: a decimal iteration (never 'release')
    SAVE/iter_NNNNNNN/                       one folder per save: torch_dist files (*.distcp, .metadata,
                                             metadata.json, common.pt) + hf_config.json + parallel_layout.json;
                                             files only (an interrupted save leaves some of them)
    SAVE/progress.txt                        Megatron-LM's --log-progress
    SAVE/non_persistent/                     Megatron-LM's --non-persistent-ckpt-type global (a save root itself)
    SAVE/latest_checkpointed_iteration.txt.tmp-PID   a tracker write that was killed

plus the folder of ``--tensorboard-dir`` / ``--wandb-save-dir`` / ``--data-cache-path`` when the user put it inside
SAVE (a run writes them there; its resume must accept them). Anything else
(a data set, an HF checkpoint, a converter output (``release/``, ``checksums.sha256``), a link, a foreign file or
folder) makes SAVE no save root: :func:`check_save_target` refuses it with one line before any work.

**Rules** (:func:`check_save_target`, called by the argument checks):

* SAVE is absent, empty, or a save root as above; it is writable (a read-only file system or folder is refused up
  front, not after training).
* SAVE does not equal, contain or lie inside anything the run reads (``--pretrained-checkpoint``, ``--data-path``
  files, ``--tokenizer-model``, ``--hf-config``, a ``--load`` other than SAVE):
  :func:`megatron_glm5.checkpoint.atomic.check_output_path`.
* A save root that holds checkpoints (a tracker or ``iter_*`` folders) is written only by a run that resumes it:
  ``--load SAVE`` without ``--finetune``. A fresh run would restart at iteration 0, replace its checkpoints and move
  its tracker back. With ``--ckpt-step N`` (resume iteration N of ``--load``) SAVE's tracker may not be past N.

**While the run goes on** (:func:`install`, :func:`save_lock`):

* Rank 0 holds ``--save``'s lock (:func:`megatron_glm5.checkpoint.atomic.output_lock`, the converters' lock:
  ``.<name>.lock`` beside SAVE): a second run on the same SAVE is refused at once, with one line from rank 0.
* The tracker is replaced atomically (a temporary beside it, fsynced, renamed): a full disk or a kill while it is
  written leaves the previous tracker, never an empty one. Megatron-LM moves it only after every file of the
  checkpoint is written, so it never names a partial one.
* A save that fails (a full disk, a file system gone read-only, no permission) ends the run with one line naming
  SAVE, the iteration and the writer's error (:class:`SaveFailed`); the tracker stays on the last complete checkpoint.
* Megatron-LM's deletions -- ``--save-retain-interval`` (the previous tracked checkpoint) and the clean-up of old
  non-persistent checkpoints -- remove only checkpoints this run wrote.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
from typing import Iterator, List, Optional, Set, Tuple

from megatron_glm5.checkpoint.atomic import OutputDirError, check_output_path, output_lock, write_text_atomic
from megatron_glm5.errors import ArgumentError, CheckpointError, one_line
from megatron_glm5.checkpoint.tracker import RELEASE, TRACKER_FILE, CheckpointDirError, read_tracker

ITER_DIR = re.compile(r"iter_\d{7,}\Z")
PROGRESS_FILE = "progress.txt"  # Megatron-LM's --log-progress
NON_PERSISTENT_DIR = "non_persistent"  # Megatron-LM's default --non-persistent-global-ckpt-dir, inside SAVE
_TRACKER_TMP = TRACKER_FILE + ".tmp-"  # write_text_atomic's temporary


class SaveGuardError(CheckpointError):
    """A ``--save`` that would lose data, or that another run holds (one line naming the flag)."""


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (full disk, read-only file system, ...); the tracker did not move."""


# ---------------------------------------------------------------------------- what a save root holds
def _kind_of_foreign(names: List[str]) -> str:
    """What the entries ``names`` that no save root holds look like, with what to do, for the message."""
    lower = {n.lower() for n in names}
    if RELEASE in lower or "checksums.sha256" in lower or "conversion_info.json" in lower:
        return "a converted checkpoint (converter output), which is a --pretrained-checkpoint, not a --save folder"
    if "config.json" in lower or any(n.endswith((".safetensors", ".safetensors.index.json")) for n in lower):
        return "an HF checkpoint"
    if any(n.endswith((".bin", ".idx", ".jsonl", ".tar", ".parquet", ".npy")) for n in lower):
        return "a data set"
    return "files that are not this model's training checkpoints"


def save_root_contents(root: str, allowed_extra: Tuple[str, ...] = ()) -> Tuple[Optional[int], List[str]]:
    """``(tracked iteration or None, iter_* folder names)`` of the save root ``root`` (an existing directory).

    Raises :class:`SaveGuardError` (message without the flag) when ``root`` holds anything a save root does not (see
    the module docstring); ``allowed_extra``: top-level names the run itself writes there (its TensorBoard folder)."""
    try:
        names = sorted(os.listdir(root))
    except OSError as e:
        raise SaveGuardError(f"{root}: unreadable ({one_line(e)})") from None
    foreign, iters = [], []
    for name in names:
        path = os.path.join(root, name)
        if os.path.islink(path):
            foreign.append(name)
        elif name == TRACKER_FILE or name.startswith(_TRACKER_TMP) or name == PROGRESS_FILE:
            if not os.path.isfile(path):
                foreign.append(name)
        elif ITER_DIR.match(name) and os.path.isdir(path):
            inner = _non_file_entries(path)
            if inner:
                raise SaveGuardError(f"{root} holds {name}, which is no checkpoint folder of this model (it holds "
                                     f"{inner[0]}, not a checkpoint file); give an empty or new folder")
            iters.append(name)
        elif name == NON_PERSISTENT_DIR and os.path.isdir(path):
            save_root_contents(path)
        elif name not in allowed_extra:
            foreign.append(name)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise SaveGuardError(f"{root} holds {shown}: {_kind_of_foreign(foreign)}; a save folder is new, empty, or "
                             "holds only this model's training checkpoints: give another folder")
    try:
        tracked = read_tracker(root)
    except CheckpointDirError as e:
        raise SaveGuardError(str(e)) from None
    if tracked == RELEASE:
        raise SaveGuardError(f"{root} is a converted checkpoint (its tracker names 'release'): give it as "
                             "--pretrained-checkpoint, and another folder as --save")
    return (None if tracked is None else int(tracked[len("iter_"):])), iters


def _non_file_entries(folder: str) -> List[str]:
    """Entries of a checkpoint folder that are not regular files (links, folders)."""
    try:
        return [n for n in sorted(os.listdir(folder))
                if os.path.islink(os.path.join(folder, n)) or not os.path.isfile(os.path.join(folder, n))]
    except OSError as e:
        return [f"an unreadable folder ({one_line(e)})"]


# ---------------------------------------------------------------------------- the argument check
def _real(p: str) -> str:
    return os.path.realpath(os.path.abspath(p))


def _inputs(args) -> List[str]:
    """Files and folders the run reads, which --save may not equal, contain or lie inside."""
    out = [getattr(args, "pretrained_checkpoint", None), getattr(args, "tokenizer_model", None),
           getattr(args, "hf_config", None)]
    for attr in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        for p in getattr(args, attr, None) or []:
            if not isinstance(p, str):
                continue
            if os.path.exists(p):
                out.append(p)
            out += [p + ext for ext in (".bin", ".idx") if os.path.exists(p + ext)]
    return [p for p in out if p]


def _inside_names(root: str, paths: List[Optional[str]]) -> Tuple[str, ...]:
    """The top-level names inside ``root`` under which the given output paths lie."""
    names = []
    for p in paths:
        if not p:
            continue
        rp, rr = _real(p), _real(root)
        if rp != rr and os.path.commonpath([rp, rr]) == rr:
            names.append(os.path.relpath(rp, rr).split(os.sep)[0])
    return tuple(names)


def _resumes(args, save: str) -> bool:
    """Whether the run resumes the checkpoints of ``save`` (``--load`` names it, not ``--finetune``)."""
    return bool(args.load) and os.path.isdir(args.load) and _real(args.load) == _real(save) and not args.finetune


def _not_writable(path: str) -> Optional[str]:
    """Why the existing folder ``path`` cannot be written, None when it can."""
    if os.access(path, os.W_OK | os.X_OK):
        return None
    try:
        ro = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        ro = False
    return os.strerror(errno.EROFS if ro else errno.EACCES)


def existing_folder(path: str) -> Tuple[str, Optional[str]]:
    """(the nearest existing folder at or above ``path``, the first existing non-folder on the way there or None):
    a folder to be created at ``path`` goes below the first, and cannot be created while there is a second."""
    where = os.path.abspath(path)
    blocked = None
    while not os.path.isdir(where):
        if os.path.lexists(where):
            blocked = where
        where = os.path.dirname(where)
    return where, blocked


def check_save_dir(save: str, args, flag: str = "--save") -> None:
    """The checks of :func:`check_save_target` for one save root; raises :class:`SaveGuardError` naming ``flag``."""
    if _real(save) == os.sep:
        raise SaveGuardError(f"{flag} {save}: the root folder is no save folder")
    try:
        check_output_path(save, _inputs(args) + ([args.load] if args.load and _real(args.load) != _real(save)
                                                 else []), overwrite=True, flag=flag)
    except OutputDirError as e:
        msg = str(e)
        if args.pretrained_checkpoint and msg.endswith(f"the input {args.pretrained_checkpoint}"):
            msg += (" (--pretrained-checkpoint: saving there would change the weights later runs start from); give "
                    "another folder")
        raise SaveGuardError(msg) from None
    if os.path.isdir(save):
        extra = _inside_names(save, [getattr(args, "tensorboard_dir", None), getattr(args, "wandb_save_dir", None),
                                     getattr(args, "data_cache_path", None)])
        try:
            tracked, iters = save_root_contents(save, extra)
        except SaveGuardError as e:
            raise SaveGuardError(f"{flag} {e}") from None
        where = save
    else:
        tracked, iters = None, []
        where, blocked = existing_folder(save)
        if blocked:
            raise SaveGuardError(f"{flag} {save}: {blocked} is not a folder")
    why = _not_writable(where)
    if why:
        what = save if where == save else f"{save}: its folder {where}"
        raise SaveGuardError(f"{flag} {what} cannot be written ({why}); give a writable folder")
    if flag != "--save" or (tracked is None and not iters):
        return
    last = f"iteration {tracked}" if tracked is not None else f"{iters[-1]}, no tracker"
    if not _resumes(args, save):
        if args.finetune and args.load and _real(args.load) == _real(save):
            raise SaveGuardError(f"{flag} {save} holds the checkpoints --finetune starts from ({last}); --finetune "
                                 "restarts at iteration 0 and would replace them: give another --save folder")
        raise SaveGuardError(f"{flag} {save} holds the checkpoints of another run ({last}); this run starts at "
                             f"iteration 0 and would replace them: give --load {save} to resume it, or another "
                             "--save folder")
    step = getattr(args, "ckpt_step", None)
    if step is not None and tracked is not None and tracked > step:
        raise SaveGuardError(f"--ckpt-step {step}: {flag} {save} holds checkpoints up to iteration {tracked}, which "
                             f"resuming from iteration {step} would replace: give another --save folder")


def check_save_target(args) -> None:
    """Refuse (``ArgumentError``, one line naming the flag) a ``--save`` (and ``--non-persistent-global-ckpt-dir``)
    that would lose data (module docstring); nothing is written. Also refuses ``--ckpt-step N`` when ``--load`` has
    no ``iter_NNNNNNN`` for it."""
    step = getattr(args, "ckpt_step", None)
    if step is not None and args.load:
        folder = os.path.join(args.load, f"iter_{step:07d}")
        if step < 0 or not os.path.isdir(folder):
            raise ArgumentError("--ckpt-step", f"{step}: no checkpoint {folder}")
    targets = [("--save", args.save)]
    if getattr(args, "non_persistent_global_ckpt_dir", None):
        targets.append(("--non-persistent-global-ckpt-dir", args.non_persistent_global_ckpt_dir))
    for flag, path in targets:
        if not path:
            continue
        try:
            check_save_dir(path, args, flag)
        except SaveGuardError as e:  # its message starts with the flag it is about
            named, _, rest = str(e).partition(" ")
            raise ArgumentError(named if named.startswith("--") else flag, rest) from None


# ---------------------------------------------------------------------------- while the run goes on
def _rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


@contextlib.contextmanager
def save_lock(args) -> Iterator[None]:
    """Rank 0 holds ``--save``'s lock for the body (the converters' ``output_lock``) and checks ``--save`` again
    under it (another run may have written it since the argument checks); other ranks hold nothing. Raises
    :class:`SaveGuardError` (one line) when another process holds it."""
    if not args.save or _rank() != 0:
        yield
        return
    with contextlib.ExitStack() as stack:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(args.save)), exist_ok=True)
            stack.enter_context(output_lock(args.save, flag="--save"))
        except OutputDirError as e:
            raise SaveGuardError(str(e)) from None
        except OSError as e:
            raise SaveGuardError(f"--save {args.save}: cannot take its lock beside it ({one_line(e)})") from None
        check_save_dir(args.save, args)
        yield


class _AtomicText:
    """A text file opened for writing whose content replaces ``path`` in one rename when closed without error."""

    def __init__(self, path: str):
        self.path, self.parts = path, []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            write_text_atomic(self.path, "".join(self.parts))
        return False


class _AtomicTrackerStorage:
    """``megatron.core.msc_utils.maybe_msc`` as Megatron-LM's checkpointing sees it: opening the tracker for writing
    gives :class:`_AtomicText`; everything else is megatron-core's."""

    def __init__(self, upstream):
        self._upstream = upstream

    def __getattr__(self, name):
        value = getattr(self._upstream, name)
        if name != "open":
            return value

        def open_(path, mode="r", *a, **kw):
            if "w" in mode and "b" not in mode and os.path.basename(str(path)) == TRACKER_FILE and not a and not kw:
                return _AtomicText(str(path))
            return value(path, mode, *a, **kw)

        return open_


_INSTALLED: List[str] = []
_WRITTEN: Set[Tuple[str, int]] = set()  # (real save root, iteration) of every checkpoint this process saved
_WRITER_ERRORS: list = []  # the first exception a torch_dist writer thread hit during the current save


def _saving(save_checkpoint):
    """``save_checkpoint`` that records what it writes and turns a failed write into :class:`SaveFailed`."""

    def save(iteration, *args, **kwargs):
        from megatron.training import get_args

        run = get_args()
        root = run.save
        if kwargs.get("non_persistent_ckpt") and run.non_persistent_ckpt_type == "global":
            root = run.non_persistent_global_ckpt_dir or os.path.join(run.save, NON_PERSISTENT_DIR)
        folder = os.path.join(root, f"iter_{int(iteration):07d}")
        _WRITTEN.add((_real(root), int(iteration)))
        _WRITER_ERRORS.clear()
        try:
            return save_checkpoint(iteration, *args, **kwargs)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # torch's CheckpointException is a BaseException
            cause = _writer_error(e, root)
            raise SaveFailed(f"--save {run.save}: the checkpoint of iteration {int(iteration)} could not be written "
                             f"({cause}; {folder} is incomplete and not tracked)") from e

    return save


def _finalizing(maybe_finalize_async_save):
    """Megatron-LM's ``maybe_finalize_async_save`` turning a failed asynchronous save into :class:`SaveFailed`."""

    @functools.wraps(maybe_finalize_async_save)
    def finalize(*args, **kwargs):
        try:
            return maybe_finalize_async_save(*args, **kwargs)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # torch's CheckpointException is a BaseException
            from megatron.training import get_args

            save = get_args().save
            raise SaveFailed(f"--save {save}: an asynchronous checkpoint save could not be finished "
                             f"({_writer_error(e, save)}; its folder is incomplete and not tracked)") from e

    return finalize


def _writer_error(e: BaseException, root: str) -> str:
    """The most telling reason of a failed save: an OSError in the exception chain; else the state of the file system
    of ``root`` (torch's zip writer reports a full disk as 'unexpected pos'); else the error a writer thread hit
    (megatron-core's writer passes on only its type); else the exception itself."""
    seen, cur = set(), e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno is not None:
            return one_line(cur)
        cur = cur.__cause__ or cur.__context__
    try:
        st = os.statvfs(root)
    except OSError:
        st = None
    if st is not None and st.f_flag & os.ST_RDONLY:
        return os.strerror(errno.EROFS)
    if st is not None and st.f_bavail * st.f_frsize < _FULL_BYTES:
        return f"{os.strerror(errno.ENOSPC)}: {st.f_bavail * st.f_frsize // 1024} KiB free"
    for err in _WRITER_ERRORS:
        return one_line(err)
    return one_line(e)


_FULL_BYTES = 1 << 20  # less free space than this after a failed write: the disk is full


def _recording_writer(write_preloaded_data):
    """megatron-core's ``FileSystemWriterAsync.write_preloaded_data`` keeping the exception of a failed write (its
    caller replaces it by an assertion about its type)."""

    @functools.wraps(write_preloaded_data)
    def write(*args, **kwargs):
        out = write_preloaded_data(*args, **kwargs)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], BaseException):
            _WRITER_ERRORS.append(out[1])
        return out

    return staticmethod(write)


def _own_checkpoints_only(delete_impl):
    """Megatron-LM's ``--save-retain-interval`` deletion of a previous checkpoint, for checkpoints this run wrote."""

    def delete(save_path, iteration_to_delete, *args, **kwargs):
        if (_real(save_path), int(iteration_to_delete)) not in _WRITTEN:
            print(f"  keeping the checkpoint of iteration {int(iteration_to_delete)} in {save_path}: an earlier run "
                  "wrote it (--save-retain-interval deletes only this run's checkpoints)", flush=True)
            return None
        return delete_impl(save_path, iteration_to_delete, *args, **kwargs)

    return delete


def _cleanup_own_non_persistent(save_dir, leave_ckpt_num=1, do_async=False):
    """Megatron-LM's clean-up of old non-persistent checkpoints (it removes every ``iter_*`` below the folder but the
    newest), restricted to the ``iter_*`` folders directly in ``save_dir`` that this run wrote."""
    import shutil

    import torch

    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    root = _real(save_dir)
    own = sorted(it for r, it in _WRITTEN if r == root and os.path.isdir(os.path.join(root, f"iter_{it:07d}")))
    for it in own[:-leave_ckpt_num] if leave_ckpt_num > 0 else own:
        path = os.path.join(root, f"iter_{it:07d}")
        if not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)




# the parts of the one save_checkpoint wrapper, switched on by their installers: 'loader' and 'nonfinite' (functions of
# the save they wrap: :mod:`megatron_glm5.training.data_loaders`,
# :func:`megatron_glm5.training.megatron_hooks.refuse_nonfinite_save`), 'guard' (:func:`install`)
SAVE_PARTS: dict = {"loader": None, "guard": False, "nonfinite": None}


def _save_checkpoint(upstream):
    """Megatron-LM's ``save_checkpoint`` ``upstream`` with this project's parts of :data:`SAVE_PARTS`, outermost
    first: the Energon loader state written into the checkpoint folder, the save guard (:func:`_saving`: what is
    written recorded, a failed write one :class:`SaveFailed` line), the refusal to save a NaN/inf model or an
    untrained indexer warm-up (:func:`megatron_glm5.training.megatron_hooks.refuse_nonfinite_save`)."""

    def save_checkpoint(iteration, *args, **kwargs):
        save = upstream
        if SAVE_PARTS["nonfinite"] is not None:
            save = SAVE_PARTS["nonfinite"](save)
        if SAVE_PARTS["guard"]:
            save = _saving(save)
        if SAVE_PARTS["loader"] is not None:
            save = SAVE_PARTS["loader"](save)
        return save(iteration, *args, **kwargs)

    save_checkpoint.upstream = upstream
    return save_checkpoint


def install_save_checkpoint(part: str, value=True) -> bool:
    """Switch on ``part`` of :data:`SAVE_PARTS` (``value``) and make :func:`_save_checkpoint` the
    ``save_checkpoint`` of ``megatron.training.training`` (idempotent; the ``save_checkpoint`` record of
    :mod:`megatron_glm5.extensions`). Returns whether ``part`` was off before."""
    from megatron.training import training

    from megatron_glm5 import extensions

    record = extensions.BY_NAME["save_checkpoint"]
    extensions.guard(record)
    if not extensions.installed(training, "save_checkpoint"):
        extensions.apply(record, _save_checkpoint(training.save_checkpoint))
    was_off = not SAVE_PARTS[part]
    SAVE_PARTS[part] = value
    return was_off


def install() -> List[str]:
    """Install the hooks into ``megatron.training`` (idempotent); returns their descriptions."""
    from megatron_glm5 import extensions

    record = extensions.BY_NAME["save_guards"]
    extensions.guard(record)
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.training import checkpointing, training

    done = _INSTALLED
    if not extensions.installed(checkpointing, "maybe_msc"):
        extensions.apply(record, _AtomicTrackerStorage(checkpointing.maybe_msc), owner=checkpointing,
                         attr="maybe_msc")
        done.append("the tracker replaced atomically")
    if install_save_checkpoint("guard"):
        done.append("a failed save is one line, the tracker on the last complete checkpoint")
    if not extensions.installed(training, "maybe_finalize_async_save"):
        extensions.apply(record, _finalizing(training.maybe_finalize_async_save), owner=training,
                         attr="maybe_finalize_async_save")
    if not extensions.installed(FileSystemWriterAsync, "write_preloaded_data"):
        extensions.apply(record, _recording_writer(FileSystemWriterAsync.write_preloaded_data),
                         owner=FileSystemWriterAsync, attr="write_preloaded_data")
    if not extensions.installed(checkpointing, "_async_delete_checkpoint_impl"):
        extensions.apply(record, _own_checkpoints_only(checkpointing._async_delete_checkpoint_impl),
                         owner=checkpointing, attr="_async_delete_checkpoint_impl")
        extensions.apply(record, _cleanup_own_non_persistent, owner=checkpointing,
                         attr="cleanup_old_non_persistent_checkpoint")
        done.append("--save-retain-interval and non-persistent clean-up delete only this run's checkpoints")
    return done
