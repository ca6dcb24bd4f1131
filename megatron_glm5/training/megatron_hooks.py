"""What this model adds to Megatron-LM's trainer, in one place: each hook is installed by the training entry
(:func:`install`, each through its record of :mod:`megatron_glm5.extensions`), listed by :func:`describe`, and
printed at start-up; a megatron-core outside
:data:`~megatron_glm5.mcore_version.TRAINER_VERSIONS` is refused with one line before anything is installed.

* **Non-finite steps skipped and counted.** megatron-core's ``ChainedOptimizer.step`` applies an update whatever its
  gradient norm (its ``grad_norm_skip_threshold`` compares ``norm > threshold``, false for NaN) and whatever the
  updated weights hold. The optimizer the trainer builds gets a step that leaves parameters, optimizer state and
  learning-rate schedule untouched when the gradient norm is NaN/inf or when the update would make a weight NaN/inf
  on any rank (proven from bounds, else tried on copies: :func:`_skip_nonfinite_steps`); such a step is counted
  (``update_successful`` False: Megatron-LM's ``number of skipped iterations``) and
  ``--max-consecutive-skipped-iterations`` in a row end the run (:class:`TrainingStopped`, exit 1). A model that
  holds a NaN/inf weight anyway (a buffer such as the expert bias) is never saved: the run stops instead.
* **fp32 islands under bf16** get param groups of their own (``ParamKey(attr='keep_fp32')``), so that fp32 master
  weights pair with the right parameters; a resume pairs them with their own saved groups
  (:func:`~megatron_glm5.training.optimizer.identify_fp32_island_groups`), and without the distributed optimizer
  megatron-core's bf16 optimizer maps its state to the checkpoint in the torch optimizer's parameter order, those
  groups included (:func:`~megatron_glm5.training.optimizer.map_fp32_params_in_checkpoints`).
* **--fused-optimizer-step** (default on CUDA): the distributed optimizer's clip, Adam step and copy into the
  model weights in one pass per main weight (:mod:`megatron_glm5.training.fused_optimizer_step`).
* **--torch-fused-adam**: torch's fused Adam kernel for megatron-core's torch Adam fallback; SGD gets a state
  layout (megatron-core has none), so that its checkpoints load.
* **Every checkpoint carries its architecture, layout and manifest.** ``hf_config.json`` (the run's HF config) and
  ``parallel_layout.json`` (parallel sizes, optimizer-state format) are written into each checkpoint folder
  Megatron-LM saves, and megatron-core's ``integrity.json`` (SHA-256 of every file) after them: the HF exporter
  reads the first, the ``--load`` checks all three (:mod:`megatron_glm5.training.checkpoint_checks`).
* **Checkpoint loads are checked.** ``--load`` / ``--pretrained-checkpoint``: the files against the manifest, the
  saved run's optimizer state against this run's flags, the checkpoint's tensors against the model's; one line.
* **The checkpoint writer's helper process dies with the trainer.** megatron-core's torch_dist writer keeps its
  results queue in a ``multiprocessing`` manager process, started on the first save, that inherits the trainer's
  stdout / stderr and outlives it when the trainer is killed (a ``| tee`` or a launcher then waits forever). The
  queue is made here, by a manager whose process gets SIGKILL when the trainer dies (``PR_SET_PDEATHSIG``), leaves
  Ctrl-C and SIGTERM to the trainer (a signal to the whole process group, as Slurm sends, would otherwise end it
  before the exit save) and writes to /dev/null.
* **The dataset helpers are not rebuilt.** ``initialize_megatron`` runs ``make`` in megatron-core's ``datasets``
  folder to build its C++ index helpers; the released wheel ships them built (``helpers_cpp``) and no Makefile, so
  the ``make`` fails and the run exits. The build is skipped when ``helpers_cpp`` imports.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

_INSTALLED: List[str] = []


class TrainingStopped(RuntimeError):
    """The run cannot go on (too many skipped iterations in a row); the message names the iteration."""


def _any_rank(flag: bool) -> bool:
    """``flag`` or'ed over every rank (a MAX all-reduce over the world; ``flag`` itself without a process group or
    on one rank)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def _skip_nonfinite_steps(optimizer, max_consecutive: int):
    """Make ``optimizer`` (megatron-core's ``ChainedOptimizer``) skip a step whose gradient norm is NaN/inf or whose
    update would make a weight NaN/inf (or too large for the model's bf16 / fp16 weights) on any rank.

    ``ChainedOptimizer.step`` computes the norm with ``get_grad_norm`` and then calls ``step_with_ready_grads``; the
    norm is recorded on the way and the update refused when it is not finite. Otherwise
    :class:`~megatron_glm5.training.optimizer.WeightRangeGuard` decides whether the update keeps the weights in range:
    from bounds on the weights, moments and gradients in almost every step (no pass over the tensors), else by
    measuring them, else by trying the update parameter by parameter on copies (the optimizer's own arithmetic,
    nothing changed). When it would put a weight out of range on any rank (one all-reduce over all ranks: the
    distributed optimizer's main weights are sharded) the step is refused on every rank before anything is written.
    A skipped step returns False (``update_successful``: Megatron-LM counts it in 'number of skipped iterations' and
    leaves the learning-rate schedule); ``max_consecutive`` in a row raise :class:`TrainingStopped`."""
    from megatron_glm5.training.optimizer import WeightRangeGuard, weight_limit

    get_grad_norm, step_with_ready_grads = optimizer.get_grad_norm, optimizer.step_with_ready_grads
    state = {"norm": None, "in_a_row": 0, "updated": 0, "skipped": 0}
    guard = WeightRangeGuard(optimizer, weight_limit(getattr(optimizer, "config", None)))

    def recorded_grad_norm():
        state["norm"] = get_grad_norm()
        return state["norm"]

    def skipped(reason: str) -> bool:
        from megatron.training import get_args
        from megatron.training.utils import print_rank_0

        state["in_a_row"] += 1
        state["skipped"] += 1
        iteration = get_args().curr_iteration + 1
        print_rank_0(f"iteration {iteration}: {reason}: update skipped ({state['in_a_row']} in a row)")
        if state["in_a_row"] >= max_consecutive:
            raise TrainingStopped(f"stopped at iteration {iteration}: {state['in_a_row']} iterations in a row had a "
                                  f"NaN/inf loss, gradient norm or updated weight "
                                  f"(--max-consecutive-skipped-iterations {max_consecutive})")
        return False

    def checked_step_with_ready_grads():
        norm = state["norm"]
        if norm is not None and not math.isfinite(float(norm)):
            return skipped(f"gradient norm {float(norm)}")
        if _any_rank(not guard.keeps_within(norm)):
            return skipped("the update makes weights NaN/inf")
        state["in_a_row"] = 0
        updated = step_with_ready_grads()
        state["updated"] += bool(updated)
        return updated

    optimizer.get_grad_norm = recorded_grad_norm
    optimizer.glm5_steps = state  # this run's updated / skipped step counts (the warm-up's save reads them)
    optimizer.step_with_ready_grads = checked_step_with_ready_grads
    return optimizer


def _glm5_get_megatron_optimizer(upstream):
    def get_megatron_optimizer(config, model_chunks, config_overrides=None, **kwargs):
        from megatron.core.optimizer.optimizer_config import ParamKey
        from megatron.training import get_args

        from megatron_glm5.training.optimizer import (FP32_ISLAND_KEY, identify_fp32_island_groups,
                                                      map_fp32_params_in_checkpoints, optimizer_parts, sgd_init_state,
                                                      use_torch_fused_adam)

        args = get_args()
        if config.bf16:
            config_overrides = dict(config_overrides or {})
            config_overrides[ParamKey(attr="keep_fp32")] = {FP32_ISLAND_KEY: True}
            identify_fp32_island_groups()
        optimizer = upstream(config, model_chunks, config_overrides=config_overrides, **kwargs)
        for part in optimizer_parts(optimizer):
            if config.optimizer == "sgd" and getattr(part, "init_state_fn", None) is None:
                part.init_state_fn = sgd_init_state  # megatron-core has none for SGD: its checkpoints could not load
        map_fp32_params_in_checkpoints(optimizer)  # the fp32 islands' groups beside the bf16 ones
        from megatron.training.utils import print_rank_0

        if args.fused_optimizer_step:
            from megatron_glm5.training import fused_optimizer_step

            fused, refused = fused_optimizer_step.install(optimizer)
            line = (f"--fused-optimizer-step: {fused} param groups take the clip coefficient, Adam and the model "
                    f"weight write in one pass per main weight")
            print_rank_0(line + "".join(f"; one part left as it was: {r}" for r in refused))
        if args.torch_fused_adam:
            print_rank_0(f"--torch-fused-adam: {use_torch_fused_adam(optimizer)} param groups run torch's fused Adam")
        if args.gradient_accumulation_fusion:
            from megatron_glm5.mcore_extensions import describe_fusion

            print_rank_0(describe_fusion(model_chunks))
        return _skip_nonfinite_steps(optimizer, args.max_consecutive_skipped_iterations)

    return get_megatron_optimizer


def _nonfinite_weight(model) -> str:
    """The name of this rank's first model parameter or floating buffer (the expert bias) holding a NaN/inf ('' if
    none): one fused max-magnitude pass (:func:`~megatron_glm5.training.optimizer.max_magnitude`); the name is looked
    up only when there is one."""
    import math

    from megatron_glm5.training.optimizer import max_magnitude

    named = [(name, t.detach()) for chunk in model
             for name, t in list(chunk.named_parameters()) + list(chunk.named_buffers())
             if t.is_floating_point() and t.numel()]
    if math.isfinite(max_magnitude([t for _, t in named])):
        return ""
    return next(name for name, t in named if not math.isfinite(max_magnitude([t])))


def _untrained_warmup(iteration: int, optimizer) -> str:
    """Why the save of ``iteration`` must not be the indexer warm-up's last checkpoint ('' when it may be): this run
    is the warm-up (``--dsa-indexer-warmup N``), ``iteration`` is N (the checkpoint the sparse stage starts from)
    and every step of this run was skipped (NaN/inf), so the stage did not train. The counts are the same on every
    rank (a step is skipped on all ranks or none)."""
    from megatron.training import get_args

    steps = getattr(optimizer, "glm5_steps", None)
    if not steps:  # no step guard: not the trainer's optimizer (Megatron-LM's args may not exist either)
        return ""
    run = get_args()
    if not (getattr(run, "dsa_indexer_warmup_stage", False) and iteration == run.dsa_indexer_warmup):
        return ""
    if steps["updated"] or not steps["skipped"]:
        return ""
    return (f"iteration {iteration}: every iteration of this run's indexer warm-up ({steps['skipped']}) was skipped "
            "(NaN/inf loss, gradient norm or updated weight): the warm-up stage did not train; its checkpoint not "
            "saved")


def refuse_nonfinite_save(upstream):
    """Megatron-LM's ``save_checkpoint``, refusing (:class:`TrainingStopped`, on every rank) to save a model that
    holds a NaN/inf weight on any rank, or the indexer warm-up's last checkpoint when none of its steps trained
    (:func:`_untrained_warmup`): the previous checkpoint stays the last one."""

    def save_checkpoint(iteration, model, *args, **kwargs):
        bad = _nonfinite_weight(model if isinstance(model, (list, tuple)) else [model])
        if _any_rank(bool(bad)):
            where = f" ({bad})" if bad else ""
            raise TrainingStopped(f"iteration {iteration}: the weights hold NaN/inf{where}; checkpoint not saved")
        untrained = _untrained_warmup(iteration, args[0] if args else kwargs.get("optimizer"))
        if untrained:
            raise TrainingStopped(untrained)
        return upstream(iteration, model, *args, **kwargs)

    return save_checkpoint


def _compile_helpers_unless_shipped(upstream):
    def compile_helpers():
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            upstream()

    return compile_helpers


class _Glm5DistCheckpointing:
    """``megatron.core.dist_checkpointing`` as Megatron-LM's checkpointing sees it.

    ``save`` has megatron-core save with its integrity manifest (as ``--verify-integrity`` does); its finalize step
    (:meth:`save_integrity_manifest`, once the files are complete, sync or async, before Megatron-LM moves the
    tracker) writes the run's architecture (``hf_config.json``, what the exporter and the ``--load`` check read) and
    parallel layout (``parallel_layout.json``) into the checkpoint folder, then ``integrity.json`` over every file.
    Under ``--test-kill-during-save N`` the save of iteration N writes its files, then the process is killed
    (SIGKILL) before Megatron-LM moves its tracker.

    ``load_common_state_dict`` / ``load`` first verify the checkpoint's files against its manifest and the folder
    (:func:`~megatron_glm5.training.checkpoint_checks.verify_checkpoint_files`), the saved run's arguments against
    this run's (:func:`~megatron_glm5.training.checkpoint_checks.check_resume_state`) and the checkpoint's tensors
    against this model's (:func:`~megatron_glm5.training.checkpoint_checks.check_tensors_match`); any failure to
    load is one :class:`~megatron_glm5.checkpoint.errors.CheckpointError` line naming the checkpoint. (What is read
    is unpickled safely by :func:`megatron_glm5.checkpoint.safe_load.install_dcp_read_guards`.)"""

    def __init__(self, module, kill_at: Optional[int] = None):
        self._module, self.kill_at = module, kill_at
        self._records: dict = {}  # checkpoint folder -> {file name: JSON record} written by its integrity step

    def __getattr__(self, name):
        return getattr(self._module, name)

    def save(self, sharded_state_dict, checkpoint_dir, *args, **kwargs):
        import os
        import signal

        from megatron.training import get_args

        from megatron_glm5.checkpoint.hf_to_mcore import HF_CONFIG_FNAME
        from megatron_glm5.training.checkpoint_checks import LAYOUT_FNAME, layout_record

        run = get_args()
        if getattr(run, "hf_config_dict", None):
            self._records[os.path.abspath(checkpoint_dir)] = {HF_CONFIG_FNAME: run.hf_config_dict,
                                                              LAYOUT_FNAME: layout_record(run)}
        if "verify_integrity" in kwargs:
            kwargs["verify_integrity"] = True
        out = self._module.save(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        if self.kill_at is not None and self.kill_at in (run.curr_iteration + 1, run.iteration):
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    def save_integrity_manifest(self, checkpoint_dir) -> None:
        """megatron-core's integrity finalize step (rank 0, once the checkpoint's files are complete, before the
        tracker moves): this save's ``hf_config.json`` and ``parallel_layout.json``, then ``integrity.json`` over
        every file (:func:`megatron_glm5.checkpoint.checksums.write_integrity_manifest`)."""
        import json
        import os

        from megatron_glm5.checkpoint.checksums import write_integrity_manifest

        for name, record in self._records.pop(os.path.abspath(checkpoint_dir), {}).items():
            tmp = os.path.join(checkpoint_dir, name + ".tmp")
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(record, fh, indent=2)
            os.replace(tmp, os.path.join(checkpoint_dir, name))
        write_integrity_manifest(str(checkpoint_dir))

    def load_common_state_dict(self, checkpoint_dir, *args, **kwargs):
        from megatron.training import global_vars

        from megatron_glm5.training.checkpoint_checks import check_resume_state, verify_checkpoint_files

        run = getattr(global_vars, "_GLOBAL_ARGS", None)  # None while Megatron-LM reads --use-checkpoint-args
        verify_checkpoint_files(str(checkpoint_dir), _trusted(run))
        state = _load_or_one_line(checkpoint_dir, self._module.load_common_state_dict, checkpoint_dir, *args,
                                  **kwargs)
        if run is not None:
            check_resume_state(str(checkpoint_dir), state, run)
        return state

    def load(self, sharded_state_dict, checkpoint_dir, *args, **kwargs):
        from megatron.training import global_vars

        from megatron_glm5.training.checkpoint_checks import check_tensors_match, verify_checkpoint_files

        verify_checkpoint_files(str(checkpoint_dir), _trusted(getattr(global_vars, "_GLOBAL_ARGS", None)))
        check_tensors_match(sharded_state_dict, str(checkpoint_dir))
        if "verify_integrity" in kwargs:
            kwargs["verify_integrity"] = False  # verified above, integrity.json or the converter's checksums.sha256
        return _load_or_one_line(checkpoint_dir, self._module.load, sharded_state_dict, checkpoint_dir, *args,
                                 **kwargs)


def _trusted(run) -> bool:
    """Whether the run (Megatron-LM's args, or None before they are set) loads a checkpoint without a manifest."""
    if run is None:
        import sys

        return "--trust-unverified-checkpoint" in sys.argv
    return bool(getattr(run, "trust_unverified_checkpoint", False))


def _load_or_one_line(checkpoint_dir, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, a megatron-core checkpoint load; a failure becomes one CheckpointError line: the
    CheckpointError raised inside torch DCP's wrapping (``CheckpointException``), or the error named briefly."""
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_glm5.errors import CheckpointError, one_line

    try:
        return fn(*args, **kwargs)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - CheckpointException is a BaseException
        inner = _checkpoint_error_in(e)
        if inner is not None:
            raise inner from None
        if isinstance(e, CheckpointException):
            e = next((exc for exc, _ in e.failures.values() if isinstance(exc, BaseException)), e)
        raise CheckpointError(f"{checkpoint_dir}: cannot be loaded ({type(e).__name__}: {one_line(e, 300)})") from e


def _checkpoint_error_in(e: BaseException):
    """The CheckpointError ``e`` is or wraps (torch DCP's ``CheckpointException.failures``, causes), or None."""
    from megatron_glm5.errors import CheckpointError

    seen = set()
    todo = [e]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CheckpointError):
            return e
        todo += [e.__cause__, e.__context__]
        todo += [exc for exc, _ in (getattr(e, "failures", None) or {}).values()] if isinstance(
            getattr(e, "failures", None), dict) else []
    return None


def install_test_kill_during_save(iteration: int) -> None:
    """Testing aid (``--test-kill-during-save``): die in the middle of the checkpoint save of ``iteration``."""
    from megatron_glm5.mcore_version import TRAINER_VERSIONS, require_version

    require_version(TRAINER_VERSIONS, "--test-kill-during-save (training/megatron_hooks.py)")
    from megatron.training import checkpointing

    checkpointing.dist_checkpointing.kill_at = iteration


def _die_with_parent() -> None:
    """Initializer of the writer's manager process: killed with its parent, no stdout / stderr of the trainer's."""
    import ctypes
    import os
    import signal

    # Ctrl-C and a launcher's SIGTERM (Slurm signals the whole process group) are the trainer's to answer: it may
    # still save (--exit-signal-handler) through this process, which ends with it (PR_SET_PDEATHSIG)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        pass
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)


def install_checkpoint_writer_queue() -> None:
    """Make megatron-core's checkpoint-writer results queue (see the module docstring); for runs that save."""
    from megatron_glm5 import extensions

    record = extensions.BY_NAME["checkpoint_writer_queue"]
    extensions.guard(record)
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "missing") is not None:  # made already, or another version
        return
    import multiprocessing
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=_die_with_parent)
    _MANAGERS.append(manager)
    extensions.apply(record, manager.Queue())
    _INSTALLED.append("checkpoint writer: its queue process dies with the trainer, without its stdout")


_MANAGERS: list = []


def install() -> None:
    """Install the hooks into ``megatron.training`` (idempotent); refuses (one line,
    :class:`~megatron_glm5.mcore_version.UnsupportedMegatronCore`) a megatron-core outside
    :data:`~megatron_glm5.mcore_version.TRAINER_VERSIONS`."""
    from megatron_glm5 import extensions

    extensions.guard(extensions.BY_NAME["compile_helpers"])
    from megatron.core.datasets import utils as dataset_utils
    from megatron.training import training

    if not extensions.installed(dataset_utils, "compile_helpers"):
        extensions.apply(extensions.BY_NAME["compile_helpers"],
                         _compile_helpers_unless_shipped(dataset_utils.compile_helpers))
        _INSTALLED.append("dataset helpers: the wheel's prebuilt helpers_cpp, not rebuilt with make")
    from megatron.training import checkpointing

    if not extensions.installed(checkpointing, "dist_checkpointing"):
        record = extensions.BY_NAME["checkpoint_files"]
        hook = _Glm5DistCheckpointing(checkpointing.dist_checkpointing)
        extensions.apply(record, hook, target="megatron.training.checkpointing.dist_checkpointing")
        extensions.apply(record, hook.save_integrity_manifest,
                         target="megatron.core.dist_checkpointing.serialization.save_integrity_manifest")
        _INSTALLED.append("checkpoints: hf_config.json, parallel_layout.json and megatron-core's integrity.json in "
                          "every save; loads verified against them and the model; .metadata and byte items "
                          "unpickled without code")
    from megatron_glm5.training.save_guard import install_save_checkpoint

    if install_save_checkpoint("nonfinite", refuse_nonfinite_save):
        _INSTALLED.append("checkpoints: a model holding NaN/inf weights is not saved (the run stops)")
    from megatron_glm5.training.checkpoint_checks import install_schedule_check

    if install_schedule_check():
        _INSTALLED.append("resume: a learning-rate schedule unlike the checkpoint's is one line naming the flags")
    from megatron_glm5.models.grouped_experts import install_expert_buffer_layout

    if install_expert_buffer_layout():
        _INSTALLED.append("DDP buffer: each MoE layer's expert weights back to back in expert order (the grouped "
                          "GEMM reads them without a copy)")
    from megatron_glm5.training import indexer_stages

    if indexer_stages.install():
        _INSTALLED.append("resume: the indexer warm-up's last checkpoint starts the sparse stage (the indexers' Adam moments "
                          "carried, the others fresh)")
    if not extensions.installed(training, "get_megatron_optimizer"):
        extensions.apply(extensions.BY_NAME["optimizer_builder"],
                         _glm5_get_megatron_optimizer(training.get_megatron_optimizer))
        _INSTALLED.append("optimizer: steps with a NaN/inf gradient norm or updated weight skipped and counted; "
                          "fp32 islands in their own param groups under bf16; --fused-optimizer-step; "
                          "--torch-fused-adam")


def describe(more: Sequence[str] = ()) -> str:
    """One line naming the installed hooks by their subject (the text of each up to its first ':'; those of
    ``more`` too), each once, in order; docs/design.md says what each does."""
    topics = list(dict.fromkeys(h.split(":", 1)[0] for h in list(_INSTALLED) + list(more)))
    return "megatron_glm5 hooks into megatron.training: " + (", ".join(topics) or "none") + " (docs/design.md)"
