"""The training entry: ``run_pretrain`` hands the providers of ``pretrain_glm5_vlm.py`` to Megatron-LM's
``megatron.training.pretrain``.

Before Megatron-LM starts: on a machine without CUDA the CPU redirects (:mod:`megatron_glm5.cpu_compat`), this
project's megatron-core changes (:func:`megatron_glm5.initialize.install_patches`), this model's hooks into the
trainer (:mod:`megatron_glm5.training.megatron_hooks`, :mod:`megatron_glm5.training.flops`), then the flags
(:func:`megatron_glm5.training.arguments.parse_args`: one line and exit 2 on a bad one). A run stopped by too many
non-finite steps in a row exits 1 with one line; Ctrl-C (SIGINT) ends it with one line and exit 130.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Callable, List, Optional


def _quiet_megatron() -> None:
    """megatron-core's import-time and set-up warnings (no Transformer Engine, Apex, ...) are not the user's
    business; its own logging stays at WARNING for real problems."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # data-loader workers
    logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found"


def _last_checkpoint(save: Optional[str]) -> str:
    """'; the last checkpoint (iteration N) in SAVE is intact' when SAVE's tracker names one."""
    from megatron_glm5.checkpoint.megatron_layout import CheckpointDirError, read_tracker

    try:
        folder = read_tracker(save) if save else None
    except CheckpointDirError:
        return ""
    if folder is None:
        return ""
    last = str(int(folder[len("iter_"):])) if folder.startswith("iter_") else folder
    return f"; the last checkpoint (iteration {last}) in {save} is intact"


def run_pretrain(datasets_provider: Callable, model_provider: Callable, forward_step: Callable,
                 argv: Optional[List[str]] = None, prog: str = "pretrain_glm5_vlm.py",
                 program_start: Optional[float] = None) -> int:
    """Run Megatron-LM's ``pretrain`` with these providers; returns the exit status. ``program_start``: when the
    program started (``time.time()``), from which ``--exit-duration-in-mins`` counts."""
    import time

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

    from megatron_glm5.checkpoint.errors import CheckpointError
    from megatron_glm5.training import flops, megatron_hooks
    from megatron_glm5.training.arguments import parse_args

    megatron_hooks.install()
    flops.install()
    if "RANK" not in os.environ:  # plain `python pretrain_glm5_vlm.py`: a world of one process
        from megatron_glm5.initialize import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()))
    args = parse_args(argv, prog)
    from megatron.training.utils import print_rank_0

    if os.environ.get("MEGATRON_GLM5_CHECK_ARGS") == "1":  # the examples' DRY_RUN: the flags only
        print(f"{prog}: the arguments pass Megatron-LM's checks and this model's for a world of {args.world_size} "
              f"(TP {args.tensor_model_parallel_size}, PP {args.pipeline_model_parallel_size}, EP "
              f"{args.expert_model_parallel_size}, CP {args.context_parallel_size}, DP {args.data_parallel_size})")
        return 0
    if args.save:
        megatron_hooks.install_checkpoint_writer_queue()
    print_rank_0(megatron_hooks.describe())
    if args.test_kill_during_save is not None:
        megatron_hooks.install_test_kill_during_save(args.test_kill_during_save)
    from megatron.training.training import set_startup_timestamps

    set_startup_timestamps(program_start=program_start, main_entry=time.time())
    cfg = pretrain_cfg_container_from_args(args)
    try:
        pretrain(cfg, datasets_provider, ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
    except megatron_hooks.TrainingStopped as e:
        print(f"{prog}: error: {e}{_last_checkpoint(args.save)}", file=sys.stderr, flush=True)
        return 1
    except CheckpointError as e:  # a checkpoint --load / --pretrained-checkpoint cannot use (checkpoint_checks)
        if os.environ.get("MEGATRON_GLM5_TRACEBACK") == "1":
            raise
        if os.environ.get("RANK", "0") == "0":
            print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted{_last_checkpoint(args.save)}", file=sys.stderr, flush=True)
        return 130
    return 0
