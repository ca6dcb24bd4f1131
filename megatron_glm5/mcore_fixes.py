"""Workarounds for megatron-core bugs that hit every device (without Apex / Transformer Engine), installed by
:func:`apply_mcore_fixes` for the megatron-core versions known to have them (:data:`AFFECTED_VERSIONS`, checked
against ``megatron.core.package_info.__version__``: the first and last release whose sources hold each bug).

* ``TopKRouter._apply_expert_bias`` masks the ``[tokens, experts]`` routing map with the flattened ``[tokens]``
  padding mask, which broadcasts along the expert dim (an error, or a wrong count when tokens == experts): the
  padding tokens must leave the expert loads of the aux-loss-free bias update. The replacement masks per token;
  without a padding mask it counts exactly as upstream.
* ``DistributedOptimizer.state_dict`` without Apex / Transformer Engine reads the step count from the torch
  optimizer's per-parameter state and asserts there is exactly one value; a fresh optimizer has none yet, so
  building the state dict to *load* a checkpoint into (``sharded_state_dict(is_loading=True)``) fails. A fresh
  optimizer has taken 0 steps: report that (the loaded checkpoint's step then replaces it).
* ``DistributedOptimizer._set_main_param_and_optimizer_states`` (loading the fully reshardable and the DP-zero
  formats) copies every tensor of the torch optimizer's per-parameter state from the checkpoint, ``step`` included,
  which torch Adam keeps there but the formats store per param group (and which ``load_state_dict`` has already
  set): a KeyError. The DP-reshardable load (megatron's default format) calls it with autograd on, and its in-place
  copy into fp32 main params (views of parameters that require grad) raises a RuntimeError. The replacement copies
  the param and the optimizer's state tensors under ``torch.no_grad()`` and leaves ``step`` alone.
* ``DistributedOptimizer.sharded_param_state_fully_reshardable`` (saving that format) reads each parameter's state
  at its index in the gradient buffer, padding between buckets included, out of ``get_parameter_state_dp_zero``'s
  tensors, which leave that padding out. With more than one bucket (the shared embedding gets a bucket of its own
  under pipeline parallelism, or ``overlap_grad_reduce`` buckets) every later parameter's saved state is shifted
  and its end filled with zeros (upstream warns "param range exceeds unpadded buffer"). The fix hands it the
  tensors laid out like the buffer.
* ``DistributedOptimizer.load_state_dict`` without Apex / Transformer Engine gives every parameter's torch-optimizer
  state the *same* ``step`` tensor. torch's Adam increments each parameter's ``step`` in place (``_foreach_add_``),
  so after a resume the shared counter advances once per parameter per iteration and the bias corrections are
  wrong from the first step on. The replacement gives each parameter its own copy.
* ``DistributedOptimizer.sharded_param_state_dp_reshardable`` (saving megatron's default format) fills the gaps
  between parameters in the buffer with ``torch.empty`` tensors, so two saves of the same state differ in those
  bytes (uninitialised memory, also NaN / 1e38 patterns). The replacement saves zeros there.

* ``GPTDataset._build_document_sample_shuffle_indices`` and ``BlendedDataset._build_indices`` load their cached
  index ``.npy`` files (next to the data or in ``--data-cache-path``) with ``allow_pickle=True`` as soon as they
  exist: a crafted cache runs code, a truncated one is a traceback, and a cache of an earlier version of the data is
  used for the new one; a build killed while writing leaves files the next run loads. The replacements
  (:mod:`megatron_glm5.data.index_cache`) read them without pickle, check them against what they were built from,
  rebuild a bad one on rank 0 and publish new ones atomically; the deferred (``defer_npy_index_mmap``) reads,
  megatron-core's ``safe_numpy_load`` in both modules, load without pickle too.

* ``DSAIndexerLossLoggingHelper.reduce_loss_in_tracker`` (the ``indexer loss`` log line of ``training_log``, called
  on every rank) all-reduces the tracked losses over the pipeline group, but a rank whose stage holds no DSA layer
  (no tracked values: under pipeline parallelism with a DSA layer every few layers, e.g. a virtual stage of one
  KDA layer) returns before the all-reduce, and the other stages wait for it until the process group times out.
  The replacement has such a rank join with zeros of the other stages' length (one small extra all-reduce of that
  length over the pipeline group per logged iteration).

Entry points install them through :func:`megatron_glm5.initialize.install_patches` (which says in one line when
the installed megatron-core lies outside :data:`AFFECTED_VERSIONS`); importing this module changes nothing.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
from megatron.core.datasets import blended_dataset, gpt_dataset
from megatron.core.optimizer import distrib_optimizer
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper
from megatron.core.transformer.moe.router import TopKRouter

from megatron_glm5.data import index_cache
from megatron_glm5.mcore_version import MCORE_VERSION, version_in

from megatron_glm5.supported_versions import FIXES_VERSIONS as AFFECTED_VERSIONS  # noqa: E402 - first and last release with every bug above


def needs_fixes(version: str = MCORE_VERSION) -> bool:
    """Whether megatron-core ``version`` lies in :data:`AFFECTED_VERSIONS`."""
    return version_in(AFFECTED_VERSIONS, version)


def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask=None):
    """Add this forward's tokens per expert to ``local_tokens_per_expert`` (not during recompute or evaluation,
    i.e. only with autograd on); ``padding_mask`` (True = padding, any shape with one entry per token) drops
    tokens from the count."""
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1).bool()
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def _distrib_state_dict(self):
    """Upstream's state dict; a fresh torch optimizer (no per-parameter state) reports step 0."""
    if distrib_optimizer.HAVE_APEX_OR_TE or len(self.optimizer.state) > 0:
        return UPSTREAM["distrib_optimizer_fresh_state_dict"](self)
    inner = self.optimizer.state_dict()
    state_dict = {"optimizer": {k: v for k, v in inner.items() if k != "state"}}
    for param_group in state_dict["optimizer"]["param_groups"]:
        del param_group["params"]
        param_group["step"] = 0
    if self.grad_scaler:
        state_dict["grad_scaler"] = self.grad_scaler.state_dict()
    return state_dict


def _set_main_param_and_optimizer_states(self, model_param, tensors):
    """Upstream's copy of ``tensors`` ({'param', and one entry per optimizer state tensor, e.g. 'exp_avg',
    'exp_avg_sq'}) into the main param and its state, without the torch optimizer's own ``step`` entry."""
    if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        return UPSTREAM["distrib_optimizer_load_keeps_step"](self, model_param, tensors)
    group_index, group_order = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group_index]["params"][group_order]
    destinations = {"param": main_param, **{k: v for k, v in self.optimizer.state[main_param].items()
                                            if k != "step" and isinstance(v, torch.Tensor)}}
    with torch.no_grad():  # the DP-reshardable load calls this with autograd on; fp32 main params require grad
        for key, dst in destinations.items():
            if isinstance(tensors[key], torch.Tensor):
                dst.copy_(tensors[key])


def _buffer_layout_state(self, state):
    """``get_parameter_state_dp_zero``'s per-buffer tensors (bucket after bucket, padding left out) laid out as the
    gradient buffer is, each bucket at its offset (``buffer.bucket_indices``), padding zero."""
    if state is None:
        return None
    for gbuf_idx, dtype_state in state.items():
        if not isinstance(gbuf_idx, int):
            continue
        buffer = self.buffers[gbuf_idx]
        for world in dtype_state.values():
            for key in ("param",) + tuple(self.optimizer_state_keys):
                if key not in world:
                    continue
                packed, laid_out, offset = world[key], world[key].new_zeros(buffer.numel), 0
                for bucket, (start, _) in zip(buffer.buckets, buffer.bucket_indices):
                    laid_out[start:start + bucket.numel_unpadded] = packed[offset:offset + bucket.numel_unpadded]
                    offset += bucket.numel_unpadded
                world[key] = laid_out
    return state


def _fully_reshardable(self, model_sharded_state_dict, is_loading=False, metadata=None):
    """Upstream's fully reshardable state, reading each parameter's state at its buffer index."""
    packed = self.get_parameter_state_dp_zero
    self.get_parameter_state_dp_zero = lambda **kwargs: _buffer_layout_state(self, packed(**kwargs))
    try:
        return UPSTREAM["distrib_optimizer_bucket_padding"](self, model_sharded_state_dict, is_loading, metadata)
    finally:
        del self.get_parameter_state_dp_zero


def _distrib_load_state_dict(self, state_dict):
    """Upstream's load, then every parameter's torch-optimizer ``step`` a tensor of its own."""
    UPSTREAM["distrib_optimizer_step_per_param"](self, state_dict)
    for state in self.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def _padding_entries(tree):
    """The per-tensor dicts that ``sharded_param_state_dp_reshardable`` marks as padding."""
    if isinstance(tree, dict):
        marker = tree.get("padding")
        if getattr(marker, "obj", False) is True:
            yield tree
            return
        for value in tree.values():
            yield from _padding_entries(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _padding_entries(value)


def _dp_reshardable_zero_padding(self, *args, **kwargs):
    """Upstream's DP-reshardable sharded state, its padding between parameters zero instead of ``torch.empty``."""
    state = UPSTREAM["distrib_optimizer_zero_padding"](self, *args, **kwargs)
    for entry in _padding_entries(state):
        for value in entry.values():
            data = getattr(value, "data", None)
            if isinstance(data, torch.Tensor):
                data.zero_()
    return state


def _gpt_dataset_indices(self):
    """Upstream's GPTDataset index build / cache load, through :func:`megatron_glm5.data.index_cache.gpt_indices`."""
    return index_cache.gpt_indices(self, UPSTREAM["dataset_cache_gpt"])


def _blended_dataset_indices(self):
    """Upstream's BlendedDataset index build / cache load, through
    :func:`megatron_glm5.data.index_cache.blended_indices`."""
    return index_cache.blended_indices(self, UPSTREAM["dataset_cache_blended"])


def _reduce_indexer_loss_on_every_stage():
    """Upstream's reduction of the tracked indexer losses, joined by the pipeline stages that tracked none (zeros of
    the other stages' length, agreed by an all-reduce MAX of the lengths over the pipeline group)."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_pg_size

    tracker = DSAIndexerLossLoggingHelper.tracker
    ready = torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized()
    group = parallel_state.get_pipeline_model_parallel_group() if ready else None
    if group is not None and get_pg_size(group) > 1:
        values = tracker.get("values")
        length = torch.tensor([0 if values is None else values.numel()], device=torch.cuda.current_device())
        torch.distributed.all_reduce(length, op=torch.distributed.ReduceOp.MAX, group=group)
        if values is None and int(length.item()) > 0:
            tracker["values"] = torch.zeros(int(length.item()), device=torch.cuda.current_device())
    return UPSTREAM["dsa_indexer_loss_every_stage"]()


_DistOpt = distrib_optimizer.DistributedOptimizer
# name -> (class or module, attribute, replacement)
FIXES: Dict[str, Tuple[object, str, object]] = {
    "router_expert_bias_padding": (TopKRouter, "_apply_expert_bias", _apply_expert_bias),
    "distrib_optimizer_fresh_state_dict": (_DistOpt, "state_dict", _distrib_state_dict),
    "distrib_optimizer_load_keeps_step": (_DistOpt, "_set_main_param_and_optimizer_states",
                                          _set_main_param_and_optimizer_states),
    "distrib_optimizer_bucket_padding": (_DistOpt, "sharded_param_state_fully_reshardable", _fully_reshardable),
    "distrib_optimizer_step_per_param": (_DistOpt, "load_state_dict", _distrib_load_state_dict),
    "distrib_optimizer_zero_padding": (_DistOpt, "sharded_param_state_dp_reshardable", _dp_reshardable_zero_padding),
    "dataset_cache_gpt": (gpt_dataset.GPTDataset, "_build_document_sample_shuffle_indices", _gpt_dataset_indices),
    "dataset_cache_blended": (blended_dataset.BlendedDataset, "_build_indices", _blended_dataset_indices),
    "dataset_cache_gpt_deferred_load": (gpt_dataset, "safe_numpy_load", index_cache.safe_numpy_load),
    "dataset_cache_blended_deferred_load": (blended_dataset, "safe_numpy_load", index_cache.safe_numpy_load),
    # a plain function on the class: megatron-core calls it as DSAIndexerLossLoggingHelper.reduce_loss_in_tracker()
    "dsa_indexer_loss_every_stage": (DSAIndexerLossLoggingHelper, "reduce_loss_in_tracker",
                                     _reduce_indexer_loss_on_every_stage),
}
# megatron-core's own functions, as found when this module was imported
UPSTREAM: Dict[str, object] = {name: getattr(owner, attr) for name, (owner, attr, _) in FIXES.items()}


def apply_mcore_fixes() -> Tuple[str, ...]:
    """Install the workarounds (idempotent) when the installed megatron-core needs them; returns the names of the
    installed ones (``()`` for a megatron-core outside :data:`AFFECTED_VERSIONS`)."""
    if not needs_fixes():
        return ()
    from megatron_glm5 import extensions

    for name, (owner, attr, replacement) in FIXES.items():
        record = extensions.BY_NAME[_RECORD.get(name, name)]
        extensions.apply(record, replacement, owner=owner, attr=attr)
    return tuple(FIXES)


# fix name -> its record in megatron_glm5.extensions.REGISTRY (where they differ)
_RECORD = {"dataset_cache_gpt_deferred_load": "dataset_cache_deferred_load",
           "dataset_cache_blended_deferred_load": "dataset_cache_deferred_load"}
