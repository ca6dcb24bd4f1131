"""Several converter processes writing one torch_dist checkpoint together (``--workers N``).

The parent spawns ``N`` processes forming a gloo group; each builds the meta model, owns a byte-balanced share of
the tensors (``replica_id`` 0 on its owner) and writes its own ``__{rank}_*.distcp`` files. Progress (bytes) and the
outcome come back over a queue; the first failure is re-raised in the parent as one line (input errors keep their
:class:`CheckpointError` type, so the CLI exits 2), the other workers are terminated.
"""

from __future__ import annotations

import gc
import os
import queue as queue_mod
from typing import Dict, Optional

import torch

from megatron_glm5.checkpoint.cpus import usable_cpus
from megatron_glm5.errors import CheckpointError, one_line


class WorkerInputError(CheckpointError):
    """An input error raised in a conversion worker."""


def _worker_entry(rank: int, world: int, port: int, hf_dir: str, out_dir: str, dtype_name: str, q,
                  final_dir: Optional[str], mtp: bool, mtp_init: bool, threads: int) -> None:
    """One of ``workers`` processes: gloo group of ``world``, meta model, write the owned tensors."""
    from megatron_glm5.errors import quiet_library_warnings

    quiet_library_warnings()
    # the conversion is CPU work over a gloo group: GPUs stay hidden (a worker rank is no GPU index; with CUDA
    # visible, rank 2 of 3 on a one-GPU machine asked for device 2 and failed)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), CUDA_VISIBLE_DEVICES="")
    torch.set_num_threads(max(1, usable_cpus() // (world * threads)))
    from megatron_glm5.lean_import import import_megatron_without_compile

    if import_megatron_without_compile():  # (no model code runs here: 2 s less start-up per worker)
        gc.freeze()  # the imported objects are never garbage: full collections skip them
    from megatron_glm5.checkpoint.dcp_save import save_streaming
    from megatron_glm5.checkpoint.hf_io import HFCheckpointReader
    from megatron_glm5.checkpoint.lazy_sources import DTYPES, conversion_sources
    from megatron_glm5.initialize import destroy_megatron, initialize_megatron

    code = 0
    try:
        initialize_megatron(backend="gloo")
        reader = HFCheckpointReader(hf_dir, verify_checksums=False)  # the parent verified them
        _, model, sources = conversion_sources(hf_dir, DTYPES[dtype_name], mtp, mtp_init)
        stats = save_streaming(model, sources, reader, out_dir, on_bytes=lambda n: q.put(("bytes", rank, n)),
                               final_dir=final_dir, threads=threads)
        reader.close()
        q.put(("done", rank, stats))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which prints the one error
        q.put(("error", rank, isinstance(e, (CheckpointError, OSError)), one_line(e)))
        code = 1
    finally:
        destroy_megatron()
    if code:
        raise SystemExit(code)  # a quiet non-zero exit (no second traceback on the console)


def run_workers(workers: int, hf_dir: str, out_dir: str, dtype_name: str, on_bytes, final_dir: Optional[str],
                mtp: bool, mtp_init: bool, threads: int) -> Dict:
    """Run the conversion in ``workers`` processes; returns the summed byte counts and every file's digest."""
    import torch.multiprocessing as tmp

    from megatron_glm5.initialize import free_port

    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    # the workers import megatron-core before any code of theirs runs: keep its import-time notices (no Transformer
    # Engine / Apex, deprecations) off the console, as the CLI does for itself
    saved = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = "ignore::UserWarning" + ("," + saved if saved else "")
    try:
        pc = tmp.start_processes(_worker_entry, args=(workers, free_port(), hf_dir, out_dir, dtype_name, q,
                                                      final_dir, mtp, mtp_init, threads),
                                 nprocs=workers, join=False, start_method="spawn")
    finally:
        if saved is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = saved
    stats, errors = {}, []

    def drain(block: float = 0.0):
        while True:
            try:
                msg = q.get(timeout=block) if block else q.get_nowait()
            except queue_mod.Empty:
                return
            block = 0.0
            if msg[0] == "bytes" and on_bytes is not None:
                on_bytes(msg[2])
            elif msg[0] == "done":
                stats[msg[1]] = msg[2]
            elif msg[0] == "error":
                errors.append(msg)

    try:
        while True:
            drain(0.2)
            try:
                if pc.join(timeout=0.1):
                    break
            except Exception as e:  # noqa: BLE001 - a worker died; torch has terminated the others
                drain(0.5)
                inputs = [m for m in errors if m[2]]
                if inputs:
                    raise WorkerInputError(inputs[0][3]) from None
                if errors:
                    raise RuntimeError(f"conversion worker {errors[0][1]} failed: {errors[0][3]}") from None
                raise RuntimeError(f"conversion worker failed: {one_line(e)}") from None
        drain()
    finally:
        for p in pc.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
    if len(stats) != workers:
        raise RuntimeError(f"only {len(stats)} of {workers} conversion workers reported completion")
    digests = {}
    for s in stats.values():
        digests.update(s["digests"])
    return {"bytes": sum(s["bytes"] for s in stats.values()), "hf_reads": sum(s["hf_reads"] for s in stats.values()),
            "total_bytes": stats[0]["total_bytes"], "digests": digests,
            "write_span": (min(s["write_span"][0] for s in stats.values()),
                           max(s["write_span"][1] for s in stats.values()))}
