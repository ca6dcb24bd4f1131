"""Run ``pretrain_glm5_vlm.py`` (or a script built on ``megatron_glm5.training``) as a user would, and read what it
wrote: TensorBoard scalars and torch_dist checkpoints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Dict, List, Optional, Tuple, Union

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = os.path.join(REPO, "pretrain_glm5_vlm.py")

# a tiny, fast run: the tiny preset (4 layers, MoE, DSA, KDA, vision, MTP), short rows
TINY = ["--model-preset", "glm5-tiny", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-2", "--lr-warmup-iters", "2", "--min-lr", "1e-3", "--log-interval", "1", "--eval-iters", "0"]


def user_pythonpath() -> str:
    """``PYTHONPATH`` for a program run as in the user's environment: the repository, then this process's path less
    the test run's own folder (``$MEGATRON_GLM5_TEST_SITE``: flash-linear-attention, which the README's environment
    does not hold and which megatron-core's hybrid models would otherwise import into every trainer, ~3 s each)."""
    site = os.environ.get("MEGATRON_GLM5_TEST_SITE")
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and not (site and os.path.abspath(p) == os.path.abspath(site))]
    return os.pathsep.join([REPO] + rest)


def run(args: List[str], script: str = PRETRAIN, timeout: int = 900, env: Optional[dict] = None,
        nproc: int = 1) -> subprocess.CompletedProcess:
    """Run the training script in a fresh process (``torchrun`` with gloo when ``nproc`` > 1), in the user's
    environment (:func:`user_pythonpath`)."""
    full_env = dict(os.environ, PYTHONPATH=user_pythonpath(),
                    PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # set by in-process tests
        full_env.pop(var, None)
    full_env.update(env or {})
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script]
    else:
        cmd = [sys.executable, script]
    # a session of its own: a run that kills its process group (the interrupted-save test) takes only itself down
    return subprocess.run(cmd + list(args), cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)


def error_lines(proc: subprocess.CompletedProcess) -> List[str]:
    """The non-empty stderr lines (``run`` silences Python warnings, so these are the program's own)."""
    return [ln for ln in proc.stderr.splitlines() if ln.strip()]


_ITERATION_LINE = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|(.*)$")
_SAVED_LINE = re.compile(r"\bsuccessfully saved checkpoint from iteration\s+(\d+)\b")


def log_iterations(text: str) -> List[Dict[str, Union[int, float, str]]]:
    """Megatron-LM's training log lines (``iteration    4/   10 | consumed samples:   16 | lm loss: 1.2E+00 | ...``)
    of ``text``, in order, as ``{"iteration": 4, "train iters": 10, "consumed samples": 16.0, "lm loss": 1.2, ...}``:
    every ``name: value`` field, its value a float where it reads as one (whatever the column padding)."""
    out = []
    for line in text.splitlines():
        m = _ITERATION_LINE.search(line)
        if m is None:
            continue
        fields: Dict[str, Union[int, float, str]] = {"iteration": int(m.group(1)), "train iters": int(m.group(2))}
        for part in m.group(3).split("|"):
            name, sep, value = part.rpartition(":")
            if not sep or not name.strip():
                continue
            value = value.strip()
            try:
                fields[name.strip()] = float(value)
            except ValueError:
                fields[name.strip()] = value
        out.append(fields)
    return out


def saved_iteration(line: str) -> Optional[int]:
    """The iteration of Megatron-LM's ``successfully saved checkpoint from iteration N ...`` line, else None."""
    m = _SAVED_LINE.search(line)
    return None if m is None else int(m.group(1))


def scalars(tb_dir: str) -> Dict[str, List[Tuple[int, float]]]:
    """{tag: [(iteration, value), ...]} from the TensorBoard event files under ``tb_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_dist_checkpoint(path: str) -> Dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint directory (global, unsharded), read without a process group."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(path).read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if isinstance(v, TensorStorageMetadata)}
    load(sd, storage_reader=FileSystemReader(path), no_dist=True)
    return sd
