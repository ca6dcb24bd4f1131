"""GLM-5.3-Flash configuration on top of megatron-core's ``MLATransformerConfig``.

Every size of the model comes from here. ``Glm5Config.from_hf`` reads an HF ``config.json`` (the nested
``text_config`` / ``vision_config`` layout that ``Glm5NextConfig.save_pretrained`` writes, or a flat text-only
file) and maps each field that changes the math onto megatron-core's names; the GLM-only fields (KDA, KPool
indexer, mHC, vision tower) are fields of this dataclass with docstrings. ``validate`` raises
``Glm5ConfigError`` naming the first inconsistent field.

Presets: ``glm5_flash_config()`` (the released GLM-5.3-Flash sizes) and ``tiny_config()`` (a few layers
covering KDA, DSA, dense and MoE, for CPU tests and the quickstart).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch.nn.functional as F
from megatron.core.transformer.transformer_config import MLATransformerConfig

LINEAR_ATTENTION = "linear_attention"
INDEXED_ATTENTION = "indexed_attention"
DENSE_MLP = "dense"
SPARSE_MLP = "sparse"
KDA_BACKENDS = ("torch", "fla", "fla_fused")
KDA_CONV_KERNELS = ("triton", "fla")
DSA_BACKENDS = ("torch", "sparse", "fused")
MOE_EXPERTS_BACKENDS = ("sequential", "grouped")


class Glm5ConfigError(ValueError):
    """An HF config or a Glm5Config field that cannot describe a valid GLM-5.3 model."""


@dataclass
class Glm5VisionConfig:
    """The GLM-5.3 vision tower (HF ``vision_config``, model_type ``glm5_next_vision``)."""

    depth: int = 24
    """Number of ViT blocks."""
    hidden_size: int = 1024
    """ViT width."""
    num_heads: int = 16
    """ViT attention heads; head_dim = hidden_size / num_heads."""
    intermediate_size: int = 4096
    """Width of the ViT blocks' clamped-SwiGLU MLP."""
    out_hidden_size: int = 1536
    """Width after the spatial-merge downsample conv and of the patch merger (equals the LM hidden size)."""
    projection_intermediate_size: int = 10240
    """Width of the patch merger's clamped SwiGLU."""
    patch_size: int = 14
    """Spatial patch size of the Conv3d patch embedding."""
    temporal_patch_size: int = 2
    """Temporal patch size (frames per patch)."""
    spatial_merge_size: int = 2
    """Side of the square of patches merged into one LM token."""
    in_channels: int = 3
    """Image channels."""
    rms_norm_eps: float = 1e-5
    """Epsilon of the ViT RMSNorms (inside the sqrt)."""
    attention_bias: bool = True
    """Whether qkv / proj / MLP linears of the ViT blocks have a bias."""
    swiglu_limit: float = 10.0
    """Clamp of the SwiGLU gate (above) and up (both sides) in the ViT MLPs and the merger."""
    rope_theta: float = 10000.0
    """Base of the axial 2-D rotary embedding."""

    @classmethod
    def from_hf_dict(cls, d: dict) -> "Glm5VisionConfig":
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise Glm5ConfigError("vision_config.rope_parameters.rope_type: only 'axial' is supported, got "
                                  f"{rope.get('rope_type')!r}")
        if d.get("hidden_act", "silu") != "silu":
            raise Glm5ConfigError(f"vision_config.hidden_act: only 'silu' is supported, got {d.get('hidden_act')!r}")
        kw = {}
        for f in dataclasses.fields(cls):
            if f.name == "rope_theta":
                kw["rope_theta"] = float(rope.get("rope_theta", cls.rope_theta))
            elif f.name == "depth" and "num_hidden_layers" in d and "depth" not in d:
                kw["depth"] = d["num_hidden_layers"]
            elif f.name == "num_heads" and "num_attention_heads" in d and "num_heads" not in d:
                kw["num_heads"] = d["num_attention_heads"]
            elif f.name in d:
                v = d[f.name]
                if isinstance(v, (list, tuple)):
                    if len(set(v)) != 1:
                        raise Glm5ConfigError(f"vision_config.{f.name}: non-square values {v} are not supported")
                    v = v[0]
                kw[f.name] = v
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    def to_hf_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("rope_theta")
        d.update(model_type="glm5_next_vision", hidden_act="silu", attention_dropout=0.0,
                 rope_parameters={"rope_theta": self.rope_theta, "rope_type": "axial"})
        return d

    def validate(self):
        if self.hidden_size % self.num_heads:
            raise Glm5ConfigError(
                f"vision_config.num_heads: hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        head_dim = self.hidden_size // self.num_heads
        if head_dim % 4:
            raise Glm5ConfigError(f"vision_config.num_heads: head_dim {head_dim} must be a multiple of 4 (axial 2-D RoPE)")


@dataclass
class Glm5Config(MLATransformerConfig):
    """GLM-5.3-Flash text decoder (+ optional vision tower) as a megatron-core config.

    megatron-core fields carry the shared parts (num_layers, hidden_size, num_attention_heads = DSA heads,
    ffn_hidden_size = dense MLP width, MLA ranks, MoE router/expert settings, mtp_num_layers). The fields below
    carry what megatron-core has no name for.
    """

    # ---- vocabulary / embeddings ----
    vocab_size: int = 154880
    """Size of the token vocabulary (embedding rows and lm_head rows)."""
    pad_token_id: Optional[int] = None
    """Padding token id (informational; the embedding has no special padding row at training time)."""
    tie_word_embeddings: bool = False
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
    linear_num_heads: int = 64
    """KDA heads (q, k and v share the head count)."""
    linear_head_dim: int = 128
    """KDA head dimension (K = V)."""
    linear_conv_kernel_dim: int = 4
    """Width of the causal depthwise short convolution on q, k and v."""
    linear_lower_bound: Optional[float] = -5.0
    """Bounded ('safe') forget gate: g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)); None selects the softplus
    gate g = -exp(A_log) * softplus(f + dt_bias)."""
    kda_chunk_size: int = 64
    """Chunk length of the chunked delta rule (torch backend and FLA)."""
    kda_backend: str = "torch"
    """'torch' (chunked PyTorch delta rule, runs anywhere), 'fla' (flash-linear-attention chunk_kda, CUDA) or
    'fla_fused' (FLA conv, in-kernel gates and fused gated norm around chunk_kda: the GPU fast path, for bf16; in
    fp32 its TF32 inside FLA's gate and norm kernels puts it ~10x further from the fp32 reference than 'fla', so fp32
    checks on a GPU should pick 'fla')."""
    kda_conv_kernel: str = "triton"
    """'fla_fused': the short convolution with its SiLU, forward and backward: 'triton' (``kernels/short_conv.py``,
    one pass each way, the pre-activation recomputed inside the backward kernel; up to 4 taps, wider convolutions
    take FLA's) or 'fla' (FLA's ``causal_conv1d``, whose backward runs the forward again first)."""
    kda_save_intermediates: bool = False
    """'fla_fused': keep ``chunk_kda``'s forward intermediates (gate cumsum, w, u, gated q / k, v_new and the chunk
    states h) for its backward instead of recomputing them there (FLA's ``disable_recompute``). Same arithmetic; at
    the released widths it holds ~0.57 GiB more per KDA layer per 4K tokens until the backward. Off in the dataclass;
    ``models.builder.default_backends`` and the training arguments (``--no-kda-save-intermediates``) turn it on with
    'fla_fused': on an H200 (2026-12-04) the 8K-token proxy step went from 279.3 to 273.0 ms (4K: the same)."""

    # ---- KPool DSA ----
    index_n_heads: int = 32
    """Indexer heads."""
    index_head_dim: int = 128
    """Indexer head dimension (also the pooled-key width)."""
    index_topk: int = 2048
    """Token budget of the sparse attention; index_topk / index_kpool pools are selected per query."""
    index_kpool: int = 16
    """Tokens per pool. The released checkpoint uses 4 (the HF class default is 16): always read it from the file."""
    index_kpool_always_select_tail: bool = True
    """Whether the query's own incomplete pool (up to and including the query) is always attended."""
    dsa_indexer_warmup: bool = False
    """The indexer's dense warm-up stage (DeepSeek-V3.2): the DSA layers attend densely to every causal position of
    the query's document, every parameter but the indexers' is frozen, and only the indexer loss
    (``dsa_indexer_loss_coeff`` > 0, megatron-core's field, as is ``dsa_indexer_use_sparse_loss``) trains; the MoE
    expert-bias update is off (``moe_router_bias_update_rate = 0``). Off: the
    sparse stage (top-k attention; the indexer loss, when on, next to the LM loss)."""
    dsa_backend: str = "torch"
    """'torch' (masked dense reference, quadratic), 'sparse' (gathers only the selected positions) or 'fused' (the
    Triton sparse absorbed-MLA kernel, forward and backward: the GPU fast path)."""

    # ---- manifold-constrained hyper-connections ----
    hc_mult: int = 4
    """Number of residual streams."""
    hc_eps: float = 1e-6
    """Epsilon added to pre weights and inside each Sinkhorn normalisation."""
    hc_sinkhorn_iters: int = 20
    """Sinkhorn iterations for the comb (stream mixing) matrix."""
    mhc_stream_grad_fusion: bool = False
    """Fused mHC path (CUDA): the output side's gradient of the residual streams is added inside the input side's
    projection backward kernel instead of by autograd (one read of the streams gradient instead of a separate add
    of two; ~8 x 90 us at 4K tokens in the H200 proxy step). Off until measured on a GPU."""

    # ---- MoE extras ----
    swiglu_limit: float = 10.0
    """SwiGLU clamp (gate above, up on both sides) for dense MLP, experts and shared expert."""
    norm_topk_prob: bool = True
    """Normalise the selected sigmoid scores to sum to 1 (megatron-core's sigmoid router always does for topk>1)."""
    n_shared_experts: int = 1
    """Shared experts, fused into one MLP of moe_ffn_hidden_size * n_shared_experts."""
    moe_experts_backend: str = "sequential"
    """Routed experts: 'sequential' (megatron-core SequentialMLP, one GEMM pair per expert) or 'grouped' (the same
    parameters and checkpoint keys, run as torch._grouped_mm grouped GEMMs on CUDA: the GPU fast path)."""
    moe_cuda_graph: bool = False
    """Run each MoE layer's forward and backward as replayed CUDA graphs (``models/cuda_graphs.py``, one capture
    per input shape) instead of launching its ~100 kernels from Python every step: the GPU fast path for short
    steps, which wait for the host. Training on CUDA only, and only without collectives inside the layer (EP, TP,
    CP of 1), aux / z-loss, token dropping or activation recompute; otherwise, or in evaluation, the layer runs
    eagerly. The same operations as eager (cuBLAS may pick other GEMM algorithms under capture: bf16 rounding).
    Off in the dataclass (CPU tests); ``models.builder.default_backends`` and the training arguments turn it on for
    CUDA: on an H200 (2026-12-04) it cut the 4K-token proxy step from 178.7 to 159.8 ms."""

    # ---- vision / multimodal ----
    vision: Optional[Glm5VisionConfig] = None
    """Vision tower config; None builds a text-only model."""
    image_token_id: int = 154854
    """Placeholder token replaced by merged image features."""
    video_token_id: int = 154855
    """Video placeholder id (same as image id in some checkpoints; videos are told apart by start/end spans)."""
    image_start_token_id: int = 154830
    image_end_token_id: int = 154831
    video_start_token_id: int = 154832
    video_end_token_id: int = 154833

    # ---- pipeline ----
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Megatron-LM's --num-layers-per-virtual-pipeline-stage: decoder layers per model chunk; sets
    ``virtual_pipeline_model_parallel_size = num_layers / pipeline_model_parallel_size / this`` (even stages only;
    with uneven stages give a ``pipeline_model_parallel_layout`` instead)."""

    # ---- bookkeeping ----
    hf_text_config: dict = field(default_factory=dict)
    """The raw HF text config this was built from (written back on export)."""

    def __post_init__(self):
        self.validate_glm()
        if (self.dsa_indexer_loss_coeff or 0) > 0 and self.experimental_attention_variant_loss_scale_func is None:
            # the schedules hand the main loss's backward scale to the indexer loss (megatron-core's DSA hook)
            from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

            self.experimental_attention_variant_loss_scale_func = DSAIndexerLossAutoScaler.set_loss_scale
        if self.dsa_indexer_warmup:
            self.moe_router_bias_update_rate = 0.0   # the warm-up moves nothing but the indexers
        if self.activation_func_clamp_value is None:
            self.activation_func_clamp_value = self.swiglu_limit
        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            self.pipeline_dtype = self.params_dtype
        from megatron_glm5.models.parallel_layout import prepare_parallel_layout

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
        need(self.kda_backend in KDA_BACKENDS, "kda_backend", f"{self.kda_backend!r} not in {KDA_BACKENDS}")
        need(self.kda_conv_kernel in KDA_CONV_KERNELS, "kda_conv_kernel",
             f"{self.kda_conv_kernel!r} not in {KDA_CONV_KERNELS}")
        need(self.dsa_backend in DSA_BACKENDS, "dsa_backend", f"{self.dsa_backend!r} not in {DSA_BACKENDS}")
        need(self.moe_experts_backend in MOE_EXPERTS_BACKENDS, "moe_experts_backend",
             f"{self.moe_experts_backend!r} not in {MOE_EXPERTS_BACKENDS}")
        need(self.kda_chunk_size in (16, 32, 64), "kda_chunk_size", "must be 16, 32 or 64")
        need(self.index_kpool >= 1, "index_kpool", f"must be positive, got {self.index_kpool}")
        need(self.index_topk % self.index_kpool == 0, "index_topk",
             f"{self.index_topk} is not divisible by index_kpool {self.index_kpool}")
        need(self.index_topk >= self.index_kpool, "index_topk", "must be at least index_kpool")
        need(self.qk_pos_emb_head_dim == 0, "qk_rope_head_dim", "GLM-5.3 DSA is NoPE; must be 0")
        need(self.q_lora_rank is not None and self.q_lora_rank > 0, "q_lora_rank", "is required for DSA layers")
        need(self.hc_mult >= 1, "hc_mult", "must be >= 1")
        need(self.hc_sinkhorn_iters >= 1, "hc_sinkhorn_iters", "must be >= 1")
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

    # ------------------------------------------------------------------ helpers
    @property
    def kda_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    def is_kda_layer(self, layer_idx: int) -> bool:
        """0-based global layer index -> whether it is a KDA layer."""
        return self.layer_types[layer_idx] == LINEAR_ATTENTION

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.mlp_layer_types[layer_idx] == SPARSE_MLP

    # ------------------------------------------------------------------ HF I/O
    @classmethod
    def from_hf(cls, path_or_dict: Any, **overrides) -> "Glm5Config":
        """Build from an HF checkpoint dir, a config.json path or a dict. ``overrides`` set Glm5Config fields
        (e.g. parallel sizes, backends, params_dtype)."""
        if isinstance(path_or_dict, dict):
            full = path_or_dict
        else:
            p = str(path_or_dict)
            if os.path.isdir(p):
                p = os.path.join(p, "config.json")
            if not os.path.exists(p):
                raise Glm5ConfigError(f"config.json: not found at {p}")
            try:
                with open(p, encoding="utf-8") as fh:
                    full = json.load(fh)
            except (OSError, ValueError, RecursionError) as e:
                raise Glm5ConfigError(f"{p}: not readable JSON ({' '.join(str(e).split())[:200]})") from None
        check_hf_config_types(full)
        text = full.get("text_config")
        if text is None:
            text = {k: v for k, v in full.items() if k != "vision_config"}
        vision = full.get("vision_config")
        kw = {**_megatron_defaults(), **_text_fields_from_hf(text)}
        if vision is not None:
            kw["vision"] = Glm5VisionConfig.from_hf_dict(vision)
        for k in ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
                  "video_start_token_id", "video_end_token_id"):
            if k in full:
                kw[k] = full[k]
        if full.get("tie_word_embeddings", text.get("tie_word_embeddings", False)):
            kw["tie_word_embeddings"] = True
        kw.update(overrides)
        return cls(**kw)

    def to_hf_dict(self) -> dict:
        """The HF config.json dict (nested text_config / vision_config) for this model."""
        text = dict(self.hf_text_config)
        text.update(
            model_type="glm5_next_text", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.ffn_hidden_size,
            moe_intermediate_size=self.moe_ffn_hidden_size or text.get("moe_intermediate_size", 2048),
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_attention_heads, n_shared_experts=self.n_shared_experts,
            n_routed_experts=self.num_moe_experts or text.get("n_routed_experts", 288),
            routed_scaling_factor=self.moe_router_topk_scaling_factor,
            kv_lora_rank=self.kv_lora_rank, q_lora_rank=self.q_lora_rank, qk_rope_head_dim=0,
            v_head_dim=self.v_head_dim, qk_nope_head_dim=self.qk_head_dim,
            n_group=self.moe_router_num_groups or 1, topk_group=self.moe_router_group_topk or 1,
            num_experts_per_tok=self.moe_router_topk, norm_topk_prob=self.norm_topk_prob, rms_norm_eps=self.layernorm_epsilon,
            pad_token_id=self.pad_token_id, tie_word_embeddings=self.tie_word_embeddings,
            mlp_layer_types=list(self.mlp_layer_types), layer_types=list(self.layer_types),
            indexer_types=list(self.indexer_types), index_topk=self.index_topk, index_head_dim=self.index_head_dim,
            index_n_heads=self.index_n_heads, swiglu_limit=self.swiglu_limit, linear_head_dim=self.linear_head_dim,
            linear_num_heads=self.linear_num_heads, linear_conv_kernel_dim=self.linear_conv_kernel_dim,
            linear_lower_bound=self.linear_lower_bound, hc_mult=self.hc_mult, hc_eps=self.hc_eps,
            hc_sinkhorn_iters=self.hc_sinkhorn_iters, index_kpool=self.index_kpool,
            index_kpool_always_select_tail=self.index_kpool_always_select_tail,
            initializer_range=self.init_method_std,
        )
        if self.mtp_num_layers:
            text["num_nextn_predict_layers"] = self.mtp_num_layers
        else:  # e.g. built without MTP from a checkpoint that holds no MTP weights
            text.pop("num_nextn_predict_layers", None)
        text.pop("linear_attn_config", None)
        out = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
               "text_config": text, "tie_word_embeddings": self.tie_word_embeddings,
               "image_token_id": self.image_token_id, "video_token_id": self.video_token_id,
               "image_start_token_id": self.image_start_token_id, "image_end_token_id": self.image_end_token_id,
               "video_start_token_id": self.video_start_token_id, "video_end_token_id": self.video_end_token_id}
        if self.vision is not None:
            out["vision_config"] = self.vision.to_hf_dict()
        return out


# HF config.json value types and ranges checked before anything reads them (a "false" string is not a bool, an
# rms_norm_eps of 0 is not an epsilon). kind: "int+" positive int, "int0" non-negative int, "float+" positive
# number, "float" any number, "bool", "strs" list of strings; None is accepted where HF accepts null.
_POS_INT = ("num_hidden_layers", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
            "n_routed_experts", "num_experts_per_tok", "index_n_heads", "index_head_dim", "index_topk", "index_kpool",
            "hc_mult", "hc_sinkhorn_iters", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim")
_TEXT_SCHEMA = {
    **{k: ("int+", False) for k in _POS_INT},
    **{k: ("int+", True) for k in ("q_lora_rank", "n_group", "topk_group")},
    **{k: ("int0", True) for k in ("n_shared_experts", "num_nextn_predict_layers", "pad_token_id",
                                   "index_topk_freq", "index_skip_topk_offset")},
    "qk_rope_head_dim": ("int0", False),
    **{k: ("float+", False) for k in ("rms_norm_eps", "hc_eps", "routed_scaling_factor", "swiglu_limit",
                                      "initializer_range")},
    "linear_lower_bound": ("float", True),
    **{k: ("bool", False) for k in ("tie_word_embeddings", "norm_topk_prob", "attention_bias",
                                    "index_kpool_always_select_tail")},
    **{k: ("strs", True) for k in ("layer_types", "mlp_layer_types", "indexer_types")},
}
_VISION_SCHEMA = {
    **{k: ("int+", False) for k in ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size",
                                    "projection_intermediate_size", "patch_size", "temporal_patch_size",
                                    "spatial_merge_size", "in_channels", "num_hidden_layers",
                                    "num_attention_heads")},
    **{k: ("float+", False) for k in ("rms_norm_eps", "swiglu_limit")},
    "attention_bias": ("bool", False),
}
_TOP_SCHEMA = {
    **{k: ("int0", True) for k in ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
                                   "video_start_token_id", "video_end_token_id")},
    "tie_word_embeddings": ("bool", False),
}


def _check_value(where: str, v, kind: str, nullable: bool) -> None:
    if v is None:
        if not nullable:
            raise Glm5ConfigError(f"{where}: null is not allowed")
        return
    is_int = isinstance(v, int) and not isinstance(v, bool)
    ok = {"int+": is_int and v > 0, "int0": is_int and v >= 0, "bool": isinstance(v, bool),
          "float+": (is_int or isinstance(v, float)) and v > 0 and v != float("inf"),
          "float": (is_int or isinstance(v, float)) and v == v and abs(v) != float("inf"),
          "strs": isinstance(v, list) and all(isinstance(x, str) for x in v)}[kind]
    if not ok:
        want = {"int+": "a positive integer", "int0": "a non-negative integer", "bool": "true or false",
                "float+": "a positive finite number", "float": "a finite number", "strs": "a list of strings"}[kind]
        raise Glm5ConfigError(f"{where}: must be {want}, got {json.dumps(v)[:80]}")


def check_hf_config_types(full) -> None:
    """Raise Glm5ConfigError naming the first HF config value of the wrong JSON type or out of range."""
    if not isinstance(full, dict):
        raise Glm5ConfigError(f"config.json: must be a JSON object, got {type(full).__name__}")
    for sub in ("text_config", "vision_config"):
        if full.get(sub) is not None and not isinstance(full[sub], dict):
            raise Glm5ConfigError(f"{sub}: must be a JSON object, got {type(full[sub]).__name__}")
    text = full.get("text_config")
    if text is None:
        text = full
    tprefix = ""  # text fields are named bare, as in every other config error
    checks = [(tprefix, text, _TEXT_SCHEMA), ("vision_config.", full.get("vision_config") or {}, _VISION_SCHEMA)]
    if text is not full:
        checks.append(("", full, _TOP_SCHEMA))
    for prefix, d, schema in checks:
        for k, (kind, nullable) in schema.items():
            if k in d:
                _check_value(prefix + k, d[k], kind, nullable)
    lac = text.get("linear_attn_config")
    if lac is not None and not isinstance(lac, dict):
        raise Glm5ConfigError(f"{tprefix}linear_attn_config: must be a JSON object")
    q = full.get("quantization_config")
    if q is not None and not isinstance(q, dict):
        raise Glm5ConfigError("quantization_config: must be a JSON object")


def _text_fields_from_hf(t: dict) -> dict:
    """Map an HF text config dict onto Glm5Config keyword arguments (mirrors Glm5NextTextConfig.__post_init__)."""
    t = dict(t)
    if "num_hidden_layers" not in t:
        raise Glm5ConfigError("num_hidden_layers: missing from the text config")
    n = int(t["num_hidden_layers"])
    if t.get("model_type") not in (None, "glm5_next_text", "glm5_next"):
        raise Glm5ConfigError(f"model_type: expected 'glm5_next_text', got {t.get('model_type')!r}")
    if t.get("hidden_act", "silu") != "silu":
        raise Glm5ConfigError(f"hidden_act: only 'silu' is supported, got {t.get('hidden_act')!r}")
    if t.get("attention_bias", False):
        raise Glm5ConfigError("attention_bias: True is not supported (the released model has no attention bias)")
    heads = int(t.get("num_attention_heads", 64))
    kv_heads = t.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise Glm5ConfigError(f"num_key_value_heads: {kv_heads} must equal num_attention_heads {heads}")
    if int(t.get("qk_rope_head_dim", 0)) != 0:
        raise Glm5ConfigError(f"qk_rope_head_dim: GLM-5.3 DSA is NoPE; must be 0, got {t['qk_rope_head_dim']}")

    mlp_types = t.get("mlp_layer_types") or (["dense"] * min(3, n) + ["sparse"] * (n - 3))
    layer_types = t.get("layer_types") or [LINEAR_ATTENTION if i % 4 != 3 else INDEXED_ATTENTION for i in range(n)]
    layer_types = [INDEXED_ATTENTION if x == "full_attention" else x for x in layer_types]
    indexer_types = t.get("indexer_types")
    if indexer_types is None:
        pattern = t.get("index_topk_pattern")
        if pattern is not None:
            if isinstance(pattern, str):
                bad = set(pattern) - {"F", "S"}
                if bad:
                    raise Glm5ConfigError(f"index_topk_pattern: unknown letters {sorted(bad)} (use F and S)")
                indexer_types = [{"F": "full", "S": "shared"}[c] for c in pattern]
            else:
                indexer_types = list(pattern)
        else:
            freq = max(int(t.get("index_topk_freq", 1)), 1)
            offset = int(t.get("index_skip_topk_offset", 2))
            indexer_types = ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n)]

    linear_head_dim = t.get("linear_head_dim", 128)
    linear_num_heads = t.get("linear_num_heads", 64)
    conv = t.get("linear_conv_kernel_dim", 4)
    lower = t.get("linear_lower_bound", -5.0)
    lac = t.get("linear_attn_config")
    if lac is not None:
        linear_head_dim = lac.get("head_dim", linear_head_dim)
        linear_num_heads = lac.get("num_heads", linear_num_heads)
        conv = lac.get("short_conv_kernel_size", conv)
        lower = lac.get("gate_lower_bound", lower)
        if lac.get("safe_gate", True) and lower is None:
            lower = -5.0

    n_group = int(t.get("n_group") or 1)
    topk_group = int(t.get("topk_group") or 1)
    num_experts = int(t.get("n_routed_experts", 288))
    moe_ffn = int(t.get("moe_intermediate_size", 2048))
    n_shared = int(t.get("n_shared_experts") or 0)
    mtp = int(t.get("num_nextn_predict_layers") or 0)
    has_moe = SPARSE_MLP in mlp_types
    kw = dict(
        num_layers=n,
        hidden_size=int(t.get("hidden_size", 4096)),
        num_attention_heads=heads,
        num_query_groups=heads,
        ffn_hidden_size=int(t.get("intermediate_size", 12288)),
        vocab_size=int(t.get("vocab_size", 154880)),
        pad_token_id=t.get("pad_token_id"),
        tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
        layernorm_epsilon=float(t.get("rms_norm_eps", 1e-5)),
        init_method_std=float(t.get("initializer_range", 0.02)),
        # MLA (NoPE)
        q_lora_rank=t.get("q_lora_rank", 1536),
        kv_lora_rank=int(t.get("kv_lora_rank", 512)),
        qk_head_dim=int(t.get("qk_nope_head_dim", 256)),
        qk_pos_emb_head_dim=0,
        v_head_dim=int(t.get("v_head_dim", 256)),
        # MoE
        num_moe_experts=num_experts if has_moe else None,
        moe_ffn_hidden_size=moe_ffn if has_moe else None,
        moe_router_topk=int(t.get("num_experts_per_tok", 8)),
        moe_shared_expert_intermediate_size=(moe_ffn * n_shared) if (n_shared and has_moe) else None,
        n_shared_experts=n_shared,
        moe_layer_freq=[1 if x == SPARSE_MLP else 0 for x in mlp_types],
        moe_router_topk_scaling_factor=float(t.get("routed_scaling_factor", 2.5)),
        moe_router_num_groups=n_group if n_group > 1 else None,
        moe_router_group_topk=topk_group if n_group > 1 else None,
        norm_topk_prob=bool(t.get("norm_topk_prob", True)),
        swiglu_limit=float(t.get("swiglu_limit", 10.0)),
        mtp_num_layers=mtp or None,
        # GLM schedules
        layer_types=list(layer_types),
        mlp_layer_types=list(mlp_types),
        indexer_types=list(indexer_types),
        linear_num_heads=int(linear_num_heads),
        linear_head_dim=int(linear_head_dim),
        linear_conv_kernel_dim=int(conv),
        linear_lower_bound=None if lower is None else float(lower),
        index_n_heads=int(t.get("index_n_heads", 32)),
        index_head_dim=int(t.get("index_head_dim", 128)),
        index_topk=int(t.get("index_topk", 2048)),
        index_kpool=int(t.get("index_kpool", 16)),
        index_kpool_always_select_tail=bool(t.get("index_kpool_always_select_tail", True)),
        hc_mult=int(t.get("hc_mult", 4)),
        hc_eps=float(t.get("hc_eps", 1e-6)),
        hc_sinkhorn_iters=int(t.get("hc_sinkhorn_iters", 20)),
        hf_text_config=t,
    )
    return kw


def _megatron_defaults() -> dict:
    """Fixed megatron-core settings that GLM-5.3 needs (no biases, RMSNorm, clamped SwiGLU, sigmoid router...)."""
    return dict(
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        rope_type="rope",
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        transformer_impl="local",
    )


# ---------------------------------------------------------------------------- presets
def glm5_flash_hf_text_config() -> dict:
    """The released GLM-5.3-Flash text config (the values that change the math)."""
    n = 45
    return dict(
        model_type="glm5_next_text", vocab_size=154880, hidden_size=4096, intermediate_size=12288,
        moe_intermediate_size=2048, num_hidden_layers=n, num_attention_heads=64, num_key_value_heads=64,
        n_shared_experts=1, n_routed_experts=288, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=0, v_head_dim=256, qk_nope_head_dim=256, n_group=1, topk_group=1, num_experts_per_tok=8,
        norm_topk_prob=True, rms_norm_eps=1e-5, pad_token_id=154820, index_topk=2048, index_head_dim=128,
        index_n_heads=32, swiglu_limit=10.0, linear_head_dim=128, linear_num_heads=64, linear_conv_kernel_dim=4,
        linear_lower_bound=-5.0, hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20, index_kpool=4,
        index_kpool_always_select_tail=True, num_nextn_predict_layers=1,
        mlp_layer_types=["dense"] * 3 + ["sparse"] * (n - 3),
        layer_types=[LINEAR_ATTENTION if i % 4 != 3 else INDEXED_ATTENTION for i in range(n)],
    )


def glm5_flash_hf_config() -> dict:
    return {
        "architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
        "text_config": glm5_flash_hf_text_config(),
        "vision_config": dict(depth=24, hidden_size=1024, num_heads=16, intermediate_size=4096, out_hidden_size=4096,
                              projection_intermediate_size=10240, patch_size=14, temporal_patch_size=2,
                              spatial_merge_size=2, in_channels=3, rms_norm_eps=1e-5, attention_bias=True,
                              swiglu_limit=10.0, rope_parameters={"rope_theta": 10000.0, "rope_type": "axial"}),
        "image_token_id": 154854, "video_token_id": 154855, "image_start_token_id": 154830,
        "image_end_token_id": 154831, "video_start_token_id": 154832, "video_end_token_id": 154833,
        "tie_word_embeddings": False,
    }


def tiny_hf_config(num_layers: int = 4, hc_mult: int = 3, with_vision: bool = True, mtp: bool = False) -> dict:
    """A tiny GLM-5.3 config that covers KDA, DSA (with a sparse top-k), dense and MoE layers."""
    layer_types = [LINEAR_ATTENTION if i % 2 == 0 else INDEXED_ATTENTION for i in range(num_layers)]
    mlp_types = ["dense"] + ["sparse"] * (num_layers - 1)
    text = dict(
        model_type="glm5_next_text", vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1, norm_topk_prob=True,
        rms_norm_eps=1e-5, pad_token_id=0, index_topk=8, index_head_dim=16, index_n_heads=8, swiglu_limit=10.0,
        linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
        hc_mult=hc_mult, hc_eps=1e-6, hc_sinkhorn_iters=5, index_kpool=4, index_kpool_always_select_tail=True,
        mlp_layer_types=mlp_types, layer_types=layer_types, initializer_range=0.02,
    )
    if mtp:
        text["num_nextn_predict_layers"] = 1
    cfg = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "text_config": text,
           "image_token_id": 250, "video_token_id": 251, "image_start_token_id": 252, "image_end_token_id": 253,
           "video_start_token_id": 254, "video_end_token_id": 255, "tie_word_embeddings": False}
    if with_vision:
        cfg["vision_config"] = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                                    projection_intermediate_size=80, patch_size=14, temporal_patch_size=2,
                                    spatial_merge_size=2, in_channels=3, rms_norm_eps=1e-5, attention_bias=True,
                                    swiglu_limit=10.0, rope_parameters={"rope_theta": 10000.0, "rope_type": "axial"})
    return cfg


def glm5_flash_config(**overrides) -> Glm5Config:
    """The released GLM-5.3-Flash model (320B total / 18B active)."""
    return Glm5Config.from_hf(glm5_flash_hf_config(), **overrides)


def tiny_config(**overrides) -> Glm5Config:
    """A tiny model for CPU tests and the quickstart."""
    return Glm5Config.from_hf(tiny_hf_config(), **overrides)


PRESETS = {"glm5-flash": glm5_flash_config, "tiny": tiny_config}
