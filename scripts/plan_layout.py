#!/usr/bin/env python
"""Per-rank memory and per-step communication of a GLM-5.3 training layout (an estimate to choose layouts with).

    python scripts/plan_layout.py [--config glm5-flash|tiny|PATH/config.json] --gpus N [--tp N --pp N --vpp N
        --ep N --etp N --cp N] [--pipeline-layout STR] [--seq-length S] [--micro-batch-size B]
        [--global-batch-size G] [--recompute none|selective|full] [--gpu h100|h200] [--no-sp]
        [--no-distributed-optimizer] [--search] [--json]

For the worst pipeline stage of the layout it prints the parameters held by one rank and the memory of weights
(bf16), gradients (fp32 main grads), optimizer (fp32 master + Adam m, v; sharded over data parallel with the
distributed optimizer, experts over expert-data parallel) and activations (1F1B / interleaved in-flight
micro-batches), the bytes one rank sends per step for each kind of parallelism, and a step-time estimate.
``--search`` enumerates layouts for ``--gpus`` and lists the fastest ones that fit in memory.

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
def _bw(group_span: int) -> float:
    """GB/s of a collective whose ranks span ``group_span`` consecutive ranks."""
    return NVLINK_GBS if group_span <= GPUS_PER_NODE else IB_GBS


def estimate(base_hf: dict, plan: Plan, params: Optional[Dict[str, LayerParams]] = None) -> dict:
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
        weights = BF16 * p
        grads = FP32 * p
        opt_per_param = 3 * FP32                         # fp32 master + Adam m + v
        if plan.distributed_optimizer:
            optimizer = opt_per_param * (p_dense / dp + p_expert / plan.expert_dp)
        else:
            optimizer = opt_per_param * p
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
                           activations=activations, total=weights + grads + optimizer + activations,
                           inflight=inflight))
    worst = max(stages, key=lambda x: x["total"])

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
    dp_bytes = 0.0
    p_dense_w = sum(params[layer_kind(cfg, i)].tp_sharded / t + params[layer_kind(cfg, i)].replicated
                    for i in stage_layers)
    p_exp_w = sum(params[layer_kind(cfg, i)].per_rank(t, ep, etp) for i in stage_layers) - p_dense_w
    if dp > 1:
        dp_bytes += (FP32 + BF16) * p_dense_w * (dp - 1) / dp
    if plan.expert_dp > 1:
        dp_bytes += (FP32 + BF16) * p_exp_w * (plan.expert_dp - 1) / plan.expert_dp

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
    step_s = compute_s * (1 + bubble) + tp_s + cp_s + ep_s + 0.1 * (dp_s + pp_s)
    return {
        "layout": dict(gpus=plan.gpus, tp=t, sp=sp, pp=pp, vpp=vpp if vpp > 1 else None, ep=ep, etp=etp, cp=cp, dp=dp,
                       expert_dp=plan.expert_dp, pipeline_layout=str(cfg.pipeline_model_parallel_layout)
                       if cfg.pipeline_model_parallel_layout is not None else None),
        "batch": dict(seq_length=plan.seq_length, micro_batch_size=plan.micro_batch_size,
                      global_batch_size=plan.global_batch_size, micro_batches=M, recompute=plan.recompute),
        "stages": stages, "worst_stage": worst["stage"], "memory_gb": worst["total"] / 1e9,
        "gpu_memory_gb": gpu["memory_gb"], "fits": worst["total"] / 1e9 <= 0.9 * gpu["memory_gb"],
        "comm_gb_per_step": dict(tp=tp_bytes / 1e9, cp=cp_bytes / 1e9, ep=ep_bytes / 1e9, etp=etp_bytes / 1e9,
                                 pp=pp_bytes / 1e9, dp=dp_bytes / 1e9),
        "time_s": dict(compute=compute_s, bubble=compute_s * bubble, tp=tp_s, cp=cp_s, ep=ep_s, dp=dp_s, pp=pp_s,
                       step=step_s),
        "tokens_per_s_per_gpu": tokens_step / step_s / plan.gpus,
        "total_params_b": sum(v.total() for k, v in params.items() if not k.startswith(("kda", "dsa")))
        / 1e9 + sum(params[layer_kind(cfg, i)].total() for i in range(n_layers)) / 1e9,
        "active_params_b": active / 1e9,
        "distributed_optimizer": plan.distributed_optimizer,
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
    if r.get("distributed_optimizer", True):
        flags += ["--use-distributed-optimizer"]
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
             "per-rank memory (GB)   stage  layers  params(B)  weights  grads  optimizer  activations  total"]
    for s in r["stages"]:
        mark = "*" if s["stage"] == r["worst_stage"] else " "
        lines.append(f"                      {mark}{s['stage']:5d}  {s['layers']:6d}  {s['params'] / 1e9:9.2f}  "
                     f"{s['weights'] / 1e9:7.1f}  {s['grads'] / 1e9:5.1f}  {s['optimizer'] / 1e9:9.1f}  "
                     f"{s['activations'] / 1e9:11.1f}  {s['total'] / 1e9:5.1f}")
    lines.append(f"worst stage {r['worst_stage']}: {r['memory_gb']:.1f} GB of {r['gpu_memory_gb']:.0f} GB "
                 f"({'fits' if r['fits'] else 'does NOT fit'} under 90 %)")
    c = r["comm_gb_per_step"]
    lines.append("sent per rank per step (GB): " + ", ".join(f"{k} {v:.2f}" for k, v in c.items()))
    tm = r["time_s"]
    lines.append("time per step (s): " + ", ".join(f"{k} {v:.2f}" for k, v in tm.items())
                 + f"  ->  {r['tokens_per_s_per_gpu']:.0f} tokens/s/GPU")
    lines.append("pretrain_glm5_vlm.py flags: " + " ".join(
        f"'{f}'" if "|" in f or "*" in f else f for f in r["flags"]))
    return "\n".join(lines)


def search(base_hf: dict, plan: Plan, top: int = 8) -> List[dict]:
    """Layouts for ``plan.gpus`` (tp, pp, vpp, ep, etp, cp, recompute) that fit, fastest first; layouts within 3 %
    of the fastest are listed largest data-parallel size first, then fewest pipeline / context / tensor / expert
    ranks (the simpler layout when the estimate cannot tell them apart). If none fits: the one needing the least
    memory, marked ``fits: False``."""
    import contextlib
    import io

    params = None
    out, smallest = [], None
    divs = [2 ** i for i in range(int(math.log2(plan.gpus)) + 1) if plan.gpus % 2 ** i == 0]
    for tp, pp, cp, ep, rec in itertools.product([d for d in divs if d <= 8], [d for d in divs if d <= 32],
                                                 [d for d in divs if d <= 64], [d for d in divs if d <= 64],
                                                 ("selective", "full")):
        if tp * pp * cp > plan.gpus or plan.gpus % (tp * pp * cp):
            continue
        for etp in sorted({1, tp}):
            for vpp in (None, 2):
                if vpp and pp == 1:
                    continue
                cand = Plan(**{**plan.__dict__, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp, "vpp": vpp,
                               "recompute": rec, "pipeline_layout": None, "notes": []})
                try:
                    with contextlib.redirect_stderr(io.StringIO()):
                        if params is None:
                            params = count_parameters(layout_config(base_hf, Plan(gpus=1, seq_length=plan.seq_length,
                                                                                  global_batch_size=1)))
                        r = estimate(base_hf, cand, params)
                except (ValueError, AssertionError):
                    continue
                if r["fits"]:
                    out.append(r)
                elif smallest is None or r["memory_gb"] < smallest["memory_gb"]:
                    smallest = r
    if not out:
        return [smallest] if smallest is not None else []
    best = min(r["time_s"]["step"] for r in out)
    L = lambda r: r["layout"]  # noqa: E731
    near = sorted((r for r in out if r["time_s"]["step"] <= 1.03 * best),
                  key=lambda r: (-L(r)["dp"], L(r)["pp"], L(r)["cp"], L(r)["tp"], L(r)["ep"], r["time_s"]["step"]))
    rest = sorted((r for r in out if r["time_s"]["step"] > 1.03 * best), key=lambda r: r["time_s"]["step"])
    return (near + rest)[:top]


def main(argv=None) -> int:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="glm5-flash", help="preset (glm5-flash, tiny) or an HF config.json / dir")
    p.add_argument("--gpus", type=int, required=True)
    for name in ("tp", "pp", "ep", "cp"):
        p.add_argument(f"--{name}", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--etp", type=int, default=None, help="expert tensor parallel (default: tp)")
    p.add_argument("--pipeline-layout", default=None)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--global-batch-size", type=int, default=1024)
    p.add_argument("--recompute", choices=["none", "selective", "full"], default="selective")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    p.add_argument("--mfu", type=float, default=0.4, help="assumed fraction of the bf16 peak for compute")
    p.add_argument("--no-sp", action="store_true", help="no sequence parallelism")
    p.add_argument("--no-distributed-optimizer", action="store_true")
    p.add_argument("--search", action="store_true", help="list the fastest layouts that fit for --gpus")
    p.add_argument("--json", action="store_true")
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
                    mfu=args.mfu)
        results = search(base_hf, plan) if args.search else [estimate(base_hf, plan)]
        for r in results:
            r["flags"] = pretrain_flags(r)
    except (Glm5ConfigError, ValueError, OSError, AssertionError) as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(results if args.search else results[0], indent=2))
    elif not results:
        print(f"no layout for {args.gpus} GPUs divides the model")
    elif not results[0]["fits"]:
        print(f"no layout for {args.gpus} GPUs fits in {GPUS[args.gpu]['memory_gb']:.0f} GB; the least memory:\n")
        print(_fmt(results[0]))
    else:
        print("\n\n".join(_fmt(r) for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
