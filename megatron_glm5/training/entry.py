"""The training entry: ``run_pretrain`` hands the providers of ``pretrain_glm5_vlm.py`` to Megatron-LM's
``megatron.training.pretrain``.

Before Megatron-LM starts: on a machine without CUDA the CPU redirects (:mod:`megatron_glm5.cpu_compat`), this
project's megatron-core changes (:func:`megatron_glm5.initialize.install_patches`), this model's hooks into the
trainer (:mod:`megatron_glm5.training.megatron_hooks`, :mod:`megatron_glm5.training.flops`; each refuses a
megatron-core release it is not written for in one line, :mod:`megatron_glm5.mcore_version`), then the flags
(:func:`megatron_glm5.training.arguments.parse_args`: one line and exit 2 on a bad one). A user-caused error later
(:func:`user_errors`: bad data or checkpoints, too many non-finite steps in a row, a save that fails on a full disk,
a ``--save`` another run holds (:mod:`megatron_glm5.training.save_guard`)) ends the run with one line and exit 1,
Ctrl-C (SIGINT) at any point with one line and exit 130; under a launcher the line comes from rank 0 only.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Callable, List, Optional


def _quiet_megatron() -> None:
    """The stack's messages a user cannot act on, hidden by their exact text (:mod:`megatron_glm5.training.quiet`)."""
    from megatron_glm5.training import quiet

    quiet.install_warnings()
    quiet.install_logs()
    # a log line that cannot be written (stdout on a full disk) is not a traceback per line: the run's own next
    # write of stdout fails with ENOSPC and ends the run with one line
    logging.raiseExceptions = False


_CTRL_C = {"seen": False}
_HELPER_CONNECTION_ERRORS = (BrokenPipeError, ConnectionResetError, EOFError)
_CTRL_C_GRACE_S = 5.0


def _after_ctrl_c(exc_type: type) -> bool:
    """Whether ``exc_type`` is a helper's broken connection caused by Ctrl-C. The thread that reports it may run
    before this process's main thread has run its SIGINT handler (a peer that died of the same signal reset the
    connection first), so a broken connection waits up to ``_CTRL_C_GRACE_S`` for the SIGINT to be seen."""
    import threading
    import time

    if not issubclass(exc_type, _HELPER_CONNECTION_ERRORS):
        return False
    if threading.current_thread() is threading.main_thread():
        return _CTRL_C["seen"]  # the main thread runs the handler itself: no later SIGINT to wait for
    deadline = time.monotonic() + _CTRL_C_GRACE_S
    while not _CTRL_C["seen"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return _CTRL_C["seen"]


def _quiet_threads_after_ctrl_c() -> None:
    """Once Ctrl-C (SIGINT) has reached this process, a helper thread's broken connection is not a traceback: the
    data-loader workers die with the same signal, and the thread of ``multiprocessing.resource_sharer`` that hands
    their tensors over reports ``BrokenPipeError`` / ``ConnectionResetError`` / ``EOFError`` through
    ``sys.excepthook`` (other threads through ``threading.excepthook``). Those three are dropped when a SIGINT arrives
    (see :func:`_after_ctrl_c`); anything else is printed as before. Python's own SIGINT handling
    (KeyboardInterrupt in the main thread) is kept. Forked data-loader workers inherit the hooks and the handler.

    A SIGINT that lands while the main thread runs a finalizer (a weakref callback, a ``__del__``) raises its
    KeyboardInterrupt there, where Python prints it as "Exception ignored" and drops it: the run would go on. Such a
    dropped interrupt is delivered again (:func:`_deliver_dropped_interrupt`) once the finalizer has returned."""
    import signal
    import sys
    import threading

    if getattr(sys.excepthook, "glm5_ctrl_c", False) or threading.current_thread() is not threading.main_thread():
        return
    previous_handler = signal.getsignal(signal.SIGINT)
    if not callable(previous_handler):
        return  # SIGINT ignored or left to the system: nothing to mark

    def on_sigint(signum, frame):
        _CTRL_C["seen"] = True
        return previous_handler(signum, frame)

    sys_hook, thread_hook = sys.excepthook, threading.excepthook

    def sys_excepthook(exc_type, exc_value, exc_traceback):
        if not _after_ctrl_c(exc_type):
            sys_hook(exc_type, exc_value, exc_traceback)

    def thread_excepthook(args):
        if not _after_ctrl_c(args.exc_type):
            thread_hook(args)

    unraisable_hook = sys.unraisablehook

    def sys_unraisablehook(unraisable):
        if (issubclass(unraisable.exc_type, KeyboardInterrupt) and _CTRL_C["seen"]
                and threading.current_thread() is threading.main_thread()):
            _deliver_dropped_interrupt()
        else:
            unraisable_hook(unraisable)

    sys_excepthook.glm5_ctrl_c = True
    signal.signal(signal.SIGINT, on_sigint)
    sys.excepthook = sys_excepthook
    threading.excepthook = thread_excepthook
    sys.unraisablehook = sys_unraisablehook


# how long after a finalizer dropped a Ctrl-C it is delivered again: the finalizer has returned by then
_REDELIVER_AFTER_S = 0.05


def _deliver_dropped_interrupt() -> None:
    """Deliver a KeyboardInterrupt that a finalizer dropped to the main thread again, from a timer thread: the hook
    that saw it runs inside the finalizer, where a new one would be dropped the same way. One that lands in another
    finalizer comes back here and is delivered once more."""
    import _thread
    import signal
    import threading

    timer = threading.Timer(_REDELIVER_AFTER_S, _thread.interrupt_main, args=(signal.SIGINT,))
    timer.daemon = True
    timer.start()


def _last_checkpoint(save: Optional[str]) -> str:
    """'; the last checkpoint (iteration N) in SAVE is intact' when SAVE's tracker names one."""
    from megatron_glm5.checkpoint.tracker import CheckpointDirError, read_tracker

    try:
        folder = read_tracker(save) if save else None
    except CheckpointDirError:
        return ""
    if folder is None:
        return ""
    last = str(int(folder[len("iter_"):])) if folder.startswith("iter_") else folder
    return f"; the last checkpoint (iteration {last}) in {save} is intact"


def user_errors() -> tuple:
    """The exceptions a user causes (bad flags, data, configs or checkpoints, a run stopped by non-finite steps): the
    entry ends the run with one line, no traceback. Every other exception is a bug and keeps its traceback."""
    from megatron_glm5.errors import ArgumentError, CheckpointError, DataError, Glm5ConfigError
    from megatron_glm5.mcore_version import UnsupportedMegatronCore
    from megatron_glm5.training.megatron_hooks import TrainingStopped
    from megatron_glm5.training.save_guard import SaveFailed

    return (ArgumentError, CheckpointError, DataError, Glm5ConfigError, TrainingStopped, SaveFailed,
            UnsupportedMegatronCore)


# OSError numbers that are the machine's state, not a bug: the user's to fix (a full or read-only disk, no permission,
# a file removed or replaced by a directory while the run reads it)
_USER_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR,
                          errno.EISDIR})


_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launcher_env_error() -> Optional[str]:
    """Why the launcher's environment (``$RANK`` ... ``$MASTER_PORT``, what torchrun sets for ``env://``) cannot
    start a run, or None. Without ``$RANK`` the run is a world of one process and the entry sets them all; the
    examples' dry run (``MEGATRON_GLM5_CHECK_ARGS=1``: the flags for a world of ``$WORLD_SIZE``) starts no process
    group and needs no ``$MASTER_ADDR`` / ``$MASTER_PORT``."""
    env = os.environ
    if "RANK" not in env:
        return None
    hint = (f"set by a launcher such as torchrun; unset {', '.join(_LAUNCHER_VARS)} to run as a single process")
    values = {}
    for name, low in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0), ("MASTER_PORT", 1)):
        text = env.get(name)
        if text is None:
            continue
        try:
            values[name] = int(text)
        except ValueError:
            return f"${name}={text!r} is not an integer ({hint})"
        if values[name] < low or (name == "MASTER_PORT" and values[name] > 65535):
            return f"${name}={text!r} is out of range ({hint})"
    from megatron_glm5.training.arguments import is_dry_run

    dry_run = is_dry_run()
    for name in ("WORLD_SIZE",) + (() if dry_run else ("MASTER_PORT", "MASTER_ADDR")):
        if not env.get(name):
            return f"${name} is not set but $RANK is ({hint})"
        if name == "WORLD_SIZE" and values["RANK"] >= values["WORLD_SIZE"]:
            return f"$RANK={values['RANK']} is not below $WORLD_SIZE={values['WORLD_SIZE']} ({hint})"
    return None


def run_pretrain(datasets_provider: Callable, model_provider: Callable, forward_step: Callable,
                 argv: Optional[List[str]] = None, prog: str = "pretrain_glm5_vlm.py",
                 program_start: Optional[float] = None) -> int:
    """Run Megatron-LM's ``pretrain`` with these providers; returns the exit status. ``program_start``: when the
    program started (``time.time()``), from which ``--exit-duration-in-mins`` counts.

    Ctrl-C at any point (start-up, argument checks, model or data building, training, saving) ends the run with one
    line ``PROG: interrupted`` and exit 130; a user-caused error (:func:`user_errors`, an OSError of a full or
    read-only disk, a missing permission or a missing file) with one line ``PROG: error: ...`` and exit 2 for a flag,
    1 otherwise; both name the last intact checkpoint of ``--save``. Under a launcher only rank 0 prints the line
    (:func:`~megatron_glm5.training.arguments.exit_with_line`); every rank exits non-zero. Any other exception is a
    bug and keeps its traceback; ``MEGATRON_GLM5_TRACEBACK=1`` shows the traceback of user errors too. A launcher
    environment that cannot start a run (:func:`launcher_env_error`) is one line from every process and exit 2."""
    # Triton's autotuning results (FLA's KDA kernels, ours) kept in its disk cache beside the compiled kernels, so
    # that a run after the first on a machine starts without tuning again (minutes at 4K on an H100)
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    import sys

    if "--help-extensions" in (sys.argv[1:] if argv is None else argv):  # the registry of changes, torch-free
        from megatron_glm5.extensions import table

        print(table())
        return 0
    bad_env = launcher_env_error()
    if bad_env:  # said by every process: with a broken $RANK none knows whether it is rank 0
        from megatron_glm5.training.arguments import print_line

        print_line(f"{prog}: error: {bad_env}")
        return 2
    run = {}
    _quiet_threads_after_ctrl_c()
    finished = False
    try:
        code = _run_pretrain(datasets_provider, model_provider, forward_step, argv, prog, program_start, run)
        finished = code == 0
        return code
    except KeyboardInterrupt:
        return _exit(f"{prog}: interrupted{_last_checkpoint(run.get('save'))}", 130, every_rank_hit_it=True)
    except Exception as e:  # noqa: BLE001 - user errors become one line; anything else is re-raised as it was
        if os.environ.get("MEGATRON_GLM5_TRACEBACK") == "1":
            raise
        if isinstance(e, OSError) and e.errno in _USER_ERRNOS:
            code = 1
        elif isinstance(e, user_errors()):
            from megatron_glm5.errors import ArgumentError

            code = 2 if isinstance(e, ArgumentError) else 1
        else:
            raise
        from megatron_glm5.training.save_guard import SaveFailed, SaveGuardError

        last = "" if isinstance(e, SaveGuardError) else _last_checkpoint(run.get("save"))  # --save is not this run's
        return _exit(f"{prog}: error: {_user_message(e)}{last}", code, every_rank_hit_it=isinstance(e, SaveFailed))
    finally:
        if not finished:
            _drop_event_file_without_scalars()


def _drop_event_file_without_scalars() -> None:
    """After a failed run: this process's TensorBoard event file (Megatron-LM's writer, created at start-up) is
    removed when it holds no scalar (a run that stopped before its first logged iteration: only the arguments
    text); a file with any scalar is kept. The directory and any other file are left as they are."""
    import sys

    global_vars = sys.modules.get("megatron.training.global_vars")
    writer = getattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", None)
    event_writer = getattr(getattr(writer, "file_writer", None), "event_writer", None)
    path = getattr(event_writer, "_file_name", None)
    if path is None:
        return
    try:
        writer.close()
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

        has_scalars = any(v.HasField("simple_value") or v.metadata.plugin_data.plugin_name == "scalars"
                          for event in EventFileLoader(path).Load() for v in event.summary.value)
        if not has_scalars:
            os.remove(path)
    except Exception:  # noqa: BLE001 - the run's own error line is what the user reads; the file stays
        return


def _user_message(e: BaseException) -> str:
    """``e``'s message as one line; an error a DataLoader worker raised carries the worker's traceback in its message
    (torch's ``ExceptionWrapper``): its last line, the original message, is kept."""
    from megatron_glm5.errors import one_line

    text = str(e)
    if "\nOriginal Traceback (most recent call last):" in text:
        last = [ln for ln in text.splitlines() if ln.strip()][-1]
        return one_line(RuntimeError(last.split(": ", 1)[-1]))
    return one_line(e)


def _exit(line: str, code: int, every_rank_hit_it: bool = False) -> int:
    """One line (rank 0 only) and ``code``: :func:`~megatron_glm5.training.arguments.exit_with_line`'s exit
    status, returned."""
    from megatron_glm5.training.arguments import exit_with_line

    try:
        exit_with_line(line, code, every_rank_hit_it)
    except SystemExit as e:
        return int(e.code)


def _run_pretrain(datasets_provider, model_provider, forward_step, argv, prog, program_start, run: dict) -> int:
    """:func:`run_pretrain`'s work; ``run['save']`` is set to ``--save`` once the flags are read."""
    import time

    from megatron_glm5.training.flag_table import check_flags_fast

    check_flags_fast(argv, prog)  # --help and the flag errors that need no torch, from the flag table's snapshot
    _quiet_megatron()
    import torch

    if not torch.cuda.is_available():
        from megatron_glm5.cpu_compat import enable_cpu_compat

        enable_cpu_compat()
    from megatron_glm5.initialize import install_patches

    install_patches()
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from megatron_glm5.training import flops, megatron_hooks, memory_report, moe_load_logging
    from megatron_glm5.training.arguments import is_dry_run, parse_args

    megatron_hooks.install()
    flops.install()
    memory_report.install()
    moe_load_logging.install()
    if "RANK" not in os.environ:  # plain `python pretrain_glm5_vlm.py`: a world of one process
        from megatron_glm5.initialize import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()))
    args = parse_args(argv, prog)
    run["save"] = args.save
    from megatron_glm5.training import quiet

    quiet.install_logs(args)
    from megatron.training.utils import print_rank_0

    if is_dry_run():  # the examples' DRY_RUN: the flags only
        print(f"{prog}: the arguments pass Megatron-LM's checks and this model's for a world of {args.world_size} "
              f"(TP {args.tensor_model_parallel_size}, PP {args.pipeline_model_parallel_size}, EP "
              f"{args.expert_model_parallel_size}, CP {args.context_parallel_size}, DP {args.data_parallel_size})")
        return 0
    from megatron_glm5.training import save_guard

    if args.save:
        megatron_hooks.install_checkpoint_writer_queue()
    save_guard.install()
    print_rank_0(megatron_hooks.describe(["save guards"]))
    if args.test_kill_during_save is not None:
        megatron_hooks.install_test_kill_during_save(args.test_kill_during_save)
    from megatron.training.training import set_startup_timestamps

    set_startup_timestamps(program_start=program_start, main_entry=time.time())
    cfg = pretrain_cfg_container_from_args(args)
    with save_guard.save_lock(args):  # rank 0 holds --save for the run
        pretrain(cfg, datasets_provider, ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
    from megatron_glm5.models.cuda_graphs import describe_graphed_modules

    graphs = describe_graphed_modules(flops._MODEL_CHUNKS)  # how the MoE CUDA graphs ran, when there are any
    if graphs:
        print_rank_0(graphs)
    return 0
