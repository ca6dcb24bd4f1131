"""GLM-5.3-Flash's model config on top of megatron-core's ``MLATransformerConfig``: every field with its docstring,
and the checks of a field's value (``validate_glm`` raises one ``Glm5ConfigError`` naming the first inconsistent
field; the parallel layout is checked by :mod:`megatron_glm5.config.parallelism`).

Which kernels, graphs and fused paths run is not a config field's default: the backend fields name the reference
paths, and :func:`megatron_glm5.execution_plan.resolve_execution_plan` decides what runs on a device.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron_glm5.config.hf import HFConfigIO
from megatron_glm5.config.hf_defaults import HF_TEXT_DEFAULTS as _HF
from megatron_glm5.config.hf_defaults import HF_TOP_DEFAULTS as _HF_TOP
from megatron_glm5.config.vision import Glm5VisionConfig
from megatron_glm5.errors import Glm5ConfigError
from megatron_glm5.layer_types import DENSE_MLP, INDEXED_ATTENTION, LINEAR_ATTENTION, SPARSE_MLP
from megatron_glm5.config.parallelism import prepare_parallel_layout

KDA_BACKENDS = ("torch", "fla", "fla_fused")
KDA_CONV_KERNELS = ("triton", "fla")
DSA_BACKENDS = ("torch", "sparse", "fused")
MOE_EXPERTS_BACKENDS = ("sequential", "grouped")
MAX_SINKHORN_ITERS = 1000
"""Most Sinkhorn iterations of the mHC comb matrix (the released model runs 20; each is two normalisations per
layer and token, forward and backward)."""


def device_memory_bytes(device: str) -> Tuple[int, str]:
    """(bytes, what) of the memory a model built on ``device`` ('cuda' or 'cpu') can use: the current GPU's total
    memory, or the machine's physical memory capped by the cgroup limit of this process."""
    if device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return int(props.total_memory), f"this GPU ({props.name})"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
        break
    return int(total), "this machine's memory"


def torch_dtype_bytes(dtype) -> int:
    """Bytes of one element of the torch ``dtype``."""
    return int(dtype.itemsize)


@dataclass
class Glm5Config(HFConfigIO, MLATransformerConfig):
    """GLM-5.3-Flash text decoder (+ optional vision tower) as a megatron-core config.

    megatron-core fields carry the shared parts (num_layers, hidden_size, num_attention_heads = DSA heads,
    ffn_hidden_size = dense MLP width, MLA ranks, MoE router/expert settings, mtp_num_layers). The fields below
    carry what megatron-core has no name for; those named as an HF config key default to transformers'
    ``Glm5NextTextConfig`` / ``Glm5NextConfig`` default (:mod:`~megatron_glm5.config.hf_defaults`), the same value
    ``from_hf`` gives a config.json that leaves the key out.
    """

    # ---- vocabulary / embeddings ----
    vocab_size: int = _HF["vocab_size"]
    """Size of the token vocabulary (embedding rows and lm_head rows)."""
    pad_token_id: Optional[int] = None
    """Padding token id as the config.json gives it, None where it gives none (informational; the embedding has no
    special padding row at training time, and the context-parallel padding uses 0 when this is None)."""
    tie_word_embeddings: bool = _HF["tie_word_embeddings"]
    """GLM-5.3 unties lm_head from the embedding."""

    # ---- per-layer schedules ----
    layer_types: List[str] = field(default_factory=list)
    """Per decoder layer: 'linear_attention' (KDA) or 'indexed_attention' (KPool DSA)."""
    mlp_layer_types: List[str] = field(default_factory=list)
    """Per decoder layer: 'dense' (MLP of ffn_hidden_size) or 'sparse' (MoE)."""
    indexer_types: List[str] = field(default_factory=list)
    """Per decoder layer: 'full' (the DSA layer runs its own indexer) or 'shared' (reuses the top-k of the previous
    full DSA layer). Only read at DSA layers."""

    # ---- Kimi Delta Attention ----
    linear_num_heads: int = _HF["linear_num_heads"]
    """KDA heads (q, k and v share the head count)."""
    linear_head_dim: int = _HF["linear_head_dim"]
    """KDA head dimension (K = V)."""
    linear_conv_kernel_dim: int = _HF["linear_conv_kernel_dim"]
    """Width of the causal depthwise short convolution on q, k and v."""
    linear_lower_bound: Optional[float] = _HF["linear_lower_bound"]
    """Bounded ('safe') forget gate: g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)); None selects the softplus
    gate g = -exp(A_log) * softplus(f + dt_bias)."""
    kda_chunk_size: int = 64
    """Chunk length of the chunked delta rule (torch backend and FLA)."""
    kda_backend: Optional[str] = None
    """'torch' (chunked PyTorch delta rule, runs anywhere), 'fla' (flash-linear-attention chunk_kda, CUDA) or
    'fla_fused' (FLA conv, in-kernel gates and fused gated norm around chunk_kda: the GPU fast path, for bf16; in
    fp32 its TF32 inside FLA's gate and norm kernels puts it ~10x further from the fp32 reference than 'fla').
    None: the execution plan picks (:mod:`megatron_glm5.execution_plan`)."""
    kda_conv_kernel: str = "triton"
    """'fla_fused': the short convolution with its SiLU, forward and backward: 'triton' (``kernels/short_conv.py``,
    one pass each way, the pre-activation recomputed inside the backward kernel; up to 4 taps, wider convolutions
    take FLA's) or 'fla' (FLA's ``causal_conv1d``, whose backward runs the forward again first)."""
    kda_save_intermediates: Optional[bool] = None
    """'fla_fused': keep ``chunk_kda``'s forward intermediates (gate cumsum, w, u, gated q / k, v_new and the chunk
    states h) for its backward instead of recomputing them there (FLA's ``disable_recompute``). Same arithmetic; at
    the released widths it holds ~0.57 GiB more per KDA layer per 4K tokens until the backward. None: on with
    'fla_fused' (the execution plan; ``--no-kda-save-intermediates`` turns it off)."""

    # ---- KPool DSA ----
    index_n_heads: int = _HF["index_n_heads"]
    """Indexer heads."""
    index_head_dim: int = _HF["index_head_dim"]
    """Indexer head dimension (also the pooled-key width)."""
    index_topk: int = _HF["index_topk"]
    """Token budget of the sparse attention; index_topk / index_kpool pools are selected per query."""
    index_kpool: int = _HF["index_kpool"]
    """Tokens per pool. The released checkpoint uses 4 (the HF class default is 16): always read it from the file."""
    index_kpool_always_select_tail: bool = _HF["index_kpool_always_select_tail"]
    """Whether the query's own incomplete pool (up to and including the query) is always attended."""
    dsa_indexer_warmup: bool = False
    """The indexer's dense warm-up stage (DeepSeek-V3.2): the DSA layers attend densely to every causal position of
    the query's document, every parameter but the indexers' is frozen, and only the indexer loss
    (``dsa_indexer_loss_coeff`` > 0, megatron-core's field, as is ``dsa_indexer_use_sparse_loss``) trains; the MoE
    expert-bias update is off (:attr:`WARMUP_HOLDS`). Off: the
    sparse stage (top-k attention; the indexer loss, when on, next to the LM loss)."""
    WARMUP_HOLDS: ClassVar[Dict[str, Any]] = {"moe_router_bias_update_rate": 0.0}
    """The fields the warm-up stage sets over their given values (which apply after it)."""
    dsa_backend: Optional[str] = None
    """'torch' (masked dense reference, quadratic), 'sparse' (gathers only the selected positions) or 'fused' (the
    Triton sparse absorbed-MLA kernel, forward and backward: the GPU fast path). None: the execution plan picks."""

    # ---- manifold-constrained hyper-connections ----
    hc_mult: int = _HF["hc_mult"]
    """Number of residual streams."""
    hc_eps: float = _HF["hc_eps"]
    """Epsilon added to pre weights and inside each Sinkhorn normalisation."""
    hc_sinkhorn_iters: int = _HF["hc_sinkhorn_iters"]
    """Sinkhorn iterations for the comb (stream mixing) matrix."""
    mhc_stream_grad_fusion: bool = False
    """Fused mHC path (CUDA): the output side's gradient of the residual streams is added inside the input side's
    projection backward kernel instead of by autograd (one read of the streams gradient instead of a separate add
    of two)."""

    # ---- MoE extras ----
    swiglu_limit: float = _HF["swiglu_limit"]
    """SwiGLU clamp (gate above, up on both sides) for dense MLP, experts and shared expert."""
    norm_topk_prob: bool = _HF["norm_topk_prob"]
    """Normalise the selected sigmoid scores to sum to 1 (megatron-core's sigmoid router always does for topk>1)."""
    n_shared_experts: int = _HF["n_shared_experts"]
    """Shared experts, fused into one MLP of moe_ffn_hidden_size * n_shared_experts."""
    moe_experts_backend: Optional[str] = None
    """Routed experts: 'sequential' (megatron-core SequentialMLP, one GEMM pair per expert) or 'grouped' (the same
    parameters and checkpoint keys, run as torch._grouped_mm grouped GEMMs on CUDA: the GPU fast path). None: the
    execution plan picks."""
    moe_cuda_graph: Optional[bool] = None
    """Run each MoE layer's forward and backward as replayed CUDA graphs (``models/cuda_graphs.py``, one capture
    per input shape) instead of launching its ~100 kernels from Python every step: the GPU fast path for short
    steps, which wait for the host. Training on CUDA only, and only without collectives inside the layer (EP, TP,
    CP of 1; no global aux loss), sinkhorn routing, token dropping or activation recompute
    (``execution_plan.moe_graph_blockers``); the aux, sequence aux and z-losses are captured with the layer;
    otherwise, or in evaluation, the layer runs eagerly. The same operations as eager (cuBLAS may pick other GEMM
    algorithms under capture: bf16 rounding). None: on for CUDA (the execution plan)."""

    # ---- vision / multimodal ----
    vision: Optional[Glm5VisionConfig] = None
    """Vision tower config; None builds a text-only model."""
    image_token_id: int = _HF_TOP["image_token_id"]
    """Placeholder token replaced by merged image features."""
    video_token_id: int = _HF_TOP["video_token_id"]
    """Video placeholder id (same as image id in some checkpoints; videos are told apart by start/end spans)."""
    image_start_token_id: int = _HF_TOP["image_start_token_id"]
    """Token that opens an image's placeholder span."""
    image_end_token_id: int = _HF_TOP["image_end_token_id"]
    """Token that closes an image's placeholder span."""
    video_start_token_id: int = _HF_TOP["video_start_token_id"]
    """Token that opens a video's placeholder span."""
    video_end_token_id: int = _HF_TOP["video_end_token_id"]
    """Token that closes a video's placeholder span."""

    # ---- pipeline ----
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Megatron-LM's --num-layers-per-virtual-pipeline-stage: decoder layers per model chunk; sets
    ``virtual_pipeline_model_parallel_size = num_layers / pipeline_model_parallel_size / this`` (even stages only;
    with uneven stages give a ``pipeline_model_parallel_layout`` instead)."""

    # ---- bookkeeping ----
    hf_text_config: dict = field(default_factory=dict)
    """The raw HF text config this was built from (written back on export)."""
    execution_plan: Optional[Any] = None
    """What runs (:class:`megatron_glm5.execution_plan.ExecutionPlan`): set by ``build_model`` for the device it
    builds on; the modules read their backend, kernel and graph switches from it."""
    hf_quantization_config: Optional[dict] = None
    """The HF ``quantization_config`` of the checkpoint this was built from (its FP8 block: the import dequantises
    with it, the FP8 export quantises with it); written back by ``to_hf_dict``."""

    def __post_init__(self):
        self.validate_glm()
        if (self.dsa_indexer_loss_coeff or 0) > 0 and self.experimental_attention_variant_loss_scale_func is None:
            # the schedules hand the main loss's backward scale to the indexer loss (megatron-core's DSA hook)
            from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

            self.experimental_attention_variant_loss_scale_func = DSAIndexerLossAutoScaler.set_loss_scale
        if self.dsa_indexer_warmup:
            for name, value in self.WARMUP_HOLDS.items():
                setattr(self, name, value)
        if self.activation_func_clamp_value is None:
            self.activation_func_clamp_value = self.swiglu_limit
        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            self.pipeline_dtype = self.params_dtype
        prepare_parallel_layout(self)  # default uneven layout, one-line refusals of layouts that do not divide
        super().__post_init__()

    # ------------------------------------------------------------------ validation
    def validate_glm(self):
        """Raise Glm5ConfigError naming the first inconsistent GLM field."""
        n = self.num_layers

        def need(cond, fld, msg):
            if not cond:
                raise Glm5ConfigError(f"{fld}: {msg}")

        need(len(self.layer_types) == n, "layer_types", f"has {len(self.layer_types)} entries for {n} layers")
        need(len(self.mlp_layer_types) == n, "mlp_layer_types", f"has {len(self.mlp_layer_types)} entries for {n} layers")
        if not self.indexer_types:
            self.indexer_types = ["full"] * n
        need(len(self.indexer_types) == n, "indexer_types", f"has {len(self.indexer_types)} entries for {n} layers")
        for i, t in enumerate(self.layer_types):
            need(t in (LINEAR_ATTENTION, INDEXED_ATTENTION), "layer_types",
                 f"entry {i} is {t!r}; expected 'linear_attention' or 'indexed_attention'")
        for i, t in enumerate(self.mlp_layer_types):
            need(t in (DENSE_MLP, SPARSE_MLP), "mlp_layer_types", f"entry {i} is {t!r}; expected 'dense' or 'sparse'")
        first_full = None
        for i, t in enumerate(self.indexer_types):
            need(t in ("full", "shared"), "indexer_types", f"entry {i} is {t!r}; expected 'full' or 'shared'")
            if self.layer_types[i] == INDEXED_ATTENTION:
                if t == "full" and first_full is None:
                    first_full = i
                need(t == "full" or first_full is not None, "indexer_types",
                     f"DSA layer {i} is 'shared' but no earlier DSA layer runs a full indexer")
        need(self.linear_num_heads > 0 and self.linear_head_dim > 0, "linear_num_heads", "must be positive")
        need(self.linear_head_dim <= 256, "linear_head_dim", f"{self.linear_head_dim} > 256 is not supported by the KDA kernels")
        need(self.linear_conv_kernel_dim >= 1, "linear_conv_kernel_dim", "must be >= 1")
        need(self.linear_lower_bound is None or self.linear_lower_bound < 0, "linear_lower_bound", "must be negative or null")
        for name, allowed in (("kda_backend", KDA_BACKENDS), ("dsa_backend", DSA_BACKENDS),
                              ("moe_experts_backend", MOE_EXPERTS_BACKENDS)):
            value = getattr(self, name)
            need(value is None or value in allowed, name, f"{value!r} not in {allowed}")
        need(self.kda_conv_kernel in KDA_CONV_KERNELS, "kda_conv_kernel",
             f"{self.kda_conv_kernel!r} not in {KDA_CONV_KERNELS}")
        need(self.kda_chunk_size in (16, 32, 64), "kda_chunk_size", "must be 16, 32 or 64")
        need(self.index_kpool >= 1, "index_kpool", f"must be positive, got {self.index_kpool}")
        need(self.index_topk % self.index_kpool == 0, "index_topk",
             f"{self.index_topk} is not divisible by index_kpool {self.index_kpool}")
        need(self.index_topk >= self.index_kpool, "index_topk", "must be at least index_kpool")
        need(self.qk_pos_emb_head_dim == 0, "qk_rope_head_dim", "GLM-5.3 DSA is NoPE; must be 0")
        need(self.q_lora_rank is not None and self.q_lora_rank > 0, "q_lora_rank", "is required for DSA layers")
        need(self.hc_mult >= 1, "hc_mult", "must be >= 1")
        need(1 <= self.hc_sinkhorn_iters <= MAX_SINKHORN_ITERS, "hc_sinkhorn_iters",
             f"must be in [1, {MAX_SINKHORN_ITERS}], got {self.hc_sinkhorn_iters}")
        need(self.norm_topk_prob or self.moe_router_topk == 1, "norm_topk_prob",
             "False is not supported (megatron-core's sigmoid router normalises the top-k scores)")
        if SPARSE_MLP in self.mlp_layer_types:
            need(self.num_moe_experts is not None and self.num_moe_experts > 0, "n_routed_experts", "must be positive")
            need(self.moe_router_topk <= self.num_moe_experts, "num_experts_per_tok",
                 f"{self.moe_router_topk} > n_routed_experts {self.num_moe_experts}")
            groups = self.moe_router_num_groups
            if groups:
                need(self.num_moe_experts % groups == 0, "n_group", "must divide n_routed_experts")
                need(self.moe_router_topk // self.moe_router_group_topk == 2, "topk_group",
                     "group-limited routing is only equal to HF when num_experts_per_tok / topk_group == 2")
        coeff = self.dsa_indexer_loss_coeff
        need(coeff is None or coeff >= 0, "dsa_indexer_loss_coeff", f"must not be negative, got {coeff}")
        need(not self.dsa_indexer_warmup or (coeff or 0) > 0, "dsa_indexer_warmup",
             "needs dsa_indexer_loss_coeff > 0 (the warm-up trains only the indexer loss)")
        if self.mtp_num_layers:
            need(self.mtp_num_layers == 1, "num_nextn_predict_layers", "only one MTP layer is supported")
        if self.recompute_granularity == "selective":
            bad = sorted(set(self.recompute_modules or []) - {"core_attn", "layernorm", "mlp", "moe", "shared_experts"})
            need(not bad, "recompute_modules", f"{bad} not available in GLM layers (core_attn, layernorm, mlp, moe, "
                                               f"shared_experts are)")
        if self.recompute_granularity == "full" and self.mtp_num_layers and self.recompute_method == "uniform":
            need(self.recompute_num_layers == 1, "recompute_num_layers",
                 "must be 1 with recompute_method 'uniform' and an MTP layer (megatron-core's MTP recompute)")
        if self.vision is not None:
            self.vision.validate()
            need(self.vision.out_hidden_size == self.hidden_size, "vision_config.out_hidden_size",
                 f"{self.vision.out_hidden_size} != text hidden_size {self.hidden_size}")

    # ------------------------------------------------------------------ memory
    def rank_weight_bytes_lower_bounds(self) -> Dict[str, int]:
        """Lower bounds of the weight bytes (``params_dtype``) the most loaded rank of this layout holds, by the HF
        config key(s) that size them: the embedding (and an untied output layer on the same stage) of
        ``vocab_size x hidden_size`` over TP, the routed experts of the heaviest pipeline stage
        (``n_routed_experts x moe_intermediate_size``, three ``hidden_size``-wide matrices each) over EP x ETP,
        and the dense MLPs of that stage (``intermediate_size``) over TP. Computed in Python integers: no size
        overflows, nothing is allocated."""
        item = torch_dtype_bytes(self.params_dtype)
        h, tp, pp = int(self.hidden_size), int(self.tensor_model_parallel_size), int(self.pipeline_model_parallel_size)
        untied_here = 2 if (not self.tie_word_embeddings and pp == 1) else 1
        out = {"vocab_size": item * untied_here * int(self.vocab_size) * h // tp}
        n_moe = sum(t == SPARSE_MLP for t in self.mlp_layer_types)
        n_dense = len(self.mlp_layer_types) - n_moe
        if n_moe and self.num_moe_experts:
            ep = int(self.expert_model_parallel_size) * int(self.expert_tensor_parallel_size or tp)
            out["n_routed_experts x moe_intermediate_size"] = (item * math.ceil(n_moe / pp) * int(self.num_moe_experts)
                                                               * 3 * h * int(self.moe_ffn_hidden_size) // ep)
        if n_dense:
            out["intermediate_size"] = item * math.ceil(n_dense / pp) * 3 * h * int(self.ffn_hidden_size) // tp
        return out

    def check_fits_memory(self, device: str, available: Optional[int] = None) -> None:
        """Raise Glm5ConfigError naming the config key whose weights alone exceed the memory of ``device`` for one
        rank (``available`` bytes, else :func:`device_memory_bytes`), before anything is allocated."""
        what = f"the {available} bytes given"
        if available is None:
            available, what = device_memory_bytes(device)
        bounds = self.rank_weight_bytes_lower_bounds()
        total = sum(bounds.values())
        if total <= available:
            return
        key = max(bounds, key=bounds.get)
        gib = 1024 ** 3
        raise Glm5ConfigError(f"{key}: the model's weights need at least {total / gib:.4g} GiB on one rank of this "
                              f"layout ({bounds[key] / gib:.4g} GiB of them for {key}), more than the "
                              f"{available / gib:.4g} GiB of {what}")

    # ------------------------------------------------------------------ helpers
    @property
    def kda_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    def is_kda_layer(self, layer_idx: int) -> bool:
        """0-based global layer index -> whether it is a KDA layer."""
        return self.layer_types[layer_idx] == LINEAR_ATTENTION

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.mlp_layer_types[layer_idx] == SPARSE_MLP
