#!/usr/bin/env python
"""Per-rank memory and per-step communication of a GLM-5.3 training layout (an estimate to choose layouts with).

    python scripts/plan_layout.py [--config glm5-flash|tiny|PATH/config.json] --gpus N [--tp N --pp N --vpp N
        --ep N --etp N --cp N] [--pipeline-layout STR] [--seq-length S] [--micro-batch-size B]
        [--global-batch-size G] [--recompute none|selective|full] [--gpu h100|h200] [--no-sp]
        [--no-distributed-optimizer] [--use-megatron-fsdp [--data-parallel-sharding-strategy S]]
        [--grad-reduce-in-bf16] [--use-precision-aware-optimizer [--main-params-dtype D] [--main-grads-dtype D]
        [--exp-avg-dtype D] [--exp-avg-sq-dtype D]] [--optimizer-cpu-offload [--optimizer-offload-fraction F]
        [--overlap-cpu-optimizer-d2h-h2d]] [--host-memory-gb G] [--search] [--json]

For the worst pipeline stage of the layout it prints the parameters held by one rank and the memory of weights
(bf16), gradients (fp32 main grads), optimizer (fp32 master + Adam m, v; sharded over data parallel with the
distributed optimizer, experts over expert-data parallel) and activations (1F1B / interleaved in-flight
micro-batches), the bytes one rank sends per step for each kind of parallelism, and a step-time estimate.
``--search`` enumerates layouts for ``--gpus`` with each recompute granularity and each of ``LEVER_SETS`` and lists
the fastest ones that fit in memory, then a ranked summary and the winner's ``pretrain_glm5_vlm.py`` flags.

How the numbers are made (state them when you quote them):
* parameters: counted exactly from the model built on the meta device, one layer of each kind, sharded by the
  parameters' megatron attributes (TP-sharded / replicated, experts over EP then ETP), the layers of each stage
  from the config's pipeline layout;
* activations: per token and layer, the tensors autograd keeps in the GPU paths (FLA KDA, the sparse DSA backend,
  megatron's MoE with the alltoall dispatcher), bf16 activations and fp32 where the model computes in fp32 (mHC,
  KDA gates, norms, the loss); sequence parallelism divides the per-token tensors by TP except the gathered input
  the DSA layer keeps; full recompute keeps each layer's input streams only (plus one layer in backward), selective
  recompute ('core_attn') drops the mixers' internals. Expect +-30 %; allocator fragmentation is not included;
* communication: ring collectives (``(g-1)/g`` of the tensor per rank for all-gather / reduce-scatter, twice that
  for all-reduce), SP all-gather / reduce-scatter around every TP block (forward, backward and the backward
  re-gather), EP all-to-all (dispatch + combine, both directions), ETP gather / scatter of the dispatched tokens,
  PP send / recv of the streams per micro-batch and virtual stage, CP all-gather of the DSA latents and indexer
  keys plus the KDA state summaries, DP reduce-scatter of fp32 grads + all-gather of bf16 params;
* optimizer / data-parallel levers (``state_memory``, ``offload_time``; Megatron-LM's flag names): 16-bit grads
  (``--grad-reduce-in-bf16``, precision-aware ``--main-grads-dtype bf16``), the precision-aware optimizer's master /
  moment dtypes, Megatron-FSDP's sharded params / grads (dense over DP, experts over expert-DP) with two layers'
  bf16 params and one layer's grads unsharded in flight and its per-micro-batch all-gather / reduce-scatter (hidden
  behind compute up to the compute time, 10 % exposed at least), optimizer CPU offload as megatron-core's
  HybridDeviceOptimizer keeps it (16 B a host parameter, checked against ``--host-memory-gb`` a node) with its PCIe
  copies and host Adam step (``--pcie-gbs``, ``--cpu-optimizer-gbs``: assumed rates, not measured) after the
  backward; the GPU part of the optimizer step is not timed;
* time: FLOPs (6 x active parameters per token, +2 x with full recompute, plus the attention / indexer terms) at
  ``--mfu`` of the GPU's dense bf16 peak (lowered by ``(tokens / 4096) ** 0.25`` when a rank's micro-batch holds
  fewer than 4096 tokens after CP: skinny GEMMs), the pipeline bubble ``(pp - 1) / (vpp * micro-batches)``, and the TP,
  CP and EP traffic as exposed time on NVLink (a group inside 8 GPUs) or InfiniBand (400 Gb/s per GPU); DP and PP
  traffic is assumed overlapped except 10 %.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROG = "plan_layout"
GPUS = {"h100": dict(memory_gb=80.0, peak_tflops=989.0), "h200": dict(memory_gb=141.0, peak_tflops=989.0)}
NVLINK_GBS = 360.0     # effective collective bus bandwidth inside one 8-GPU node
IB_GBS = 40.0          # effective per-GPU bandwidth across nodes (400 Gb/s NDR)
GPUS_PER_NODE = 8
BF16, FP32 = 2, 4


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"{PROG}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


# ----------------------------------------------------------------------------------------------- parameters
@dataclass
class LayerParams:
    """Parameters of one layer kind at TP = EP = 1, split by how they shard."""

    tp_sharded: int = 0      # non-expert, split over TP
    replicated: int = 0      # non-expert, replicated over TP
    expert_tp: int = 0       # routed experts, split over EP, then over ETP
    expert_rep: int = 0      # routed-expert params replicated over ETP (none today)
    active_expert: int = 0   # routed-expert params one token uses (top-k of the experts)

    def per_rank(self, tp: int, ep: int, etp: int) -> float:
        return self.tp_sharded / tp + self.replicated + self.expert_tp / ep / etp + self.expert_rep / ep

    def total(self) -> int:
        return self.tp_sharded + self.replicated + self.expert_tp + self.expert_rep


def _classify(module, topk: int = 0, num_experts: int = 0) -> LayerParams:
    out = LayerParams()
    for name, p in module.named_parameters():
        n = p.numel()
        if ".experts." in f".{name}" and "shared_experts" not in name:
            if getattr(p, "tensor_model_parallel", False):
                out.expert_tp += n
            else:
                out.expert_rep += n
        elif getattr(p, "tensor_model_parallel", False):
            out.tp_sharded += n
        else:
            out.replicated += n
    if num_experts:
        out.active_expert = (out.expert_tp + out.expert_rep) * topk // num_experts
    return out


def count_parameters(cfg) -> Dict[str, LayerParams]:
    """{kind: LayerParams} for every decoder-layer kind of ``cfg`` ('attn/mlp/indexer'), 'mtp', 'embedding',
    'output', 'vision', 'final_norm'. Builds one module of each kind on the meta device (TP = EP = 1)."""
    import torch
    from megatron.core.transformer.spec_utils import build_module

    from megatron_glm5.initialize import initialize_megatron
    from megatron_glm5.models import builder  # noqa: F401  (imports before the meta context)
    from megatron_glm5.models.builder import ensure_tp_attributes
    from megatron_glm5.models.layer_specs import get_layer_spec, get_mtp_block_spec

    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        initialize_megatron()
    import megatron_glm5.models.vision  # noqa: F401
    from megatron_glm5.config import Glm5Config

    base = Glm5Config.from_hf(cfg.to_hf_dict(), use_cpu_initialization=True, perform_initialization=False)
    out: Dict[str, LayerParams] = {}
    E, k = base.num_moe_experts or 0, base.moe_router_topk
    with torch.device("meta"):
        for i in range(base.num_layers):
            kind = layer_kind(base, i)
            if kind in out:
                continue
            layer = build_module(get_layer_spec(base, i), config=base, layer_number=i + 1)
            ensure_tp_attributes(layer)
            out[kind] = _classify(layer, k, E)
        if base.mtp_num_layers:
            from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

            mtp = MultiTokenPredictionBlock(config=base, spec=get_mtp_block_spec(base))
            ensure_tp_attributes(mtp)
            out["mtp"] = _classify(mtp, k, E)
        from megatron.core import tensor_parallel

        emb = tensor_parallel.VocabParallelEmbedding(base.vocab_size, base.hidden_size, init_method=base.init_method,
                                                     config=base)
        ensure_tp_attributes(emb)
        out["embedding"] = _classify(emb)
        out["output"] = LayerParams(tp_sharded=0 if base.tie_word_embeddings else base.vocab_size * base.hidden_size)
        out["final_norm"] = LayerParams(replicated=base.hidden_size)
        if base.vision is not None:
            from megatron_glm5.models.vision import Glm5VisionModel

            out["vision"] = _classify(Glm5VisionModel(base))
    return out


def layer_kind(cfg, i: int) -> str:
    shared = cfg.layer_types[i] == "indexed_attention" and cfg.indexer_types[i] == "shared"
    return f"{'kda' if cfg.layer_types[i] == 'linear_attention' else 'dsa'}/{cfg.mlp_layer_types[i]}" + (
        "/shared" if shared else "")


# ----------------------------------------------------------------------------------------------- layout
@dataclass
class Plan:
    gpus: int
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    ep: int = 1
    etp: Optional[int] = None
    cp: int = 1
    sp: bool = True
    pipeline_layout: Optional[str] = None
    seq_length: int = 4096
    micro_batch_size: int = 1
    global_batch_size: int = 1024
    recompute: str = "selective"
    gpu: str = "h200"
    distributed_optimizer: bool = True
    mfu: float = 0.4
    # optimizer / data-parallel levers (Megatron-LM's flags)
    use_precision_aware_optimizer: bool = False
    main_params_dtype: str = "fp32"
    main_grads_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    grad_reduce_in_bf16: bool = False
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    overlap_cpu_optimizer_d2h_h2d: bool = False
    use_megatron_fsdp: bool = False
    data_parallel_sharding_strategy: str = "optim_grads_params"
    host_memory_gb: float = 2048.0
    pcie_gbs: float = 25.0
    cpu_optimizer_gbs: float = 100.0
    notes: List[str] = field(default_factory=list)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def etp_(self) -> int:
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        return self.gpus // (self.etp_ * self.ep * self.pp)

    @property
    def micro_batches(self) -> int:
        return self.global_batch_size // (self.dp * self.micro_batch_size)


def layout_config(base_hf: dict, plan: Plan):
    """Glm5Config at the plan's layout (raises Glm5ConfigError / ValueError with one line if it does not divide);
    without ``--pipeline-layout`` a PP that does not divide the layers gets ``balanced_pipeline_layout``."""
    from megatron_glm5.config import Glm5Config

    if plan.gpus % (plan.tp * plan.pp * plan.cp):
        raise ValueError(f"--gpus {plan.gpus} is not divisible by tp*pp*cp = {plan.tp * plan.pp * plan.cp}")
    if plan.gpus % (plan.etp_ * plan.ep * plan.pp):
        raise ValueError(f"--gpus {plan.gpus} is not divisible by etp*ep*pp = {plan.etp_ * plan.ep * plan.pp}")
    if plan.global_batch_size % (plan.dp * plan.micro_batch_size):
        raise ValueError(f"--global-batch-size {plan.global_batch_size} is not divisible by dp*micro-batch-size = "
                         f"{plan.dp * plan.micro_batch_size}")
    if plan.seq_length % (plan.cp * (plan.tp if plan.sp else 1)):
        raise ValueError(f"--seq-length {plan.seq_length} is not divisible by cp*tp = {plan.cp * plan.tp}")
    kw = dict(tensor_model_parallel_size=plan.tp, pipeline_model_parallel_size=plan.pp,
              virtual_pipeline_model_parallel_size=plan.vpp, expert_model_parallel_size=plan.ep,
              expert_tensor_parallel_size=plan.etp_, context_parallel_size=plan.cp,
              sequence_parallel=plan.sp and plan.tp > 1, use_cpu_initialization=True,
              perform_initialization=False)
    n_layers = Glm5Config.from_hf(base_hf).num_layers
    if plan.pipeline_layout:
        kw["pipeline_model_parallel_layout"] = plan.pipeline_layout
    elif plan.pp > 1 and n_layers % (plan.pp * (plan.vpp or 1)):
        from megatron_glm5.config.parallelism import balanced_pipeline_layout

        mtp = bool((base_hf.get("text_config") or base_hf).get("num_nextn_predict_layers"))
        kw["pipeline_model_parallel_layout"] = balanced_pipeline_layout(n_layers, plan.pp, plan.vpp, mtp)
    cfg = Glm5Config.from_hf(base_hf, **kw)
    from megatron_glm5.config.parallelism import check_parallel_layout

    check_parallel_layout(cfg, for_training=True)
    return cfg


# ----------------------------------------------------------------------------------------------- activations
def activation_bytes_per_token(cfg, kind: str, plan: Plan) -> Dict[str, float]:
    """Bytes autograd keeps per token (of this rank's sequence share) for one layer of ``kind``:
    {'full': no recompute, 'selective': mixer internals recomputed, 'input': the layer input only}."""
    t = plan.tp
    sp = t if (plan.sp and t > 1) else 1  # per-token tensors split along s under SP
    etp = plan.etp_
    h, n = cfg.hidden_size, cfg.hc_mult
    attn, mlp = kind.split("/")[:2]
    mhc = 2 * (BF16 * n * h + 2 * FP32 * n * h + BF16 * h) / sp          # two sites: streams, fp32 copies, block out
    norms = 2 * (BF16 + FP32) * h / sp
    if attn == "kda":
        HD, H = cfg.linear_num_heads * cfg.linear_head_dim, cfg.linear_num_heads
        K = V = cfg.linear_head_dim
        chunk = cfg.kda_chunk_size
        per = HD / t * (3 * BF16 + 3 * FP32 + 3 * BF16 + FP32 + FP32 + BF16 + 2 * FP32 + BF16 + BF16) + \
            H / t * K * V / chunk * FP32 + BF16 * h / sp + 2 * BF16 * cfg.linear_head_dim / sp
        mixer = per
    else:
        H, dq, dv, r, ql = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.q_lora_rank
        gathered_in = BF16 * h  # the DSA input is all-gathered once (not divided under SP)
        mixer = gathered_in + (BF16 + FP32 + BF16) * (ql + r) + H / t * (BF16 * dq + 2 * BF16 * r + 2 * BF16 * dv)
    mixer_in = BF16 * h / sp
    if mlp == "dense":
        F = cfg.ffn_hidden_size
        ffn = BF16 * h / sp + 3 * BF16 * F / t
    else:
        F = cfg.moe_ffn_hidden_size
        k = cfg.moe_router_topk
        slots = k * etp / t  # token slots each rank's experts see per local token (after the ETP gather)
        routed = slots * (2 * BF16 * h + 3 * BF16 * F / etp) + FP32 * (cfg.num_moe_experts or 0) / sp
        Fs = cfg.moe_shared_expert_intermediate_size or 0
        shared = BF16 * h / sp + 3 * BF16 * Fs / t if Fs else 0.0
        ffn = BF16 * h / sp + routed + shared
    full = mhc + norms + mixer + ffn
    selective = mhc + norms + mixer_in + ffn
    layer_input = BF16 * n * h / sp
    return {"full": full, "selective": selective, "input": layer_input}


def _stage_layers(cfg) -> Dict[tuple, range]:
    from megatron_glm5.config.parallelism import stage_layer_ranges

    return stage_layer_ranges(cfg)


# ----------------------------------------------------------------------------------------------- the estimate
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
CPU_ADAM_BYTES = 7 * FP32  # torch Adam on the host per parameter: reads param, grad, m, v; writes param, m, v


LEVER_FIELDS = ("use_precision_aware_optimizer", "main_params_dtype", "main_grads_dtype", "exp_avg_dtype",
                "exp_avg_sq_dtype", "grad_reduce_in_bf16", "optimizer_cpu_offload", "optimizer_offload_fraction",
                "overlap_cpu_optimizer_d2h_h2d", "use_megatron_fsdp", "data_parallel_sharding_strategy")


def check_levers(plan: Plan) -> None:
    """Raise ValueError (one line naming the flag) for a lever combination megatron-core refuses or ignores."""
    pao = plan.use_precision_aware_optimizer
    for flag, value in (("--main-params-dtype", plan.main_params_dtype), ("--main-grads-dtype", plan.main_grads_dtype),
                        ("--exp-avg-dtype", plan.exp_avg_dtype), ("--exp-avg-sq-dtype", plan.exp_avg_sq_dtype)):
        if value != "fp32" and not pao:
            raise ValueError(f"{flag} {value} needs --use-precision-aware-optimizer")
    if plan.optimizer_cpu_offload and not pao:
        raise ValueError("--optimizer-cpu-offload needs --use-precision-aware-optimizer (megatron-core's "
                         "HybridDeviceOptimizer reuses its code path)")
    if not 0.0 <= plan.optimizer_offload_fraction <= 1.0:
        raise ValueError(f"--optimizer-offload-fraction {plan.optimizer_offload_fraction} is not in [0, 1]")
    if (pao or plan.optimizer_cpu_offload) and not (plan.distributed_optimizer or plan.use_megatron_fsdp):
        raise ValueError("--use-precision-aware-optimizer needs the distributed optimizer or --use-megatron-fsdp")


def lever_bytes(plan: Plan) -> Dict[str, int]:
    """Bytes per parameter of each training state under the plan's levers: bf16 weights; the gradient buffer
    (fp32 main grads, bf16 with --grad-reduce-in-bf16 or the precision-aware --main-grads-dtype bf16); the
    optimizer's master copy and Adam moments (fp32, or the precision-aware --main-params-dtype / --exp-avg-dtype /
    --exp-avg-sq-dtype)."""
    pao = plan.use_precision_aware_optimizer
    grad = BF16 if plan.grad_reduce_in_bf16 or (pao and plan.main_grads_dtype == "bf16") else FP32
    d = (lambda v: DTYPE_BYTES[v]) if pao else (lambda v: FP32)
    return dict(weight=BF16, grad=grad, master=d(plan.main_params_dtype), exp_avg=d(plan.exp_avg_dtype),
                exp_avg_sq=d(plan.exp_avg_sq_dtype))


def state_memory(plan: Plan, p: float, p_dense: float, p_expert: float, dp: int, expert_dp: int,
                 p_layer: float) -> Dict[str, float]:
    """GPU / host bytes of one rank's training state for ``p`` parameters (``p_dense`` sharded over ``dp``,
    ``p_expert`` over ``expert_dp``; ``p_layer`` the rank's share of the stage's largest layer):

    * weights: bf16, whole per rank; a shard with Megatron-FSDP 'optim_grads_params';
    * grads: the gradient buffer, whole per rank; a shard with FSDP 'optim_grads' / 'optim_grads_params';
    * optimizer: master + moments of the shard (distributed optimizer or any FSDP strategy; whole per rank
      without), the fraction ``--optimizer-offload-fraction`` of it on the host with ``--optimizer-cpu-offload``;
      a bf16 gradient buffer without the precision-aware optimizer adds the fp32 copy of the shard's grads the
      distributed optimizer makes for its step;
    * fsdp_buffers: the unsharded layers FSDP keeps in flight: two layers' bf16 params (the running one and the
      prefetched one) with 'optim_grads_params', one layer's grads with a sharded gradient buffer;
    * host: the offloaded shard as megatron-core's HybridDeviceOptimizer keeps it: an fp32 copy of the params, a
      pinned fp32 grad and torch Adam's fp32 m, v (16 bytes a parameter, whatever the 16-bit state flags say)."""
    b = lever_bytes(plan)
    shard = p_dense / dp + p_expert / expert_dp
    fsdp = plan.use_megatron_fsdp
    strategy = plan.data_parallel_sharding_strategy if fsdp else None
    sharded_opt = plan.distributed_optimizer or fsdp
    opt_params = shard if sharded_opt else p
    weights = b["weight"] * (shard if strategy == "optim_grads_params" else p)
    grads = b["grad"] * (shard if strategy in ("optim_grads", "optim_grads_params") else p)
    f = plan.optimizer_offload_fraction if plan.optimizer_cpu_offload else 0.0
    per = b["master"] + b["exp_avg"] + b["exp_avg_sq"]
    optimizer = (1 - f) * per * opt_params
    if b["grad"] == BF16 and not plan.use_precision_aware_optimizer:
        optimizer += FP32 * opt_params
    buffers = 0.0
    if strategy == "optim_grads_params":
        buffers += 2 * b["weight"] * p_layer
    if strategy in ("optim_grads", "optim_grads_params"):
        buffers += b["grad"] * p_layer
    return dict(weights=weights, grads=grads, optimizer=optimizer, fsdp_buffers=buffers,
                host=f * opt_params * 4 * FP32, offloaded_params=f * opt_params)


def offload_time(plan: Plan, offloaded_params: float) -> float:
    """Seconds per step the CPU-offloaded optimizer adds: grads D2H (their buffer dtype) and fp32 params H2D at
    ``--pcie-gbs`` per GPU, and torch Adam on the host (``CPU_ADAM_BYTES`` of memory traffic a parameter, a node's
    ``--cpu-optimizer-gbs`` shared by its 8 ranks); with ``--overlap-cpu-optimizer-d2h-h2d`` the copies overlap the
    host step (the longer of the two), else they add. The step runs after the backward: none of it hides behind
    compute."""
    if not plan.optimizer_cpu_offload or offloaded_params == 0:
        return 0.0
    pcie = offloaded_params * (lever_bytes(plan)["grad"] + FP32) / (plan.pcie_gbs * 1e9)
    host = GPUS_PER_NODE * offloaded_params * CPU_ADAM_BYTES / (plan.cpu_optimizer_gbs * 1e9)
    return max(pcie, host) if plan.overlap_cpu_optimizer_d2h_h2d else pcie + host


def levers_of(plan: Plan) -> str:
    """A short name of the plan's memory levers ('distopt', 'fsdp:optim_grads_params', '+pao(bf16 m,v)', ...)."""
    out = [f"fsdp:{plan.data_parallel_sharding_strategy}" if plan.use_megatron_fsdp else
           ("distopt" if plan.distributed_optimizer else "ddp")]
    if plan.use_precision_aware_optimizer:
        b = lever_bytes(plan)
        out.append(f"pao(main {plan.main_params_dtype}, m {plan.exp_avg_dtype}, v {plan.exp_avg_sq_dtype}, "
                   f"grads {'bf16' if b['grad'] == BF16 else 'fp32'})")
    elif plan.grad_reduce_in_bf16:
        out.append("bf16 grads")
    if plan.optimizer_cpu_offload:
        out.append(f"offload {plan.optimizer_offload_fraction:g}" +
                   (" overlapped" if plan.overlap_cpu_optimizer_d2h_h2d else ""))
    out.append(f"recompute {plan.recompute}")
    return " + ".join(out)


def _bw(group_span: int) -> float:
    """GB/s of a collective whose ranks span ``group_span`` consecutive ranks."""
    return NVLINK_GBS if group_span <= GPUS_PER_NODE else IB_GBS


def estimate(base_hf: dict, plan: Plan, params: Optional[Dict[str, LayerParams]] = None, cfg=None) -> dict:
    """The plan's per-stage memory, per-step communication and step time (``cfg``: its ``layout_config``, to
    reuse across lever sets of one layout)."""
    check_levers(plan)
    if cfg is None:
        cfg = layout_config(base_hf, plan)
    if params is None:
        params = count_parameters(cfg)
    t, ep, etp, cp, pp, dp = plan.tp, plan.ep, plan.etp_, plan.cp, plan.pp, plan.dp
    vpp = cfg.virtual_pipeline_model_parallel_size or 1
    M = plan.micro_batches
    if M < 1:
        raise ValueError("fewer micro-batches than data-parallel ranks")
    s_rank = plan.seq_length // cp                      # tokens of a sequence on this CP rank
    tok = plan.micro_batch_size * s_rank                # tokens per micro-batch per rank (before SP)
    ranges = _stage_layers(cfg)
    stages = []
    for r in range(pp):
        layers = [i for v in range(vpp) for i in ranges[(r, v)]]
        first, last = r == 0, r == pp - 1
        p = sum(params[layer_kind(cfg, i)].per_rank(t, ep, etp) for i in layers)
        p_dense = sum(params[layer_kind(cfg, i)].tp_sharded / t + params[layer_kind(cfg, i)].replicated
                      for i in layers)
        extras = []
        if first:
            extras += ["embedding"] + (["vision"] if "vision" in params else [])
        if last:
            extras += ["output", "final_norm"] + (["mtp"] if "mtp" in params else [])
            if "mtp" in params and not first:
                extras.append("embedding")  # the MTP stage's copy
        for e in extras:
            p += params[e].per_rank(t, ep, etp)
            p_dense += params[e].tp_sharded / t + params[e].replicated
        p_expert = p - p_dense
        # the largest layer of the stage (the unsharded buffers Megatron-FSDP keeps in flight)
        p_layer = max([params[layer_kind(cfg, i)].per_rank(t, ep, etp) for i in layers] + [0.0])
        mem = state_memory(plan, p, p_dense, p_expert, dp, plan.expert_dp, p_layer)
        weights, grads, optimizer = mem["weights"], mem["grads"], mem["optimizer"]
        # activations: in-flight micro-batches (1F1B: pp - r; interleaved: x (1 + (pp-1)/(pp*vpp)) on the first)
        inflight = min(M * vpp, (pp - r) * (1 + (pp - 1) / (pp * vpp) if vpp > 1 else 1))
        per_layer = [activation_bytes_per_token(cfg, layer_kind(cfg, i), plan) for i in layers]
        if plan.recompute == "full":
            act_mb = sum(a["input"] for a in per_layer) * tok
            act_peak_layer = max((a["full"] for a in per_layer), default=0) * tok
        else:
            key = "selective" if plan.recompute == "selective" else "full"
            act_mb = sum(a[key] for a in per_layer) * tok
            act_peak_layer = 0.0
        if last:  # logits (bf16) + fp32 cross entropy over the whole sequence share, main head and MTP
            heads = 1 + (cfg.mtp_num_layers or 0)
            act_mb += heads * tok * (BF16 + FP32) * cfg.vocab_size / t
            if "mtp" in params:
                act_mb += activation_bytes_per_token(cfg, "dsa/sparse", plan)[
                    "input" if plan.recompute == "full" else "selective"] * tok
        if first:
            act_mb += BF16 * cfg.hidden_size * tok * 2 / (t if plan.sp else 1)
        activations = act_mb * inflight / vpp + act_peak_layer
        stages.append(dict(stage=r, layers=len(layers), params=p, weights=weights, grads=grads, optimizer=optimizer,
                           fsdp_buffers=mem["fsdp_buffers"], activations=activations,
                           total=weights + grads + optimizer + mem["fsdp_buffers"] + activations,
                           host=mem["host"], offloaded_params=mem["offloaded_params"], inflight=inflight))
    worst = max(stages, key=lambda x: x["total"])
    host_node = GPUS_PER_NODE * max(s_["host"] for s_ in stages)  # a node's 8 ranks, each at the worst stage

    # ---------------- communication per step per rank (bytes sent), forward + backward
    sp = plan.sp and t > 1
    X = tok * cfg.hidden_size * BF16                   # one [s/cp, b, h] bf16 tensor (full sequence share)
    stage_layers = [i for v in range(vpp) for i in ranges[(pp // 2 if pp > 1 else 0, v)]]  # a middle stage
    n_blocks = 2 * len(stage_layers)                   # mixer + MLP per layer
    tp_bytes = 0.0
    if t > 1:
        per_block = (3 if sp else 4) * X * (t - 1) / t  # SP: AG + RS fwd, RS + AG bwd (+ re-gather) ~3; TP: 2 AR
        tp_bytes = per_block * n_blocks * M
    ep_bytes = etp_bytes = 0.0
    moe_layers = sum(1 for i in stage_layers if cfg.mlp_layer_types[i] == "sparse")
    if moe_layers:
        k = cfg.moe_router_topk
        routed = tok / (t if sp else 1) * k * cfg.hidden_size * BF16
        if ep > 1:
            ep_bytes = 4 * routed * (ep - 1) / ep * moe_layers * M      # dispatch + combine, fwd + bwd
        if etp > 1:
            etp_bytes = 4 * routed * (etp - 1) * moe_layers * M / 1.0    # gather / scatter of the slots
    cp_bytes = 0.0
    if cp > 1:
        dsa_layers = sum(1 for i in stage_layers if cfg.layer_types[i] == "indexed_attention")
        kda_layers = len(stage_layers) - dsa_layers
        lat = plan.micro_batch_size * plan.seq_length * (cfg.kv_lora_rank + 2 * cfg.index_head_dim) * BF16
        # DSA: latents + indexer keys / gates of the whole row (fwd all-gather, bwd reduce-scatter); KDA: every
        # rank's [H, K, V + K] state summary all-gathered (docs/context_parallel.md), forward and backward
        K = cfg.linear_head_dim
        summary = cfg.linear_num_heads / t * K * (K + K) * FP32
        cp_bytes = (2 * lat * (cp - 1) / cp * dsa_layers + 2 * summary * (cp - 1) * kda_layers) * M
    pp_bytes = 0.0
    if pp > 1:
        pp_bytes = 2 * tok * cfg.hc_mult * cfg.hidden_size * BF16 / (t if sp else 1) * vpp * M
    dp_bytes = fsdp_bytes = 0.0
    p_dense_w = sum(params[layer_kind(cfg, i)].tp_sharded / t + params[layer_kind(cfg, i)].replicated
                    for i in stage_layers)
    p_exp_w = sum(params[layer_kind(cfg, i)].per_rank(t, ep, etp) for i in stage_layers) - p_dense_w
    G = lever_bytes(plan)["grad"]
    ring = p_dense_w * (dp - 1) / dp + p_exp_w * (plan.expert_dp - 1) / plan.expert_dp
    strategy = plan.data_parallel_sharding_strategy if plan.use_megatron_fsdp else "optim"
    # once per step: reduce-scatter of the grads + all-gather of the updated bf16 params (distributed optimizer,
    # FSDP 'optim'); FSDP 'optim_grads' reduce-scatters every micro-batch's grads, 'optim_grads_params' also
    # all-gathers the params before every micro-batch's forward and again before its backward
    if strategy == "optim":
        dp_bytes = (G + BF16) * ring
    elif strategy == "optim_grads":
        dp_bytes = (G + BF16) * ring
        fsdp_bytes = G * ring * (M - 1)
    else:
        dp_bytes = (G + BF16) * ring
        fsdp_bytes = G * ring * (M - 1) + BF16 * ring * (2 * M - 1)

    # ---------------- time
    gpu = GPUS[plan.gpu]
    active = 0.0
    n_layers = cfg.num_layers
    for i in range(n_layers):
        lp = params[layer_kind(cfg, i)]
        active += lp.tp_sharded + lp.replicated + lp.active_expert
    if "mtp" in params:
        active += params["mtp"].tp_sharded + params["mtp"].replicated + params["mtp"].active_expert
    active += params["output"].total()
    tokens_step = plan.global_batch_size * plan.seq_length
    flops_tok = (8 if plan.recompute == "full" else 6) * active
    # attention: KDA chunked (~4 C HD + 4 K V H per token per layer, x3 fwd+bwd), DSA sparse over index_topk
    # (absorbed: 4 H r topk), the indexer over all causal pools (2 H_idx D s / (2 kpool) on average, forward only)
    kda = sum(1 for x in cfg.layer_types if x == "linear_attention")
    dsa = n_layers - kda + (cfg.mtp_num_layers or 0)
    HD = cfg.linear_num_heads * cfg.linear_head_dim
    flops_tok += 3 * kda * (4 * cfg.kda_chunk_size * HD + 4 * cfg.linear_head_dim ** 2 * cfg.linear_num_heads)
    flops_tok += 3 * dsa * 4 * cfg.num_attention_heads * cfg.kv_lora_rank * min(cfg.index_topk, plan.seq_length)
    flops_tok += dsa * 2 * cfg.index_n_heads * cfg.index_head_dim * plan.seq_length / (2 * cfg.index_kpool)
    flops_gpu = flops_tok * tokens_step / plan.gpus
    # heuristic: GEMMs over fewer tokens run below the assumed MFU ((tokens / 4096) ** 0.25 below 4096 tokens per
    # micro-batch and rank, after CP)
    efficiency = min(1.0, tok / 4096) ** 0.25
    compute_s = flops_gpu / (gpu["peak_tflops"] * 1e12 * plan.mfu * efficiency)
    bubble = (pp - 1) / (vpp * M) if pp > 1 else 0.0
    tp_s = tp_bytes / (_bw(t) * 1e9)
    cp_s = cp_bytes / (_bw(t * cp) * 1e9)
    ep_s = (ep_bytes / (_bw(etp * ep) * 1e9)) + etp_bytes / (_bw(etp) * 1e9)
    dp_s = dp_bytes / (_bw(t * cp * dp) * 1e9)
    pp_s = pp_bytes / (_bw(t * cp * dp * pp) * 1e9)
    # Megatron-FSDP's per-micro-batch traffic overlaps compute (prefetch of the next layer) while compute lasts:
    # exposed is 10 % of it or what exceeds the compute time, whichever is more
    fsdp_comm_s = fsdp_bytes / (_bw(t * cp * dp) * 1e9)
    fsdp_s = max(0.1 * fsdp_comm_s, fsdp_comm_s - compute_s)
    offload_s = offload_time(plan, worst["offloaded_params"])
    step_s = compute_s * (1 + bubble) + tp_s + cp_s + ep_s + 0.1 * (dp_s + pp_s) + fsdp_s + offload_s
    recompute_s = compute_s * 2 / 8 if plan.recompute == "full" else 0.0
    return {
        "layout": dict(gpus=plan.gpus, tp=t, sp=sp, pp=pp, vpp=vpp if vpp > 1 else None, ep=ep, etp=etp, cp=cp, dp=dp,
                       expert_dp=plan.expert_dp, pipeline_layout=str(cfg.pipeline_model_parallel_layout)
                       if cfg.pipeline_model_parallel_layout is not None else None),
        "batch": dict(seq_length=plan.seq_length, micro_batch_size=plan.micro_batch_size,
                      global_batch_size=plan.global_batch_size, micro_batches=M, recompute=plan.recompute),
        "stages": stages, "worst_stage": worst["stage"], "memory_gb": worst["total"] / 1e9,
        "gpu_memory_gb": gpu["memory_gb"],
        "host_memory_gb_per_node": host_node / 1e9, "host_memory_gb": plan.host_memory_gb,
        "fits": worst["total"] / 1e9 <= 0.9 * gpu["memory_gb"] and host_node / 1e9 <= 0.9 * plan.host_memory_gb,
        "comm_gb_per_step": dict(tp=tp_bytes / 1e9, cp=cp_bytes / 1e9, ep=ep_bytes / 1e9, etp=etp_bytes / 1e9,
                                 pp=pp_bytes / 1e9, dp=dp_bytes / 1e9, fsdp=fsdp_bytes / 1e9),
        "time_s": dict(compute=compute_s, bubble=compute_s * bubble, tp=tp_s, cp=cp_s, ep=ep_s, dp=dp_s, pp=pp_s,
                       fsdp=fsdp_s, offload=offload_s, step=step_s),
        "lever_cost_s": dict(recompute=recompute_s, fsdp=fsdp_s, offload=offload_s),
        "levers": levers_of(plan),
        "tokens_per_s_per_gpu": tokens_step / step_s / plan.gpus,
        "total_params_b": sum(v.total() for k, v in params.items() if not k.startswith(("kda", "dsa")))
        / 1e9 + sum(params[layer_kind(cfg, i)].total() for i in range(n_layers)) / 1e9,
        "active_params_b": active / 1e9,
        "distributed_optimizer": plan.distributed_optimizer,
        "lever_flags": {k: getattr(plan, k) for k in LEVER_FIELDS},
    }


def pretrain_flags(r: dict) -> List[str]:
    """The ``pretrain_glm5_vlm.py`` flags of a planned layout (its parallel sizes, pipeline layout, recompute)."""
    L, B = r["layout"], r["batch"]
    flags = ["--tensor-model-parallel-size", str(L["tp"])] + (["--sequence-parallel"] if L["sp"] and L["tp"] > 1 else [])
    flags += ["--pipeline-model-parallel-size", str(L["pp"])]
    if L["pipeline_layout"] and L["pp"] > 1:
        flags += ["--pipeline-model-parallel-layout", L["pipeline_layout"]]
    flags += ["--expert-model-parallel-size", str(L["ep"]), "--expert-tensor-parallel-size", str(L["etp"])]
    if L["cp"] > 1:
        flags += ["--context-parallel-size", str(L["cp"])]
    if r.get("distributed_optimizer", True) or r.get("use_megatron_fsdp"):
        flags += ["--use-distributed-optimizer"]
    lev = r.get("lever_flags", {})
    if lev.get("use_megatron_fsdp"):
        flags += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", lev["data_parallel_sharding_strategy"]]
    if lev.get("grad_reduce_in_bf16"):
        flags += ["--grad-reduce-in-bf16"]
    if lev.get("use_precision_aware_optimizer"):
        flags += ["--use-precision-aware-optimizer"]
        for k in ("main_params_dtype", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            if lev[k] != "fp32":
                flags += ["--" + k.replace("_", "-"), lev[k]]
    if lev.get("optimizer_cpu_offload"):
        flags += ["--optimizer-cpu-offload", "--optimizer-offload-fraction", f"{lev['optimizer_offload_fraction']:g}"]
        if lev.get("overlap_cpu_optimizer_d2h_h2d"):
            flags += ["--overlap-cpu-optimizer-d2h-h2d"]
    if B["recompute"] == "selective":
        flags += ["--recompute-granularity", "selective"]
    elif B["recompute"] == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    return flags


def _fmt(r: dict) -> str:
    L, B = r["layout"], r["batch"]
    lines = [f"layout: {L['gpus']} GPUs = tp {L['tp']}{' (sp)' if L['sp'] else ''} x pp {L['pp']}"
             f"{' (vpp ' + str(L['vpp']) + ')' if L['vpp'] else ''} x cp {L['cp']} x dp {L['dp']}; experts: "
             f"ep {L['ep']} x etp {L['etp']} x expert-dp {L['expert_dp']}"
             + (f"; layout {L['pipeline_layout']}" if L["pipeline_layout"] else ""),
             f"batch: seq {B['seq_length']}, micro-batch {B['micro_batch_size']}, global {B['global_batch_size']} "
             f"({B['micro_batches']} micro-batches per DP rank), recompute {B['recompute']}",
             f"model: {r['total_params_b']:.1f} B parameters, {r['active_params_b']:.1f} B active per token",
             f"levers: {r['levers']}",
             "per-rank memory (GB)   stage  layers  params(B)  weights  grads  optimizer  fsdp-buf  activations  "
             "total  host"]
    for s in r["stages"]:
        mark = "*" if s["stage"] == r["worst_stage"] else " "
        lines.append(f"                      {mark}{s['stage']:5d}  {s['layers']:6d}  {s['params'] / 1e9:9.2f}  "
                     f"{s['weights'] / 1e9:7.1f}  {s['grads'] / 1e9:5.1f}  {s['optimizer'] / 1e9:9.1f}  "
                     f"{s['fsdp_buffers'] / 1e9:8.1f}  {s['activations'] / 1e9:11.1f}  {s['total'] / 1e9:5.1f}  "
                     f"{s['host'] / 1e9:4.0f}")
    lines.append(f"worst stage {r['worst_stage']}: {r['memory_gb']:.1f} GB of {r['gpu_memory_gb']:.0f} GB; host "
                 f"{r['host_memory_gb_per_node']:.0f} GB of {r['host_memory_gb']:.0f} GB a node "
                 f"({'fits' if r['fits'] else 'does NOT fit'} under 90 %)")
    c = r["comm_gb_per_step"]
    lines.append("sent per rank per step (GB): " + ", ".join(f"{k} {v:.2f}" for k, v in c.items()))
    tm = r["time_s"]
    lines.append("time per step (s): " + ", ".join(f"{k} {v:.2f}" for k, v in tm.items())
                 + f"  ->  {r['tokens_per_s_per_gpu']:.0f} tokens/s/GPU")
    lines.append("pretrain_glm5_vlm.py flags: " + " ".join(
        f"'{f}'" if "|" in f or "*" in f else f for f in r["flags"]))
    return "\n".join(lines)


_PAO16 = dict(use_precision_aware_optimizer=True, main_grads_dtype="bf16", exp_avg_dtype="bf16",
              exp_avg_sq_dtype="bf16")
_FSDP = dict(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")
# the lever sets --search tries, simplest first (the order breaks near-ties)
LEVER_SETS = [
    {},
    dict(grad_reduce_in_bf16=True),
    _PAO16,
    _FSDP,
    {**_FSDP, **_PAO16},
    {**_PAO16, "use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads"},
    *({**_PAO16, "optimizer_cpu_offload": True, "optimizer_offload_fraction": f, "overlap_cpu_optimizer_d2h_h2d": True}
      for f in (0.5, 1.0)),
    *({**_FSDP, **_PAO16, "optimizer_cpu_offload": True, "optimizer_offload_fraction": f,
       "overlap_cpu_optimizer_d2h_h2d": True} for f in (0.5, 1.0)),
]


def search(base_hf: dict, plan: Plan, top: int = 8) -> List[dict]:
    """Layouts for ``plan.gpus`` (tp, pp, vpp, ep, etp, cp, recompute) under each of ``LEVER_SETS`` that fit in the
    GPU's and the host's memory, fastest first; layouts within 3 % of the fastest are listed largest data-parallel
    size first, then fewest pipeline / context / tensor / expert ranks, then the simplest lever set (the simpler
    layout when the estimate cannot tell them apart). If none fits: the one needing the least GPU memory, marked
    ``fits: False``."""
    import contextlib
    import io

    params = None
    out, smallest = [], None
    divs = [2 ** i for i in range(int(math.log2(plan.gpus)) + 1) if plan.gpus % 2 ** i == 0]
    base = {k: v for k, v in plan.__dict__.items() if k not in LEVER_FIELDS}
    for tp, pp, cp, ep in itertools.product([d for d in divs if d <= 8], [d for d in divs if d <= 32],
                                            [d for d in divs if d <= 64], [d for d in divs if d <= 64]):
        if tp * pp * cp > plan.gpus or plan.gpus % (tp * pp * cp):
            continue
        for etp in sorted({1, tp}):
            for vpp in (None, 2):
                if vpp and pp == 1:
                    continue
                layout = {**base, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp, "vpp": vpp,
                          "pipeline_layout": None, "notes": []}
                try:
                    with contextlib.redirect_stderr(io.StringIO()):
                        cfg = layout_config(base_hf, Plan(**layout))
                        if params is None:
                            params = count_parameters(layout_config(base_hf, Plan(gpus=1, seq_length=plan.seq_length,
                                                                                  global_batch_size=1)))
                except (ValueError, AssertionError):
                    continue
                for rec in ("selective", "full"):
                    for li, lev in enumerate(LEVER_SETS):
                        cand = Plan(**{**layout, "recompute": rec, **lev})
                        try:
                            r = estimate(base_hf, cand, params, cfg)
                        except (ValueError, AssertionError):
                            continue
                        r["lever_rank"] = li
                        if r["fits"]:
                            out.append(r)
                        elif smallest is None or r["memory_gb"] < smallest["memory_gb"]:
                            smallest = r
    if not out:
        return [smallest] if smallest is not None else []
    best = min(r["time_s"]["step"] for r in out)
    L = lambda r: r["layout"]  # noqa: E731
    near = sorted((r for r in out if r["time_s"]["step"] <= 1.03 * best),
                  key=lambda r: (-L(r)["dp"], L(r)["pp"], L(r)["cp"], L(r)["tp"], L(r)["ep"], r["lever_rank"],
                                 r["time_s"]["step"]))
    rest = sorted((r for r in out if r["time_s"]["step"] > 1.03 * best), key=lambda r: r["time_s"]["step"])
    return (near + rest)[:top]


def _short_layout(L: dict) -> str:
    return (f"tp{L['tp']}{'+sp' if L['sp'] else ''} pp{L['pp']}{'/vpp' + str(L['vpp']) if L['vpp'] else ''} "
            f"cp{L['cp']} ep{L['ep']} etp{L['etp']} dp{L['dp']}")


def ranked_summary(results: List[dict]) -> str:
    """The search's ranking: one row a layout (rank, layout, levers, worst-stage GB, host GB a node, step time,
    each lever's cost in step time), then the winner's ``pretrain_glm5_vlm.py`` flags."""
    lines = ["ranked summary (lever costs: seconds of step time; selective recompute's re-run of the mixers is "
             "not modelled):",
             f"{'rank':>4}  {'layout':<34}  {'worst GB':>8}  {'host GB/node':>12}  {'step s':>7}  "
             f"{'recompute':>9}  {'fsdp':>6}  {'offload':>7}  levers"]
    for n, r in enumerate(results, 1):
        c = r["lever_cost_s"]
        lines.append(f"{n:>4}  {_short_layout(r['layout']):<34}  {r['memory_gb']:8.1f}  "
                     f"{r['host_memory_gb_per_node']:12.0f}  {r['time_s']['step']:7.2f}  {c['recompute']:9.2f}  "
                     f"{c['fsdp']:6.2f}  {c['offload']:7.2f}  {r['levers']}")
    if results and results[0]["fits"]:
        lines.append("winner: python pretrain_glm5_vlm.py " + " ".join(
            f"'{f}'" if "|" in f or "*" in f else f for f in results[0]["flags"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default="glm5-flash", help="preset (glm5-flash, tiny) or an HF config.json / dir")
    p.add_argument("--gpus", type=int, required=True)
    for name in ("tp", "pp", "ep", "cp"):
        p.add_argument(f"--{name}", type=int, default=1, help=f"{name} size")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    p.add_argument("--etp", type=int, default=None, help="expert tensor parallel (None: tp)")
    p.add_argument("--pipeline-layout", default=None, help="megatron pipeline layout string")
    p.add_argument("--seq-length", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--global-batch-size", type=int, default=1024, help="sequences per step")
    p.add_argument("--recompute", choices=["none", "selective", "full"], default="selective", help="recompute")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h200", help="the card: " + ", ".join(
        f"{k} ({v['memory_gb']:.0f} GB, {v['peak_tflops']:.0f} dense bf16 TFLOP/s)" for k, v in GPUS.items()))
    p.add_argument("--mfu", type=float, default=0.4, help="assumed fraction of the bf16 peak for compute")
    p.add_argument("--no-sp", action="store_true", help="no sequence parallelism")
    p.add_argument("--no-distributed-optimizer", action="store_true", help="optimizer state whole on every rank")
    g = p.add_argument_group("optimizer and data-parallel levers (Megatron-LM's flags)")
    g.add_argument("--use-megatron-fsdp", action="store_true", help="Megatron-FSDP over the (expert-)data-parallel "
                   "group")
    g.add_argument("--data-parallel-sharding-strategy", default="optim_grads_params",
                   choices=["optim", "optim_grads", "optim_grads_params"], help="what Megatron-FSDP shards")
    g.add_argument("--grad-reduce-in-bf16", action="store_true", help="bf16 gradient buffer and reduction")
    g.add_argument("--use-precision-aware-optimizer", action="store_true", help="16-bit optimizer state")
    g.add_argument("--main-params-dtype", default="fp32", choices=["fp32", "fp16"], help="master params")
    g.add_argument("--main-grads-dtype", default="fp32", choices=["fp32", "bf16"], help="main grads")
    g.add_argument("--exp-avg-dtype", default="fp32", choices=["fp32", "fp16", "bf16", "fp8"], help="Adam m")
    g.add_argument("--exp-avg-sq-dtype", default="fp32", choices=["fp32", "fp16", "bf16", "fp8"], help="Adam v")
    g.add_argument("--optimizer-cpu-offload", action="store_true", help="optimizer state on the host")
    g.add_argument("--optimizer-offload-fraction", type=float, default=1.0, help="fraction offloaded")
    g.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true", help="copies overlap the host step")
    g.add_argument("--host-memory-gb", type=float, default=2048.0, help="host memory per 8-GPU node")
    g.add_argument("--pcie-gbs", type=float, default=25.0, help="host <-> GPU GB/s per GPU and direction")
    g.add_argument("--cpu-optimizer-gbs", type=float, default=100.0,
                   help="memory traffic GB/s of the host Adam step per node")
    p.add_argument("--search", action="store_true", help="list the fastest layouts (and levers) that fit for --gpus")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # megatron-core's layout parser logs every layout
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found"

    from megatron_glm5.config import PRESETS, Glm5ConfigError

    try:
        if args.config in PRESETS:
            base_hf = PRESETS[args.config]().to_hf_dict()
        else:
            path = os.path.join(args.config, "config.json") if os.path.isdir(args.config) else args.config
            with open(path) as fh:
                base_hf = json.load(fh)
        plan = Plan(gpus=args.gpus, tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp, cp=args.cp,
                    sp=not args.no_sp, pipeline_layout=args.pipeline_layout, seq_length=args.seq_length,
                    micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                    recompute=args.recompute, gpu=args.gpu, distributed_optimizer=not args.no_distributed_optimizer,
                    mfu=args.mfu, host_memory_gb=args.host_memory_gb, pcie_gbs=args.pcie_gbs,
                    cpu_optimizer_gbs=args.cpu_optimizer_gbs, **{k: getattr(args, k) for k in LEVER_FIELDS})
        results = search(base_hf, plan) if args.search else [estimate(base_hf, plan)]
        for r in results:
            r["flags"] = pretrain_flags(r)
    except (Glm5ConfigError, ValueError, OSError, AssertionError) as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(results if args.search else results[0], indent=2))
    elif not results:
        odd, mbs = args.gpus // (args.gpus & -args.gpus), args.micro_batch_size
        hint = ""
        if args.global_batch_size % (odd * mbs):
            hint = (f" (every data-parallel size here is a multiple of {odd}; data-parallel size x --micro-batch-size "
                    f"must divide --global-batch-size {args.global_batch_size}: e.g. --global-batch-size "
                    f"{max(1, args.global_batch_size // (args.gpus * mbs)) * args.gpus * mbs})")
        print(f"no layout for {args.gpus} GPUs divides the model{hint}")
    elif not results[0]["fits"]:
        print(f"no layout for {args.gpus} GPUs fits in {GPUS[args.gpu]['memory_gb']:.0f} GB; the least memory:\n")
        print(_fmt(results[0]))
    else:
        print("\n\n".join(_fmt(r) for r in results))
        if args.search:
            print("\n" + ranked_summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
