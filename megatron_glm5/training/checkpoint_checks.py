"""What ``--load`` / ``--pretrained-checkpoint`` must hold before Megatron-LM reads it, one line naming the flag or
the file.

Up front (the argument checks, exit 2): Megatron-LM's layout (``latest_checkpointed_iteration.txt`` naming
``iter_NNNNNNN`` or ``release``, :mod:`megatron_glm5.checkpoint.tracker`); a ``torch_dist`` checkpoint folder
(``metadata.json``, ``.metadata``) with no symbolic links in it (:func:`check_checkpoint_folder`); a checkpoint of
this run's architecture (the ``hf_config.json`` every checkpoint of this model carries: the converter writes it, and
so does every save of the trainer, :mod:`megatron_glm5.training.megatron_hooks`); optimizer state this run can
resume (:func:`check_resume_layout`).

While Megatron-LM loads (:class:`megatron_glm5.training.megatron_hooks._Glm5DistCheckpointing`, exit 1): every file
against the checkpoint's manifest (megatron-core's ``integrity.json``, or the converter's ``checksums.sha256``;
:func:`verify_checkpoint_files`), the checkpoint's tensors against this model's (:func:`check_tensors_match`: keys
and global shapes, so that a checkpoint without ``hf_config.json`` of another size is refused too), and the saved
run's arguments against this run's flags (:func:`check_resume_state`).

Megatron-LM starts from scratch when ``--load`` holds no tracker; a directory that holds a checkpoint's files but no
tracker (an ``iter_NNNNNNN`` folder itself) would silently start from random weights, and is refused instead.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from megatron_glm5.errors import CheckpointError
from megatron_glm5.checkpoint.hf_to_mcore import HF_CONFIG_FNAME
# the tracker logic lives with the checkpoint code; re-exported here for the argument checks
from megatron_glm5.checkpoint.tracker import TRACKER_FILE as TRACKER  # noqa: F401
from megatron_glm5.checkpoint.tracker import CheckpointDirError, checkpoint_in  # noqa: F401

# the HF config fields that change the checkpoint's tensors
ARCHITECTURE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "n_routed_experts",
                     "moe_intermediate_size", "intermediate_size", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                     "v_head_dim", "linear_num_heads", "linear_head_dim", "hc_mult", "index_n_heads", "index_head_dim",
                     "layer_types", "mlp_layer_types", "n_shared_experts", "num_nextn_predict_layers",
                     "qk_rope_head_dim", "linear_conv_kernel_dim")
# what a null value means where transformers' default is null (the model reads ``or 0``; hf.py)
_NULL_MEANS = {"num_nextn_predict_layers": 0}
# the HF config fields that may differ between a checkpoint and the run that loads it: names, storage dtype, the
# generation cache, the special-token ids of generation, the initialiser's width (a loaded model is not initialised)
# and the position limit (no layer of this model reads positions: KDA and the NoPE DSA). Every other field may change
# what the model computes (num_experts_per_tok, routed_scaling_factor, swiglu_limit, ...) and must be equal.
FREE_KEYS = frozenset({"architectures", "auto_map", "_name_or_path", "transformers_version", "torch_dtype", "dtype",
                       "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
                       "max_position_embeddings", "output_attentions", "output_hidden_states", "return_dict"})


def _json_object(path: str) -> dict:
    """The JSON object in ``path`` (a :class:`CheckpointDirError` naming it when unreadable or not an object)."""
    try:
        with open(path, encoding="utf-8") as fh:
            obj = json.load(fh)
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep
        raise CheckpointDirError(f"{path}: unreadable ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    if not isinstance(obj, dict):
        raise CheckpointDirError(f"{path}: not a JSON object")
    return obj


def _function_difference(saved: dict, run: dict, where: str = ""):
    """The first field (``where`` + its name) outside :data:`FREE_KEYS` that both HF config dicts hold with
    different values (nested configs compared field by field), with both values; None when there is none."""
    for key in sorted(set(saved) & set(run)):
        if key in FREE_KEYS:
            continue
        a, b = saved[key], run[key]
        if isinstance(a, dict) and isinstance(b, dict) and key.endswith("_config"):
            found = _function_difference(a, b, f"{where}{key}.")
            if found:
                return found
        elif a != b:
            return f"{where}{key}", a, b
    return None


def effective_hf_config(config: dict, where: str) -> dict:
    """``config`` (an HF config dict: nested ``text_config`` / ``vision_config``, or a flat text config) with every
    field at the value transformers gives it: loaded through ``Glm5NextConfig`` (a flat config as its
    ``text_config``), so that a field one config leaves out compares as transformers' default. Nested, as
    ``Glm5NextConfig.to_dict`` writes it; ``vision_config`` only when ``config`` has one. Raises
    :class:`CheckpointDirError` naming ``where`` when transformers refuses the config."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig

    from megatron_glm5.config.hf import check_hf_config_types
    from megatron_glm5.errors import Glm5ConfigError

    full = config if "text_config" in config else {
        "text_config": {k: v for k, v in config.items() if k != "vision_config"},
        **({"vision_config": config["vision_config"]} if "vision_config" in config else {})}
    try:
        check_hf_config_types(full)
        resolved = Glm5NextConfig(**full).to_dict()
    except (Glm5ConfigError, TypeError, ValueError, KeyError, AttributeError) as e:
        raise CheckpointDirError(f"{where}: not a GLM-5.3 model config ({type(e).__name__}: "
                                 f"{' '.join(str(e).split())[:200]})") from None
    if "vision_config" not in config:
        resolved.pop("vision_config", None)
    for key, value in _NULL_MEANS.items():
        if resolved["text_config"].get(key) is None:
            resolved["text_config"][key] = value
    return resolved


def check_architecture(ckpt_dir: str, hf_config: dict) -> None:
    """Refuse a checkpoint whose ``hf_config.json`` describes another model than ``hf_config`` (one line naming the
    first differing field and both values), both compared at their effective values (:func:`effective_hf_config`:
    a field one of them leaves out is transformers' default): the fields that change the tensors
    (:data:`ARCHITECTURE_KEYS`), then every other field but :data:`FREE_KEYS` (the vision tower's and, when both
    are nested configs, the top level's too); a checkpoint without ``hf_config.json`` is not checked here."""
    path = os.path.join(ckpt_dir, HF_CONFIG_FNAME)
    if not os.path.isfile(path):
        return
    saved_raw = _json_object(path)
    if not isinstance(saved_raw.get("text_config", saved_raw), dict):
        raise CheckpointDirError(f"{path}: text_config is not a JSON object")
    saved, run = effective_hf_config(saved_raw, path), effective_hf_config(hf_config, "this run's model config")
    a, b = saved["text_config"], run["text_config"]
    for key in ARCHITECTURE_KEYS:
        if a.get(key) != b.get(key):
            raise CheckpointDirError(f"{ckpt_dir} is a checkpoint of another architecture: {key} is {a.get(key)!r} "
                                     f"there, {b.get(key)!r} in this run's model config")
    if ("vision_config" in saved) != ("vision_config" in run):
        raise CheckpointDirError(f"{ckpt_dir} is a checkpoint of another architecture: vision tower "
                                 f"{'present' if 'vision_config' in saved else 'absent'} there")
    found = _function_difference(a, b)
    if found is None and "text_config" in saved_raw and "text_config" in hf_config:  # the vision tower, the top level
        found = _function_difference({k: v for k, v in saved.items() if k != "text_config"},
                                     {k: v for k, v in run.items() if k != "text_config"})
    if found:
        key, was, now = found
        raise CheckpointDirError(f"{ckpt_dir} is a checkpoint of another model: {key} is {was!r} there, {now!r} in "
                                 "this run's model config (it changes what the model computes)")


LAYOUT_FNAME = "parallel_layout.json"  # written beside every save of the trainer (megatron_hooks)
LAYOUT_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                 "expert_tensor_parallel_size", "context_parallel_size", "data_parallel_size",
                 "use_distributed_optimizer", "dist_ckpt_optim_fully_reshardable", "no_save_optim",
                 "dsa_indexer_loss_coeff", "dsa_indexer_warmup_stage")


def layout_record(args) -> dict:
    """The parallel layout and optimizer-state format of a run, as :data:`LAYOUT_FNAME` records it, with the order
    of the parameters in the distributed optimizer's buffers (``buffer_layout``: the DP-reshardable format stores
    the optimizer state in that order)."""
    from megatron_glm5.models.grouped_experts import BUFFER_LAYOUT

    return dict({k: getattr(args, k, None) for k in LAYOUT_FIELDS}, buffer_layout=BUFFER_LAYOUT)


def check_resume_layout(ckpt_dir: str, args) -> None:
    """Refuse (one line) to resume optimizer state that Megatron-LM cannot load into this run (it stops with a
    traceback in the middle of loading), from the checkpoint's :data:`LAYOUT_FNAME`: see :func:`resume_refusal`."""
    path = os.path.join(ckpt_dir, LAYOUT_FNAME)
    if os.path.isfile(path):
        problem = resume_refusal(ckpt_dir, _json_object(path), args, layout_file=True)
        if problem:
            raise CheckpointDirError(problem)


def resume_refusal(ckpt_dir: str, saved: dict, args, layout_file: bool = False) -> Optional[str]:
    """Why this run cannot resume the optimizer state of the checkpoint ``ckpt_dir`` whose run had the arguments
    ``saved`` (a :func:`layout_record` when ``layout_file``, else the saved run's ``args`` as a dict), or None:
    optimizer state saved with --no-save-optim, with / without --use-distributed-optimizer unlike this run, at
    another expert-parallel size, or in the DP-reshardable format at another TP / PP or in another buffer order
    (``buffer_layout``, recorded in the layout file only). Nothing to say when this run loads no optimizer state
    (--finetune, --no-load-optim, a release checkpoint)."""
    if args.finetune or args.no_load_optim or os.path.basename(os.path.normpath(ckpt_dir)) == "release":
        return None
    if saved.get("no_save_optim"):
        return (f"{ckpt_dir} holds no optimizer state (saved with --no-save-optim): start a fresh optimizer from its "
                "weights with --no-load-optim (or --finetune to also restart the iteration count and schedule)")
    from megatron_glm5.training.indexer_stages import optimizer_state_refusal

    problem = optimizer_state_refusal(ckpt_dir, saved, args)  # which parameters the optimizer state covers
    if problem:
        return problem
    was = saved.get("use_distributed_optimizer")
    if was is not None and bool(was) != bool(args.use_distributed_optimizer):
        flag = "with" if was else "without"
        return (f"{ckpt_dir} holds optimizer state saved {flag} --use-distributed-optimizer, which this run cannot "
                f"load: resume {flag} --use-distributed-optimizer, or leave the optimizer state out (--no-load-optim)")
    if not was:
        return None
    ep_was, ep_now = saved.get("expert_model_parallel_size"), args.expert_model_parallel_size
    if ep_was is not None and ep_was != ep_now:
        return (f"{ckpt_dir} holds distributed-optimizer state saved at EP {ep_was}: Megatron-LM loads it only at the "
                f"same expert-parallel size (its optimizer is split by it; this run: EP {ep_now}): resume at EP "
                f"{ep_was}, or leave the optimizer state out (--no-load-optim)")
    if saved.get("dist_ckpt_optim_fully_reshardable"):
        return None
    from megatron_glm5.models.grouped_experts import BUFFER_LAYOUT

    if layout_file and saved.get("buffer_layout") != BUFFER_LAYOUT:
        return (f"{ckpt_dir} holds distributed-optimizer state in the DP-reshardable format, stored in the order of "
                f"the parameter buffer of the version that saved it ({saved.get('buffer_layout') or 'megatron-core'}"
                f"'s), which this version lays out otherwise ({BUFFER_LAYOUT}): resume its weights with "
                "--no-load-optim")
    was_tp_pp = (saved.get("tensor_model_parallel_size"), saved.get("pipeline_model_parallel_size"))
    now = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    if was_tp_pp != now:
        return (f"{ckpt_dir} holds distributed-optimizer state saved at TP {was_tp_pp[0]} PP {was_tp_pp[1]} in the "
                f"DP-reshardable format, which loads only at that TP / PP (this run: TP {now[0]} PP {now[1]}): resume "
                f"at TP {was_tp_pp[0]} PP {was_tp_pp[1]}, leave the optimizer state out (--no-load-optim), or save "
                "with --dist-ckpt-optim-fully-reshardable")
    return None


def check_resume_state(ckpt_dir: str, common_state: dict, args) -> None:
    """The common state megatron-core loaded from ``ckpt_dir`` (``args``, ``optimizer``, ...) against this run:
    :func:`resume_refusal` from the saved run's arguments, and optimizer / scheduler state that this run would load
    but the checkpoint lacks. Raises :class:`CheckpointDirError` (one line)."""
    saved_args = common_state.get("args") if isinstance(common_state, dict) else None
    saved = dict(vars(saved_args)) if hasattr(saved_args, "__dict__") else {}
    if isinstance(common_state, dict) and "optimizer" not in common_state and "iteration" in common_state:
        saved["no_save_optim"] = True
    problem = resume_refusal(ckpt_dir, saved, args)
    if problem:
        raise CheckpointDirError(problem)


def check_checkpoint_folder(ckpt_dir: str) -> None:
    """Refuse (one line) a checkpoint folder that is not megatron-core ``torch_dist`` (``metadata.json`` naming the
    ``torch_dist`` backend, and ``.metadata``; Megatron-LM would read other formats with other, unchecked readers) or
    that holds symbolic links (a checkpoint's files are its own: nothing it names may lie outside it)."""
    try:
        names = sorted(os.listdir(ckpt_dir))
    except OSError as e:
        raise CheckpointDirError(f"{ckpt_dir}: unreadable ({e.strerror or e})") from None
    for name in names:
        if os.path.islink(os.path.join(ckpt_dir, name)):
            raise CheckpointDirError(f"{os.path.join(ckpt_dir, name)}: a symbolic link inside a checkpoint (its files "
                                     "must be its own, not links to elsewhere)")
    config = os.path.join(ckpt_dir, "metadata.json")
    if not os.path.isfile(config) or not os.path.isfile(os.path.join(ckpt_dir, ".metadata")):
        raise CheckpointDirError(f"{ckpt_dir}: not a megatron-core torch_dist checkpoint (no metadata.json and "
                                 ".metadata); this trainer reads only torch_dist checkpoints (Megatron-LM's default "
                                 "--ckpt-format)")
    backend = _json_object(config).get("sharded_backend")
    if backend != "torch_dist":
        raise CheckpointDirError(f"{config}: sharded_backend is {backend!r}; this trainer reads only torch_dist "
                                 "checkpoints")


_VERIFIED: dict = {}


def verify_checkpoint_files(ckpt_dir: str, trusted: bool = False) -> None:
    """Every file of ``ckpt_dir`` against its manifest (megatron-core's ``integrity.json`` or the converter's
    ``checksums.sha256``; a checkpoint without one is refused unless ``trusted``: --trust-unverified-checkpoint;
    every checkpoint the trainer and the converter write has one), :func:`check_checkpoint_folder`, and its
    ``.metadata`` through the restricted unpickler (storage files inside the folder). Every rank re-hashes its share
    of the files (threads; rank r the r-th of every world-size files), rank 0 also checks the folder and the
    metadata, and all ranks take the first problem in rank order; once per folder and process. Raises
    :class:`CheckpointDirError` (one line naming the file)."""
    import torch.distributed as dist

    from megatron_glm5.checkpoint.checksums import verify_manifest
    from megatron_glm5.checkpoint.safe_load import check_storage_extents, load_dcp_metadata

    key = os.path.realpath(ckpt_dir)
    if key not in _VERIFIED:
        problem = None
        many = dist.is_initialized() and dist.get_world_size() > 1
        rank, world = (dist.get_rank(), dist.get_world_size()) if many else (0, 1)
        try:
            if rank == 0:
                check_checkpoint_folder(ckpt_dir)
            if not verify_manifest(ckpt_dir, share=(rank, world)) and not trusted:
                raise CheckpointDirError(f"{ckpt_dir}: no manifest (integrity.json, checksums.sha256) to verify its "
                                         "files against; load it as it is only if you trust it, with "
                                         "--trust-unverified-checkpoint")
            if rank == 0:  # what megatron-core reads first, with its one-line refusals; items past a file's end
                check_storage_extents(load_dcp_metadata(ckpt_dir), ckpt_dir)
        except CheckpointError as e:
            problem = str(e)
        if many:
            problems = [None] * world
            dist.all_gather_object(problems, problem)
            problem = next((p for p in problems if p is not None), None)
        _VERIFIED[key] = problem
    if _VERIFIED[key] is not None:
        raise CheckpointDirError(_VERIFIED[key])


# checkpoint items that are not model weights (megatron.training's common / RNG / rerun state, optimizer state)
_NOT_WEIGHTS = ("optimizer.", "common_state", "rng_state", "rerun_state_machine_state", "content_metadata")


def _weight_key(key: str) -> bool:
    return not key.startswith(_NOT_WEIGHTS)


def check_tensors_match(sharded_state_dict, ckpt_dir: str) -> None:
    """The tensors this model (this rank's ``sharded_state_dict``) expects against the checkpoint's tensor metadata:
    every model tensor present with its global shape, and (gathered over ranks) no model tensor in the checkpoint
    that this model lacks (more layers, MTP layers or experts; megatron-core would drop them silently). Raises
    :class:`CheckpointDirError` naming the first difference."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata
    wanted, problem = set(), None
    other = "it is a checkpoint of another architecture or layer count than this run's model"
    for sh in nested_values(sharded_state_dict):
        if not isinstance(sh, (ShardedTensor, ShardedTensorFactory)) or not _weight_key(sh.key):
            continue  # byte items (_extra_state) are keyed by their sharding, which may change with the layout
        wanted.add(sh.key)
        stored = md.get(sh.key)
        if problem is not None:
            continue
        if stored is None:
            problem = f"{ckpt_dir} has no {sh.key}, which this model has: {other}"
        elif (isinstance(sh, ShardedTensor) and isinstance(stored, TensorStorageMetadata)
              and not sh.allow_shape_mismatch and tuple(stored.size) != tuple(sh.global_shape)):
            problem = (f"{ckpt_dir}: {sh.key} has shape {tuple(stored.size)} there, {tuple(sh.global_shape)} in this "
                       f"model: {other}")
    if dist.is_initialized() and dist.get_world_size() > 1:  # every rank learns every rank's verdict: no rank hangs
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (problem, sorted(wanted)))
        problem = next((p for p, _ in everyone if p is not None), None)
        wanted = set().union(*(set(w) for _, w in everyone))
    if problem is not None:
        raise CheckpointDirError(problem)
    extra = sorted(k for k, v in md.items() if isinstance(v, TensorStorageMetadata) and _weight_key(k)
                   and k not in wanted)
    if extra:
        raise CheckpointDirError(f"{ckpt_dir} holds {extra[0]}{f' (+{len(extra) - 1} more)' if len(extra) > 1 else ''}"
                                 f", which this model does not have: {other}")


# megatron-core's OptimizerParamScheduler names of the schedule values it compares on resume -> the flags behind them
_SCHEDULE_FLAGS = {
    "learning rate": "--lr", "minimum learning rate": "--min-lr",
    "warmup iterations": "--lr-warmup-iters / --lr-warmup-samples / --lr-warmup-fraction",
    "total number of iterations": "--lr-decay-iters / --lr-decay-samples / --train-iters",
    "learning rate decay style": "--lr-decay-style", "start weight decay": "--start-weight-decay / --weight-decay",
    "end weight decay": "--end-weight-decay / --weight-decay",
    "total number of weight decay iterations": "--train-iters / --train-samples",
    "weight decay incr style": "--weight-decay-incr-style",
}


def install_schedule_check() -> bool:
    """megatron-core's ``OptimizerParamScheduler._check_and_set`` asserts (a traceback) when a resumed run's learning
    rate schedule differs from the checkpoint's; it raises one :class:`CheckpointDirError` line instead, naming the
    value, the flags behind it and the two ways to resume (Megatron-LM's --use-checkpoint-opt_param-scheduler /
    --override-opt_param-scheduler). Idempotent; returns whether it installed it now."""
    from megatron_glm5 import extensions

    record = extensions.BY_NAME["schedule_check"]
    upstream = extensions.current(record)

    def _check_and_set(self, cls_value, sd_value, name):
        if self.override_opt_param_scheduler or self.use_checkpoint_opt_param_scheduler or cls_value == sd_value:
            return upstream(self, cls_value, sd_value, name)
        from megatron.training import global_vars

        run = getattr(global_vars, "_GLOBAL_ARGS", None)
        where = f"--load {run.load}" if run is not None and run.load else "the checkpoint"
        raise CheckpointDirError(
            f"{where}: its learning-rate schedule has {name} {sd_value}, this run's is {cls_value} "
            f"({_SCHEDULE_FLAGS.get(name, name)} changed since the save): keep the checkpoint's schedule with "
            "--use-checkpoint-opt_param-scheduler, or this run's with --override-opt_param-scheduler")

    return extensions.apply(record, _check_and_set)
