#!/usr/bin/env python
"""Test aid: ``pretrain_glm5_vlm.py`` killed with SIGKILL at a chosen point inside the checkpoint save of one
iteration, for the interrupted-save tests (tests/test_save_guard.py).

``GLM5_TEST_KILL_SAVE=ITER:EVENT``: from the first file opened for writing in ``SAVE/iter_ITER`` on, every write call
to a file under ``--save`` and every rename into it is an event; the process kills itself (SIGKILL) just before
event number EVENT (1-based), in whichever thread makes it (the torch_dist writer's threads included). EVENT 0 only
counts: the number of events is written to ``GLM5_TEST_KILL_SAVE_COUNT`` when the process exits. What is written is
the real save of Megatron-LM's trainer; only the process dies.
"""

from __future__ import annotations

import atexit
import builtins
import io
import os
import signal
import sys
import threading

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _save_root(argv):
    for i, a in enumerate(argv):
        if a == "--save":
            return os.path.realpath(argv[i + 1])
        if a.startswith("--save="):
            return os.path.realpath(a.split("=", 1)[1])
    raise SystemExit("save_fault_run.py: needs --save")


def install(root: str, iteration: int, kill_at: int, count_file: str | None) -> None:
    state = {"armed": False, "events": 0}
    lock = threading.Lock()
    folder = os.path.join(root, f"iter_{iteration:07d}")

    def under(path, where) -> bool:
        try:
            p = os.path.realpath(os.fsdecode(path))
        except TypeError:
            return False
        return p == where or p.startswith(where + os.sep)

    def event():
        with lock:
            if not state["armed"]:
                return
            state["events"] += 1
            if state["events"] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    class Counted:
        """A file opened for writing under --save: each write call is an event."""

        def __init__(self, f):
            self._f = f

        def write(self, data):
            event()
            return self._f.write(data)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def __iter__(self):
            return iter(self._f)

    real_open = builtins.open

    def open_(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if isinstance(file, int) or not any(c in mode for c in "wax+") or not under(file, root):
            return f
        if under(file, folder):
            state["armed"] = True
        return Counted(f) if state["armed"] else f

    builtins.open = open_
    io.open = open_
    for name in ("replace", "rename"):
        real = getattr(os, name)

        def renamed(src, dst, *args, _real=real, **kwargs):
            if under(dst, root):
                event()
            return _real(src, dst, *args, **kwargs)

        setattr(os, name, renamed)
    if count_file:
        atexit.register(lambda: real_open(count_file, "w").write(str(state["events"])))


def main() -> int:
    spec = os.environ["GLM5_TEST_KILL_SAVE"]
    iteration, kill_at = (int(x) for x in spec.split(":"))
    install(_save_root(sys.argv[1:]), iteration, kill_at, os.environ.get("GLM5_TEST_KILL_SAVE_COUNT"))
    sys.path.insert(0, REPO)
    import pretrain_glm5_vlm

    return pretrain_glm5_vlm.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
