"""Run ``pretrain_glm5_vlm.py`` (or a script built on ``megatron_glm5.training``) as a user would, and read what it
wrote: TensorBoard scalars and torch_dist checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = os.path.join(REPO, "pretrain_glm5_vlm.py")

# a tiny, fast run: the tiny preset (4 layers, MoE, DSA, KDA, vision, MTP), short rows
TINY = ["--model-preset", "glm5-tiny", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-2", "--lr-warmup-iters", "2", "--min-lr", "1e-3", "--log-interval", "1", "--eval-iters", "0"]


def run(args: List[str], script: str = PRETRAIN, timeout: int = 900, env: Optional[dict] = None,
        nproc: int = 1) -> subprocess.CompletedProcess:
    """Run the training script in a fresh process (``torchrun`` with gloo when ``nproc`` > 1)."""
    full_env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
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
