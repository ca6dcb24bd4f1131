"""The messages of the stack that a training run does not show, each by its exact text where it is raised, with why.

A training start prints what a Megatron-LM user reads (the arguments, the plan table, the checkpoints loaded, the data
built, the iterations). The messages below say nothing a user of this project can act on; each is filtered by its
message (a regex matched from its start) and the module that raises it, so that any other warning or log line of
the stack still shows. Megatron-LM's own console lines (``print_rank_0``: ``print``, not a logger) are filtered the
same way, in the module that prints them (:data:`QUIET_PRINTS`). :func:`install_warnings` runs before megatron-core
is imported (its import-time warnings), :func:`install_logs` once the flags are read (a filter may depend on one).
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class QuietWarning:
    """A Python warning not shown: ``warnings.filterwarnings("ignore", message, category, module)``."""

    message: str
    """Regex matched at the start of the warning's text."""
    category: type
    module: str
    """Regex of the module that calls ``warnings.warn`` (matched in full)."""
    why: str


@dataclass(frozen=True)
class QuietLog:
    """A log record of ``logger`` (the logger that raises it, not its parents) not shown, or cut to its first line."""

    logger: str
    message: str
    """Regex matched at the start of the record's text."""
    why: str
    first_line_only: bool = False
    """Keep the record's first line (a summary) and drop the rest (a listing)."""
    when: Optional[Callable] = None
    """``when(args)``: filter only for a run whose flags satisfy it; None: always."""


_TE_APEX = ("megatron-core without Transformer Engine or Apex (CPU, or a GPU install without them) names the torch "
            "implementation it falls back to; this model's layers are its own and do not use either")

QUIET_WARNINGS = (
    QuietWarning(r"(Transformer Engine and Apex are|Apex is) not installed", UserWarning, r"megatron\..*", _TE_APEX),
    QuietWarning(r"Only transformer-engine>=[0-9.]+ supports MoE experts", UserWarning,
                 r"megatron\.core\.extensions\.transformer_engine_spec_provider", _TE_APEX),
    QuietWarning(r"Triton is not supported on current platform", UserWarning, r"fla\..*",
                 "flash-linear-attention imported on a machine without a GPU; the run prints its KDA backend in the "
                 "backends table"),
    QuietWarning(r"\s*It is recommended to use a ModelConfig", UserWarning, r"megatron\.training\.argument_utils",
                 "Megatron-LM's pretrain called with a model provider, its documented pretrain_*.py form"),
    QuietWarning(r"MimoModelConfig is experimental", UserWarning, r"megatron\.core\..*",
                 "import-time notice of a megatron-core module this model does not use"),
    QuietWarning(r"MLP requires ffn_hidden_size", DeprecationWarning, r"megatron\.core\..*",
                 "megatron-core 0.19.2 building its shared-expert MLP through its own deprecated path"),
    QuietWarning(r"Warning. tp_group is None", DeprecationWarning, r"megatron\.core\..*",
                 "megatron-core's parallel linears built without a tp_group: its default group is the one meant"),
    QuietWarning(r"'type' is deprecated", DeprecationWarning, r"argparse",
                 "Megatron-LM's parser passes type= to argparse.BooleanOptionalAction (deprecated in Python 3.12)"),
    QuietWarning(r"Could not determine rank", UserWarning, r"megatron\.core\..*",
                 "megatron-core asked for its rank while the flags are checked, before torch.distributed starts"),
    QuietWarning(r"full scope is deprecated", UserWarning, r"megatron\.core\..*",
                 "megatron-core's own TransformerConfig default (cuda_graph_modules); the GLM config sets []"),
    QuietWarning(r"`torch\.jit\.script_method` is deprecated", DeprecationWarning, r".*",
                 "torch 2.13 deprecates TorchScript, which megatron-core's import-time jit decorators call"),
    QuietWarning(r"The following imports from `dynamic_context\.py`", DeprecationWarning, r"megatron\.core\..*",
                 "megatron-core's inference package warns of its own import cycle when megatron.training imports it"),
    QuietWarning(r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning, r"torch\..*",
                 "megatron-core's collectives call the torch API that torch 2.13 renames"),
    QuietWarning(r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in "
                 r"a single process", UserWarning, r"torch\.distributed\.checkpoint\..*",
                 "this project's checkpoint checks read a checkpoint's metadata in one process, as meant"),
    QuietWarning(r"'pin_memory' argument is set as true but no accelerator is found", UserWarning,
                 r"torch\.utils\.data\..*", "Megatron-LM's data loaders pin memory; on a machine without a GPU there "
                 "is nothing to pin"),
    QuietWarning(r"The argument order of load has been changed", UserWarning, r"torch\.distributed\.checkpoint\..*",
                 "megatron-core's torch_dist loader calls torch.distributed.checkpoint.load by keyword"),
    QuietWarning(r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning,
                 r"torch\.distributed\.checkpoint\..*",
                 "megatron-core's torch_dist format is built on ShardedTensor; the checkpoint format is Megatron-LM's"),
)


def _no_async_save(args) -> bool:
    return not getattr(args, "async_save", False)


QUIET_LOGS = (
    QuietLog("megatron.core.distributed.param_and_grad_buffer", r"Number of buckets for gradient",
             "the bucket count is kept; the list of every parameter name of every bucket is not",
             first_line_only=True),
    QuietLog("megatron.core.rerun_state_machine", r"RerunStateMachine initialized in mode",
             "logged at WARNING on every start: the default --rerun-mode, not a problem"),
    QuietLog("megatron.core.rerun_state_machine", r"Setting RerunStateMachine mode",
             "logged at WARNING around every validation: Megatron-LM switches result checks off while it evaluates"),
    QuietLog("megatron.core.timers", r"\(min, max\) time across ranks \(ms\):\s*\Z",
             "the timers' header with no timer under it (none at --timing-log-level of this run); with timers it "
             "shows"),
    QuietLog("megatron.core.dist_checkpointing.strategies.torch", r"MCore's async save is deprecated",
             "logged on the first save without --async-save too (megatron-core's own default strategy); shown "
             "with --async-save", when=_no_async_save),
)


@dataclass(frozen=True)
class QuietPrint:
    """A ``print_rank_0`` line of ``module`` (Megatron-LM's console output, ``print``) not shown."""

    module: str
    """The module whose ``print_rank_0`` prints it (the name it imported is replaced by a filtering one)."""
    message: str
    """Regex matched at the start of the line."""
    why: str
    when: Optional[Callable] = None
    """``when(args)``, asked as the line is printed: filter it only then; None: always."""


def _loading_release(args) -> bool:
    """Whether the checkpoint Megatron-LM's ``load_checkpoint`` reads is a ``release`` one (the converter's
    layout-free weights: ``--load``, or ``--pretrained-checkpoint`` when ``--load`` holds none)."""
    from megatron_glm5.checkpoint.tracker import checkpoint_in
    from megatron_glm5.errors import CheckpointError

    for folder in (getattr(args, "load", None), getattr(args, "pretrained_checkpoint", None)):
        try:
            found = checkpoint_in(folder) if folder and os.path.isdir(folder) else None
        except CheckpointError:
            found = None
        if found is not None:
            return os.path.basename(os.path.normpath(found)) == "release"
    return False


_RELEASE = ("a release checkpoint (the converter's weights, tools/convert_hf_to_mcore.py) holds no run arguments, "
            "RNG or rerun state: megatron-core reads its torch_dist tensors at any layout and loads neither state "
            "from a release checkpoint, so the layout it assumes for it decides nothing")

QUIET_PRINTS = (
    QuietPrint("megatron.training.checkpointing", r"WARNING: (TP|PP) size not found in checkpoint args, using 1 as "
               r"default\.\Z", _RELEASE, when=_loading_release),
    QuietPrint("megatron.training.checkpointing", r"Job sharding has changed: Rerun state will be ignored\Z",
               _RELEASE + " (its world size is unknown, so it always differs)", when=_loading_release),
    QuietPrint("megatron.training.checkpointing", r"could not find arguments in the checkpoint \.\.\.\Z", _RELEASE,
               when=_loading_release),
)


QUIET_LOGGER_LEVELS = (
    ("megatron.core.datasets", logging.ERROR,
     "the dataset builders' index and cache notices; the run prints one line per dataset built"),
    ("torch.utils.cpp_extension", logging.ERROR,
     "'No CUDA runtime is found' on a machine with a CUDA toolkit and no GPU"),
)
"""Loggers kept at a level above their chatter: (logger, level, why)."""


class _LogFilter(logging.Filter):
    """Drops (or cuts to their first line) the records of one logger that match :class:`QuietLog` entries."""

    def __init__(self, entries):
        super().__init__()
        self.entries = [(re.compile(e.message), e) for e in entries]

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        for pattern, entry in self.entries:
            if pattern.match(text):
                if not entry.first_line_only:
                    return False
                record.msg, record.args = text.split("\n", 1)[0], None
        return True


def install_warnings() -> None:
    """Hide the warnings of :data:`QUIET_WARNINGS` (before megatron-core is imported); every other warning shows.
    DataLoader workers (forked) inherit the filters."""
    for q in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=q.message, category=q.category, module=q.module)
    for name, level, _why in QUIET_LOGGER_LEVELS:
        logging.getLogger(name).setLevel(level)


def _filtered_print(upstream, entries):
    def print_rank_0(message, *a, **kw):
        text = str(message)
        for pattern, entry in entries:
            if pattern.match(text):
                from megatron.training import get_args

                if entry.when is None or entry.when(get_args()):
                    return None
        return upstream(message, *a, **kw)

    return print_rank_0


def install_prints() -> bool:
    """Replace ``print_rank_0`` in each module of :data:`QUIET_PRINTS` by one that drops its lines there (as their
    ``when`` says at print time); every other line prints. Through :mod:`megatron_glm5.extensions` (record
    ``quiet_prints``: version-guarded, idempotent); returns whether the filter is in place."""
    import importlib

    from megatron_glm5 import extensions

    record = extensions.BY_NAME["quiet_prints"]
    by_module = {}
    for q in QUIET_PRINTS:
        by_module.setdefault(q.module, []).append((re.compile(q.message), q))
    modules = {name: importlib.import_module(name) for name in by_module}
    for name, entries in by_module.items():
        extensions.apply(record, _filtered_print(modules[name].print_rank_0, entries), owner=modules[name],
                         attr="print_rank_0")
    return all(extensions.installed(module, "print_rank_0") for module in modules.values())


def install_logs(args=None) -> None:
    """Attach the filters of :data:`QUIET_LOGS` that apply to this run (``args``: its flags; None: those without a
    condition) to their loggers; a second call replaces the first's. With ``args`` (megatron-core is imported by
    then), also :func:`install_prints`."""
    by_logger = {}
    for q in QUIET_LOGS:
        if q.when is None or (args is not None and q.when(args)):
            by_logger.setdefault(q.logger, []).append(q)
    for name in {q.logger for q in QUIET_LOGS}:
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, _LogFilter)]:
            logger.removeFilter(f)
        if name in by_logger:
            logger.addFilter(_LogFilter(by_logger[name]))
    if args is not None:
        install_prints()
