"""Helpers shared by the test modules: relative differences, a loopback port for a gloo rendezvous, and running a
callable on N spawned gloo ranks.

* :func:`rel` (relative L2 difference, computed in fp64) and :func:`rel_max` (largest absolute difference over the
  reference's largest value).
* :func:`free_port`: a free loopback TCP port. Under pytest-xdist each worker takes its ports from a range of its own
  below the kernel's ephemeral range, so two workers (or the ephemeral ports of one worker's gloo connections) can
  never be handed the same port between its pick and its bind.
* :func:`spawn`: run ``fn(*args)`` in ``world`` spawned processes (gloo, ``RANK`` / ``WORLD_SIZE`` / ``MASTER_*`` set,
  one thread each); returns every rank's return value, in rank order. A failing rank fails the call with its
  traceback.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, List

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` (L2 over all elements, fp64; ``b`` all zero counts as ``1e-30``)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|b|``; 0 when both are all zero (inf when only ``b`` is)."""
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max()
    if scale == 0:
        return 0.0 if a.abs().max() == 0 else float("inf")
    return float((a - b).abs().max() / scale)


# ----------------------------------------------------------------------------------------------- ports
# xdist worker gwN draws from [_PORT_BASE + N * _PORT_SPAN, _PORT_BASE + (N + 1) * _PORT_SPAN): below Linux's
# default ephemeral range (32768-60999), so neither another worker's pick nor any process's outgoing connection
# lands on it
_PORT_BASE, _PORT_SPAN = 10000, 1000
_port_cycle = None


def _worker_ports() -> "itertools.cycle | None":
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not worker[2:].isdigit():
        return None
    index = int(worker[2:])
    lo = _PORT_BASE + index * _PORT_SPAN
    if lo + _PORT_SPAN > 32768:
        return None
    start = random.randrange(_PORT_SPAN)
    return itertools.cycle([lo + (start + i) % _PORT_SPAN for i in range(_PORT_SPAN)])


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free loopback TCP port (see the module docstring for the xdist ranges)."""
    global _port_cycle
    if _port_cycle is None:
        _port_cycle = _worker_ports() or False
    if _port_cycle:
        for _ in range(_PORT_SPAN):
            port = next(_port_cycle)
            if _bindable(port):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------- processes
def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, out_dir: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    # megatron's jit_fuser is torch.compile: compiling on every spawned CPU rank costs seconds and changes nothing
    # the comparison needs (the one-rank reference runs the same eager ops)
    import torch._dynamo as dynamo

    dynamo.config.disable = True
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        result = fn(*args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # noqa: BLE001 - reported to the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        from megatron_glm5.initialize import destroy_megatron

        destroy_megatron()


def spawn(fn: Callable, world: int, *args, timeout: float = 900) -> List[Any]:
    """Run ``fn(*args)`` on ``world`` gloo ranks (spawned processes; ``fn`` must be importable, i.e. defined at
    module level; it reads its rank from ``$RANK``). Returns the ranks' results in rank order; raises with the first
    failing rank's traceback."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_worker, args=(world, free_port(), fn, args, out_dir), nprocs=world, join=False,
                                 start_method="spawn")
        try:
            deadline = time.monotonic() + timeout
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    raise TimeoutError(f"{world} ranks did not finish within {timeout} s")
        except TimeoutError:
            raise
        except Exception as e:  # noqa: BLE001 - prefer the rank's own traceback
            for r in range(world):
                p = os.path.join(out_dir, f"rank{r}.pt")
                if os.path.exists(p):
                    res = torch.load(p, weights_only=False)
                    if not res["ok"]:
                        raise RuntimeError(f"rank {r} failed:\n{res['error']}") from None
            raise e
        results = []
        for r in range(world):
            res = torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            if not res["ok"]:
                raise RuntimeError(f"rank {r} failed:\n{res['error']}")
            results.append(res["result"])
        return results
