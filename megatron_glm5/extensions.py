"""The registry of every change this project makes to megatron-core, ``megatron.training`` and torch at runtime.

:data:`REGISTRY` holds one :class:`Extension` record per change: the attributes it rebinds (``module.name`` or
``module.Class.name``), its kind (``wrap``: calls what it replaces; ``replace``: stands in for it; ``hook``: an
object put in its place that forwards to it), what it changes, why, the megatron-core / torch releases it was checked
on, for a megatron-core defect the upstream bug and the test that reproduces it, and the function that installs it.
Every installer rebinds through :func:`apply`, which does the version guard (outside the record's releases: refused
with one line, :class:`~megatron_glm5.mcore_version.UnsupportedMegatronCore`, or left out with one line on stderr)
and the one idempotence mechanism (what :func:`apply` bound is remembered by identity: installing again changes
nothing). ``python pretrain_glm5_vlm.py --help-extensions`` prints :func:`table`; this module's metadata needs
neither torch nor megatron-core (a new megatron-core release is a table to re-check).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megatron_glm5.supported_versions import FIXES_VERSIONS, PERMUTATION_VERSIONS, TRAINER_VERSIONS  # noqa: F401

TORCH_CHECKED = "2.13.0"
"""The torch release every record was checked on."""

# record.versions names one of these ranges; it is read from its home module when a change is installed (a test may
# set another range there)
_RANGES = {"trainer": ("megatron_glm5.mcore_version", "TRAINER_VERSIONS"),
           "fixes": ("megatron_glm5.mcore_fixes", "AFFECTED_VERSIONS"),
           "permutation": ("megatron_glm5.models.token_permutation", "SUPPORTED_VERSIONS")}
_DEFAULT_RANGES = {"trainer": TRAINER_VERSIONS, "fixes": FIXES_VERSIONS, "permutation": PERMUTATION_VERSIONS}


@dataclass(frozen=True)
class Extension:
    """One change of megatron-core / ``megatron.training`` / torch (see the module docstring)."""

    name: str
    targets: Tuple[str, ...]  # the attributes it rebinds, 'module.name' / 'module.Class.name'
    kind: str                 # 'wrap' | 'replace' | 'hook'
    what: str
    why: str
    installer: str            # 'module.function' that installs it
    versions: str = "trainer"  # megatron-core range: 'trainer' (refused outside), 'fixes' / 'permutation' (left out
    #                            outside), 'any' (megatron-core's Apex/TE fallback hooks, wherever it fell back)
    bug: str = ""             # the upstream megatron-core defect it works around
    test: str = ""            # the test that reproduces the defect / shows the change
    when: str = ""            # '' = every install; else the condition under which it is installed
    guard_line: str = ""      # how the one-line refusal / notice names it
    transient: bool = False   # bound only for the length of one call and restored after it

    @property
    def refused_outside(self) -> bool:
        return self.versions == "trainer"


_M = "megatron.core."
_T = "megatron.training."
_DO = _M + "optimizer.distrib_optimizer.DistributedOptimizer."
_CUDA_LITERAL = ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads",
                 "megatron.core.optimizer.distrib_optimizer", "megatron.core.optimizer.grad_scaler",
                 "megatron.core.distributed.param_and_grad_buffer", "megatron.core.pipeline_parallel.schedules",
                 "megatron.core.pipeline_parallel.utils", "megatron.core.transformer.moe.moe_utils",
                 "megatron.core.transformer.module", "megatron.core.utils")
_TRAINING_CUDA_LITERAL = ("megatron.training.training", "megatron.training.checkpointing",
                          "megatron.training.utils.common_utils",
                          "megatron.core.rerun_state_machine",
                          "megatron.core.optimizer.optimizer", "megatron.core.pipeline_parallel.schedules",
                          "megatron.core.distributed.finalize_model_grads", "megatron.core.transformer.utils")
_CUDA_NAMES = ("current_device", "Stream", "Event", "current_stream", "default_stream", "stream", "synchronize",
               "set_device", "empty_cache", "get_rng_state", "set_rng_state", "manual_seed", "nvtx.range_push",
               "nvtx.range_pop", "nvtx.range", "memory_allocated", "max_memory_allocated", "memory_reserved",
               "max_memory_reserved", "reset_peak_memory_stats", "memory_stats")
_CPU = "no CUDA (tests, CPU runs)"
_FIXES_TEST = "tests/test_mcore_fixes.py::"

REGISTRY: Tuple[Extension, ...] = (
    # ------------------------------------------------------------------ megatron-core defects (mcore_fixes.py)
    Extension("router_expert_bias_padding", (_M + "transformer.moe.router.TopKRouter._apply_expert_bias",), "replace",
              "padding tokens leave the expert loads of the aux-loss-free bias update",
              "upstream masks the [tokens, experts] routing map with the flat [tokens] padding mask",
              "megatron_glm5.mcore_fixes.apply_mcore_fixes", "fixes",
              "TopKRouter._apply_expert_bias broadcasts the padding mask along the expert dim",
              _FIXES_TEST + "test_expert_loads_leave_out_padding"),
    Extension("distrib_optimizer_fresh_state_dict", (_DO + "state_dict",), "wrap",
              "a fresh optimizer's state dict reports step 0",
              "without Apex/TE upstream asserts one step value, a fresh optimizer has none: loading fails",
              "megatron_glm5.mcore_fixes.apply_mcore_fixes", "fixes",
              "DistributedOptimizer.state_dict asserts on a fresh torch optimizer",
              _FIXES_TEST + "test_fresh_optimizer_builds_its_state_dict_for_loading"),
    Extension("distrib_optimizer_load_keeps_step", (_DO + "_set_main_param_and_optimizer_states",), "replace",
              "loads copy param and state tensors under no_grad and leave 'step' alone",
              "upstream copies 'step' (KeyError) and copies into grad-requiring views with autograd on",
              "megatron_glm5.mcore_fixes.apply_mcore_fixes", "fixes",
              "_set_main_param_and_optimizer_states: KeyError 'step' / in-place copy under autograd",
              _FIXES_TEST + "test_dp_reshardable_load_copies_without_autograd"),
    Extension("distrib_optimizer_bucket_padding", (_DO + "sharded_param_state_fully_reshardable",), "wrap",
              "the fully reshardable save reads each parameter's state at its buffer index",
              "with several buckets every later parameter's saved state is shifted",
              "megatron_glm5.mcore_fixes.apply_mcore_fixes", "fixes",
              "sharded_param_state_fully_reshardable ignores bucket padding",
              _FIXES_TEST + "test_fully_reshardable_save_reads_each_state_at_its_buffer_index"),
    Extension("distrib_optimizer_step_per_param", (_DO + "load_state_dict",), "wrap",
              "each parameter gets its own 'step' tensor after a load",
              "a shared step tensor advances once per parameter: wrong bias corrections after a resume",
              "megatron_glm5.mcore_fixes.apply_mcore_fixes", "fixes",
              "DistributedOptimizer.load_state_dict shares one step tensor",
              _FIXES_TEST + "test_resumed_adam_counts_each_step_once"),
    Extension("distrib_optimizer_zero_padding", (_DO + "sharded_param_state_dp_reshardable",), "wrap",
              "zeros between parameters in the DP-reshardable save",
              "torch.empty padding makes two saves of one state differ",
              "megatron_glm5.mcore_fixes.apply_mcore_fixes", "fixes",
              "sharded_param_state_dp_reshardable saves uninitialised padding",
              _FIXES_TEST + "test_dp_reshardable_save_writes_zeros_between_parameters"),
    Extension("dataset_cache_gpt", (_M + "datasets.gpt_dataset.GPTDataset._build_document_sample_shuffle_indices",),
              "wrap", "index caches read without pickle, checked against their source, published atomically",
              "a crafted cache runs code, a stale or truncated one is used",
              "megatron_glm5.mcore_fixes.apply_mcore_fixes", "fixes", "index caches loaded with allow_pickle=True",
              _FIXES_TEST + "test_dataset_index_cache_is_read_without_pickle"),
    Extension("dataset_cache_blended", (_M + "datasets.blended_dataset.BlendedDataset._build_indices",), "wrap",
              "blended index caches as dataset_cache_gpt", "as dataset_cache_gpt",
              "megatron_glm5.mcore_fixes.apply_mcore_fixes", "fixes", "index caches loaded with allow_pickle=True",
              _FIXES_TEST + "test_dataset_index_cache_follows_its_source_data"),
    Extension("dataset_cache_deferred_load", (_M + "datasets.gpt_dataset.safe_numpy_load",
                                              _M + "datasets.blended_dataset.safe_numpy_load"), "replace",
              "deferred index reads without pickle", "as dataset_cache_gpt",
              "megatron_glm5.mcore_fixes.apply_mcore_fixes", "fixes", "safe_numpy_load uses allow_pickle=True",
              _FIXES_TEST + "test_dataset_index_cache_is_read_without_pickle"),
    Extension("dsa_indexer_loss_every_stage",
              (_M + "transformer.experimental_attention_variant.dsa.DSAIndexerLossLoggingHelper."
                    "reduce_loss_in_tracker",), "wrap",
              "a pipeline stage without DSA layers joins the indexer-loss all-reduce with zeros",
              "that stage returns before the all-reduce: the others hang", "megatron_glm5.mcore_fixes.apply_mcore_fixes",
              "fixes", "reduce_loss_in_tracker skips the collective on stages without tracked values",
              _FIXES_TEST + "test_indexer_loss_log_with_a_stage_without_dsa_layers"),
    # ------------------------------------------------------------------ MoE token permutation
    Extension("token_permutation", tuple(_M + "transformer.moe.token_dispatcher." + n for n in
                                         ("permute", "unpermute", "sort_chunks_by_idxs",
                                          "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize")), "replace",
              "the dispatchers' permute / unpermute / chunk sort, token counts kept on the device",
              "faster permutation, no host sync for counts", "megatron_glm5.models.token_permutation.install",
              "permutation", test="tests/test_token_permutation.py",
              guard_line="the MoE token permutation (models/token_permutation.py)"),
    # ------------------------------------------------------------------ Apex / TE fallbacks (mcore_extensions.py)
    Extension("multi_tensor_kernels", (_M + "optimizer.clip_grads.l2_norm_impl",
                                       _M + "optimizer.clip_grads.multi_tensor_scale_impl",
                                       _M + "optimizer.optimizer.multi_tensor_scale_impl",
                                       _T + "utils.common_utils.multi_tensor_l2norm"), "replace",
              "multi-tensor L2 norm and scale with torch foreach ops",
              "the local fallbacks sync the GPU once per tensor", "megatron_glm5.mcore_extensions.install",
              "any", test="tests/test_mcore_extensions.py", when="no Apex / Transformer Engine"),
    Extension("grad_accum_fusion", (_M + "tensor_parallel.layers.fused_weight_gradient_mlp_cuda",
                                    _M + "tensor_parallel.layers._grad_accum_fusion_available"), "replace",
              "gradient-accumulation fusion: the weight-gradient GEMM accumulates into fp32 main_grad",
              "without Apex megatron-core cannot fuse it", "megatron_glm5.mcore_extensions.install", "any",
              test="tests/test_mcore_extensions.py", when="no Apex"),
    # ------------------------------------------------------------------ checkpoint reads (checkpoint/safe_load.py)
    Extension("dcp_read_guards", ("torch.distributed.checkpoint.filesystem.FileSystemReader.read_metadata",
                                  "torch.distributed.checkpoint.default_planner.DefaultLoadPlanner.load_bytes",
                                  _M + "dist_checkpointing.serialization.load_common"), "replace",
              "checkpoint metadata, byte items and common.pt read without running code from the checkpoint",
              "torch DCP and megatron-core unpickle them", "megatron_glm5.checkpoint.safe_load.install_dcp_read_guards",
              test="tests/test_checkpoint_safety.py",
              guard_line="the checkpoint read guards (checkpoint/safe_load.py: megatron-core's common.pt)"),
    # ------------------------------------------------------------------ trainer hooks (training/*.py)
    Extension("compile_helpers", (_M + "datasets.utils.compile_helpers",), "wrap",
              "the wheel's prebuilt helpers_cpp is used, not rebuilt with make",
              "the wheel ships no Makefile: the make fails", "megatron_glm5.training.megatron_hooks.install",
              guard_line="the trainer hooks (training/megatron_hooks.py)"),
    Extension("checkpoint_files", (_T + "checkpointing.dist_checkpointing",
                                   _M + "dist_checkpointing.serialization.save_integrity_manifest"), "hook",
              "hf_config.json, parallel_layout.json and integrity.json in every save; loads verified",
              "the exporter and --load need the architecture, layout and manifest",
              "megatron_glm5.training.megatron_hooks.install", test="tests/test_training_checkpoint_safety.py"),
    Extension("save_checkpoint", (_T + "training.save_checkpoint",), "wrap",
              "one wrapper: the Energon loader state, the save guard, the NaN/inf refusal, then Megatron-LM's save",
              "a loader resumes where it was; a failed save is one line; a NaN/inf model is not saved",
              "megatron_glm5.training.save_guard.install_save_checkpoint",
              test="tests/test_save_guard.py", guard_line="the save_checkpoint wrapper (training/save_guard.py)"),
    Extension("optimizer_builder", (_T + "training.get_megatron_optimizer",), "wrap",
              "non-finite steps skipped and counted; fp32 islands; --fused-optimizer-step; --torch-fused-adam",
              "megatron-core applies a NaN/inf update", "megatron_glm5.training.megatron_hooks.install",
              test="tests/test_training_errors.py"),
    Extension("schedule_check", (_M + "optimizer_param_scheduler.OptimizerParamScheduler._check_and_set",), "wrap",
              "a resumed schedule unlike the checkpoint's is one line naming the flags", "upstream asserts",
              "megatron_glm5.training.checkpoint_checks.install_schedule_check"),
    Extension("expert_buffer_layout", (_DO + "compute_full_param_layout",), "wrap",
              "each MoE layer's expert weights back to back in the DDP buffer",
              "the grouped GEMM reads them without a copy",
              "megatron_glm5.models.grouped_experts.install_expert_buffer_layout", test="tests/test_grouped_experts.py"),
    Extension("indexer_stage_switch", (_T + "training.load_checkpoint",), "wrap",
              "the indexer warm-up's last checkpoint starts the sparse stage",
              "the sparse stage carries only the indexers' Adam moments", "megatron_glm5.training.indexer_stages.install"),
    Extension("flop_count", (_T + "training.num_floating_point_operations",), "replace",
              "this model's FLOPs per iteration", "Megatron-LM counts a GPT", "megatron_glm5.training.flops.install"),
    Extension("memory_report", (_T + "training.report_theoretical_memory",), "replace",
              "this model's theoretical memory", "Megatron-LM estimates a GPT",
              "megatron_glm5.training.memory_report.install", test="tests/test_memory_report.py",
              guard_line="the memory report (training/memory_report.py)"),
    Extension("memory_report_cpu", (_T + "training.report_memory",), "replace",
              "the process peak resident memory instead of CUDA's", "no CUDA memory on a CPU",
              "megatron_glm5.training.memory_report.install", when=_CPU,
              guard_line="the memory report (training/memory_report.py)"),
    Extension("quiet_prints", (_T + "checkpointing.print_rank_0",), "wrap",
              "Megatron-LM's console lines of training/quiet.py QUIET_PRINTS dropped (release-checkpoint notices)",
              "they decide nothing for a release checkpoint (no run arguments, RNG or rerun state in it)",
              "megatron_glm5.training.quiet.install_prints", test="tests/test_quiet_start.py",
              when="a run with its flags read", guard_line="the filter of Megatron-LM's console lines "
                                                           "(training/quiet.py)"),
    Extension("mtp_metrics", (_M + "transformer.multi_token_prediction.MTPLossLoggingHelper.track_mtp_metrics",),
              "wrap", "MTP metrics written without the cumulative acceptance rate", "it is not this run's",
              "megatron_glm5.training.moe_load_logging.install"),
    Extension("save_guards", (_T + "training.maybe_finalize_async_save", _T + "checkpointing.maybe_msc",
                              _M + "dist_checkpointing.strategies.filesystem_async.FileSystemWriterAsync."
                                   "write_preloaded_data",
                              _T + "checkpointing._async_delete_checkpoint_impl",
                              _T + "checkpointing.cleanup_old_non_persistent_checkpoint"), "wrap",
              "the tracker replaced atomically; a failed save is one line; only this run's checkpoints deleted",
              "nothing lost on a failed or interrupted save", "megatron_glm5.training.save_guard.install",
              test="tests/test_save_guard.py", guard_line="the save guards (training/save_guard.py)"),
    Extension("checkpoint_writer_queue", (_M + "dist_checkpointing.strategies.filesystem_async._results_queue",),
              "replace", "the writer's queue process dies with the trainer, without its stdout",
              "it outlives a killed trainer and holds its pipes",
              "megatron_glm5.training.megatron_hooks.install_checkpoint_writer_queue", when="--save",
              guard_line="the checkpoint writer's queue (training/megatron_hooks.py)"),
    Extension("lean_import", ("torch.compile", "megatron.core.jit.jit_fuser"), "replace",
              "megatron-core imported with its import-time torch.compile calls passed through, jit fuser off",
              "TorchDynamo / Inductor imports cost ~2 s of a converter's start-up",
              "megatron_glm5.lean_import.import_megatron_without_compile", "any",
              when="the checkpoint converter's megatron-core import", transient=True),
    # ------------------------------------------------------------------ CPU redirects (cpu_compat.py)
    Extension("cpu_cuda_redirects", tuple("torch.cuda." + n for n in _CUDA_NAMES) +
              ("torch.Tensor.type", "torch.Tensor.cuda"), "replace",
              "CUDA-only calls megatron-core makes redirected to the CPU (inert streams, CPU RNG, 0 memory)",
              "megatron-core calls CUDA unconditionally", "megatron_glm5.cpu_compat.enable_cpu_compat", when=_CPU,
              guard_line="the CPU redirects of megatron-core's CUDA calls (cpu_compat.py)"),
    Extension("cpu_megatron", (_M + "tensor_parallel.random._set_cuda_rng_state",
                               _M + "tensor_parallel.random._get_cuda_rng_state",
                               _M + "transformer.moe.moe_utils.maybe_move_tensor_to_cpu",
                               _M + "transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu",
                               _M + "tensor_parallel.mappings._gather_along_first_dim",
                               _M + "tensor_parallel.mappings._reduce_scatter_along_first_dim",
                               _T + "training.initialize_megatron", _T + "training.set_jit_fusion_options",
                               _T + "arguments.get_device_arch_version", _T + "initialize.torch")
              + tuple(sorted({m + ".torch" for m in _CUDA_LITERAL + _TRAINING_CUDA_LITERAL})), "replace",
              "megatron-core / Megatron-LM on the CPU: CPU RNG, numpy split sizes, uneven gloo collectives, literal "
              "device='cuda' tensors on the CPU, no CUDA arch / fusion warm-up",
              "megatron-core calls CUDA unconditionally; gloo lacks uneven list collectives",
              "megatron_glm5.cpu_compat.enable_cpu_compat", when=_CPU,
              guard_line="the CPU redirects of megatron-core's CUDA calls (cpu_compat.py)"),
)

BY_NAME: Dict[str, Extension] = {r.name: r for r in REGISTRY}
CUDA_LITERAL_MODULES = _CUDA_LITERAL
TRAINING_CUDA_LITERAL_MODULES = _TRAINING_CUDA_LITERAL


def versions_of(record: Extension) -> Tuple[str, str]:
    """The megatron-core range (first, last) of ``record``, read from its home module when that is imported."""
    import sys

    if record.versions == "any":
        return ("0", "999")
    module, attr = _RANGES[record.versions]
    home = sys.modules.get(module)
    return getattr(home, attr) if home is not None else _DEFAULT_RANGES[record.versions]


def guard(record: Extension) -> bool:
    """The version guard of ``record``: True inside its megatron-core releases; outside them a record refused
    outside raises :class:`~megatron_glm5.mcore_version.UnsupportedMegatronCore` (one line), another returns False
    after one line on stderr (:func:`~megatron_glm5.mcore_version.skip_notice`)."""
    from megatron_glm5 import mcore_version

    what = record.guard_line or f"{record.name} ({record.installer})"
    if record.versions == "any":  # megatron-core's fallback hooks: where it fell back, on any release
        return True
    if record.refused_outside:
        mcore_version.require_version(versions_of(record), what)
        return True
    return mcore_version.skip_notice(versions_of(record), what)


# (id of owner, attribute) -> (owner, every object apply bound there): the one idempotence record
_APPLIED: Dict[Tuple[int, str], Tuple[object, List[object]]] = {}


def resolve(target: str) -> Tuple[object, str]:
    """(owner, attribute) of ``target`` ('module.name' or 'module.Class.name', the longest importable module)."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    raise ImportError(f"no module in {target}")


def installed(owner: object, attr: str) -> bool:
    """Whether ``owner.attr`` is what :func:`apply` bound there."""
    entry = _APPLIED.get((id(owner), attr))
    current = getattr(owner, attr, None)
    return entry is not None and any(current is o for o in entry[1])


def current(record: Extension, target: Optional[str] = None):
    """What ``target`` of ``record`` (default its only one) is bound to now."""
    owner, attr = resolve(target or record.targets[0])
    return getattr(owner, attr)


def apply(record: Extension, new, target: Optional[str] = None, owner: object = None,
          attr: Optional[str] = None) -> bool:
    """Rebind one target of ``record`` (``target``, default its only one; or ``owner``/``attr`` directly) to
    ``new`` (a wrapper is built by the installer around :func:`current`). Version guard first (:func:`guard`);
    idempotent (:func:`installed`). Returns whether it bound ``new`` now."""
    if owner is None:
        target = target or record.targets[0]
        if target not in record.targets:
            raise KeyError(f"{target} is not a target of {record.name}")
        owner, attr = resolve(target)
    if not guard(record):
        return False
    if installed(owner, attr):
        return False
    setattr(owner, attr, new)
    entry = _APPLIED.setdefault((id(owner), attr), (owner, []))
    entry[1].append(getattr(owner, attr))
    return True


def table() -> str:
    """The registry as text: one block per record (what ``--help-extensions`` prints)."""
    lines = [f"megatron_glm5 changes to megatron-core / megatron.training / torch (checked on torch {TORCH_CHECKED}; "
             "installed by megatron_glm5/extensions.py apply):"]
    for r in REGISTRY:
        if r.versions == "any":
            releases = "any megatron-core (checked on " + TRAINER_VERSIONS[1] + ")"
        else:
            first, last = _DEFAULT_RANGES[r.versions]
            outside = "refused" if r.refused_outside else "left out"
            releases = f"megatron-core {first}{'' if first == last else ' to ' + last} (outside: {outside})"
        lines.append(f"\n{r.name} [{r.kind}] {releases}"
                     + (f", only with {r.when}" if r.when else ""))
        lines.append(f"  what: {r.what}")
        lines.append(f"  why:  {r.why}")
        if r.bug:
            lines.append(f"  upstream bug: {r.bug}")
        if r.test:
            lines.append(f"  test: {r.test}")
        lines.append(f"  installer: {r.installer}" + (" (restored after it)" if r.transient else ""))
        lines += [f"  rebinds: {t}" for t in r.targets]
    return "\n".join(lines)
