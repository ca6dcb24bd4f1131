"""Run a callable on N gloo ranks under a parallel layout and compare what it produces with one rank.

The pieces (all CPU, fp32):

* :class:`Layout`: TP / SP / PP (+ uneven split or megatron layout string, virtual stages) / EP / ETP / CP and the
  world size (DP is what is left); it gives the ``Glm5Config`` overrides and initialises megatron's parallel state.
* :func:`spawn` (from :mod:`tests.helpers`): run ``fn(*args)`` in ``world`` spawned processes (gloo, ``RANK`` /
  ``WORLD_SIZE`` set, one thread each); returns every rank's return value, in rank order. A failing rank fails the
  call with its traceback.
* In-rank helpers for the model: :func:`build_chunks` (``build_model_chunks`` wrapped in megatron's DDP, schedule
  hooks set on the config as Megatron-LM does), :func:`save_tensors` / :func:`load_weights` (megatron
  ``dist_checkpointing``: parameters, or the reduced gradients, of the whole model, saved at this layout and read
  back unsharded), :func:`forward_backward` (megatron-core's ``get_forward_backward_func`` over this DP rank's
  share of the micro-batches), :func:`tp_replica_mismatch` (gradients of TP-replicated parameters must agree on all
  TP ranks: a missing reduction shows up here even where the checkpoint only stores TP rank 0's copy).
* In the parent: :func:`read_tensors` (a saved model as ``{key: full tensor}``) and :func:`compare` (relative
  differences per tensor and scaled by the owning module's largest value).

The training-loop tests plug in their own callable: spawn the layout, run N steps, ``save_tensors`` the weights
after the steps, return the per-step losses, and ``compare`` with the one-rank run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

# ----------------------------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """A parallel layout. ``pipeline_layout`` is megatron's string form ('Ettt|ttmL'); ``first_stage_layers`` /
    ``last_stage_layers`` are Megatron-LM's --decoder-first/last-pipeline-num-layers."""

    world: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    cp: int = 1
    sp: bool = False
    vpp: Optional[int] = None
    pipeline_layout: Optional[str] = None
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def virtual_stages(self) -> Optional[int]:
        if self.pipeline_layout is not None:
            from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

            n = PipelineParallelLayerLayout.get_num_stages_from_str(self.pipeline_layout) // self.pp
            return n if n > 1 else None
        return self.vpp

    def config_overrides(self) -> dict:
        kw = dict(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                  expert_model_parallel_size=self.ep, expert_tensor_parallel_size=self.etp,
                  context_parallel_size=self.cp, sequence_parallel=self.sp,
                  virtual_pipeline_model_parallel_size=self.virtual_stages)
        if self.pipeline_layout is not None:
            kw["pipeline_model_parallel_layout"] = self.pipeline_layout
        if self.first_stage_layers is not None:
            kw["num_layers_in_first_pipeline_stage"] = self.first_stage_layers
        if self.last_stage_layers is not None:
            kw["num_layers_in_last_pipeline_stage"] = self.last_stage_layers
        return kw

    def initialize(self, seed: int = 1234) -> None:
        from megatron_glm5.initialize import initialize_megatron

        initialize_megatron(tp=self.tp, pp=self.pp, ep=self.ep, cp=self.cp, vpp=self.virtual_stages, seed=seed,
                            etp=self.etp)


# ----------------------------------------------------------------------------------------------- processes
# one spawn helper for every multi-rank test (tests/helpers.py)
from tests.helpers import free_port, spawn  # noqa: E402,F401


# ----------------------------------------------------------------------------------------------- in-rank helpers
def build_config(hf_config: dict, layout: Layout, **overrides):
    """fp32 CPU ``Glm5Config`` of ``hf_config`` at ``layout`` (torch reference backends)."""
    from megatron_glm5.config import Glm5Config

    kw = dict(use_cpu_initialization=True, params_dtype=torch.float32, kda_backend="torch", dsa_backend="torch")
    kw.update(layout.config_overrides())
    kw.update(overrides)
    return Glm5Config.from_hf(hf_config, **kw)


def build_chunks(config, ddp: bool = True) -> list:
    """This rank's model chunks (``build_model_chunks``), wrapped in megatron's DDP (no bucketing after the first
    chunk, as Megatron-LM), with the config's schedule hooks set (``no_sync_func``, ``finalize_model_grads_func``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from megatron_glm5.models.builder import build_model_chunks

    chunks = build_model_chunks(config)
    for c in chunks:
        c.train()
    if not ddp:
        return chunks
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    wrapped = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
               for i, c in enumerate(chunks)]
    config.no_sync_func = [w.no_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def unwrap(chunk):
    return getattr(chunk, "module", chunk)


def _sharded_state_dict(chunks) -> dict:
    """One sharded state dict per chunk under ``model{i}`` (Megatron-LM's naming: virtual stages of one rank share
    local module names; their sharded keys are global)."""
    return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


def _param_keys(chunks, sd) -> List[str]:
    """Sharded keys whose data is a parameter (not a buffer such as the router's expert bias)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    ids = {id(p) for c in chunks for p in unwrap(c).parameters()}
    return sorted({v.key for v in nested_values(sd) if hasattr(v, "key") and id(getattr(v, "data", None)) in ids})


def save_tensors(chunks, out_dir: str, what: str = "param") -> List[str]:
    """Save the whole model's parameters (``what='param'``) or their reduced gradients (``'grad'``: DDP's
    ``main_grad``, else ``.grad``) with megatron ``dist_checkpointing`` at this layout. Every rank must call it.
    Returns the parameter keys (buffers are saved too but not listed)."""
    from megatron.core import dist_checkpointing

    swapped = []
    if what == "grad":
        for c in chunks:
            for p in unwrap(c).parameters():
                g = getattr(p, "main_grad", None)
                if g is None:
                    g = p.grad if p.grad is not None else torch.zeros_like(p)
                swapped.append((p, p.data))
                p.data = g.detach().to(p.dtype).view_as(p)
    elif what != "param":
        raise ValueError(what)
    try:
        os.makedirs(out_dir, exist_ok=True)
        sd = _sharded_state_dict(chunks)
        keys = _param_keys(chunks, sd)
        dist_checkpointing.save(sd, out_dir)
    finally:
        for p, data in swapped:
            p.data = data
    torch.distributed.barrier()
    return keys


def load_weights(chunks, ckpt_dir: str) -> None:
    """Load a ``dist_checkpointing`` checkpoint saved at any layout into this rank's chunks (strict)."""
    from megatron.core import dist_checkpointing

    sd = dist_checkpointing.load(_sharded_state_dict(chunks), ckpt_dir)
    for i, c in enumerate(chunks):
        unwrap(c).load_state_dict(sd[f"model{i}"], strict=True)


def tp_replica_mismatch(chunks) -> float:
    """Largest relative difference, over the TP group, of the gradients of TP-replicated parameters (0 if TP=1)."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    if group.size() == 1:
        return 0.0
    grads = []
    for c in chunks:
        for name, p in unwrap(c).named_parameters():
            if getattr(p, "tensor_model_parallel", False) or ".experts." in name:
                continue
            g = getattr(p, "main_grad", None)
            grads.append((g if g is not None else p.grad if p.grad is not None else torch.zeros_like(p)).flatten())
    if not grads:
        return 0.0
    flat = torch.cat(grads).float()
    gathered = [torch.empty_like(flat) for _ in range(group.size())]
    torch.distributed.all_gather(gathered, flat, group=group)
    scale = flat.abs().max().clamp(min=1e-30)
    return max(float((g - flat).abs().max() / scale) for g in gathered)


def forward_backward(chunks, batches: Sequence[dict], config, forward_only: bool = False) -> List[float]:
    """One forward+backward over this DP rank's share of ``batches`` (the global micro-batches, equal on every
    rank) through megatron-core's ``get_forward_backward_func``; DDP grads are zeroed first. Returns the per
    micro-batch 'lm loss' on last-stage ranks ([] elsewhere)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_glm5.models.packing import make_packed_seq_params

    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if len(batches) % dp:
        raise ValueError(f"{len(batches)} micro-batches for DP {dp}")
    m = len(batches) // dp
    mine = list(batches[r * m:(r + 1) * m])

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["input_ids"], labels=b["labels"], loss_mask=b["loss_mask"],
                    packed_seq_params=make_packed_seq_params(b["cu_seqlens"]), pixel_values=b.get("pixel_values"),
                    image_grid_thw=b.get("image_grid_thw"))

        def loss_func(output_tensor):
            mask = b["loss_mask"]
            loss = (output_tensor.float() * mask).sum() / mask.sum()
            return loss, {"lm loss": loss.detach().clone()}

        return out, loss_func

    for c in chunks:
        if hasattr(c, "zero_grad_buffer"):
            c.zero_grad_buffer()
    iters = [iter(mine) for _ in chunks]
    seq = int(batches[0]["input_ids"].shape[1])
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iters if len(chunks) > 1 else iters[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=m, seq_length=seq, micro_batch_size=1,
        forward_only=forward_only)
    return [float(d["lm loss"]) for d in losses] if losses else []


# ----------------------------------------------------------------------------------------------- data
def make_batches(hf_config: dict, n: int, doc_lens: Sequence[int] = (9, 13, 10), image_every: int = 2,
                 seed: int = 0) -> List[dict]:
    """``n`` packed rows (b = 1) of ``doc_lens`` documents each; every ``image_every``-th row carries an image in
    its second document (when the config has a vision tower). Labels are the next token inside each document
    (the last token of a document is masked)."""
    from megatron_glm5.data.synthetic import cu_seqlens_of, packed_documents

    out = []
    for i in range(n):
        with_image = "vision_config" in hf_config and image_every and i % image_every == 0
        docs, pv, grid = packed_documents(hf_config, doc_lens, image_doc=1 if with_image else None,
                                          grid_thw=(1, 4, 4), image_at=2, seed=seed + i)
        labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs])[None]
        b = {"input_ids": torch.cat(docs)[None], "labels": labels.clamp(min=0),
             "loss_mask": (labels != -100).float(), "cu_seqlens": cu_seqlens_of(doc_lens)}
        if with_image:
            b.update(pixel_values=pv, image_grid_thw=grid)
        out.append(b)
    return out


# ----------------------------------------------------------------------------------------------- parent side
def read_tensors(ckpt_dir: str) -> Dict[str, torch.Tensor]:
    """A ``save_tensors`` checkpoint as ``{sharded key: full tensor}`` (needs a process group: the ``mcore``
    fixture)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_plain_tensors(ckpt_dir)


def compare(ref: Dict[str, torch.Tensor], got: Dict[str, torch.Tensor], keys: Optional[Sequence[str]] = None):
    """Relative differences of ``got`` against ``ref`` over ``keys`` (default: all of ``ref``).

    Per tensor: ``max|got - ref| / max|ref|``. Module-scaled: the same difference divided by the largest ``|ref|``
    among the tensors of the module that owns it (the key up to its last dot: an mHC site's fn / base / scale, a
    KDA layer's A_log / dt_bias / convs). The module scale is the meaningful one for tensors whose gradient is a
    sum with heavy cancellation (mHC base and scale: their fp32 values move by ~4e-5 of themselves between two
    one-rank runs that only differ in the BLAS thread count). Returns ``(worst_module_scaled, key, per_tensor)``
    where ``per_tensor`` maps key -> (per-tensor rel, module-scaled rel); a key missing on one side raises."""
    keys = sorted(ref) if keys is None else list(keys)
    missing = [k for k in keys if k not in got]
    if missing:
        raise KeyError(f"missing in the parallel run: {missing[:8]}")
    peak = {k: float(ref[k].abs().max()) if ref[k].numel() else 0.0 for k in keys}
    module_peak: Dict[str, float] = {}
    for k in keys:
        owner = k.rsplit(".", 1)[0]
        module_peak[owner] = max(module_peak.get(owner, 0.0), peak[k])
    out = {}
    for k in keys:
        a, b = ref[k].double(), got[k].double()
        if a.shape != b.shape:
            raise ValueError(f"{k}: shape {tuple(b.shape)} vs reference {tuple(a.shape)}")
        diff = float((a - b).abs().max()) if a.numel() else 0.0
        scale = module_peak[k.rsplit(".", 1)[0]]
        out[k] = (diff / peak[k] if peak[k] > 0 else diff, diff / scale if scale > 0 else diff)
    worst = max(out, key=lambda k: out[k][1])
    return out[worst][1], worst, out
