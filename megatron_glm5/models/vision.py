"""GLM-5.3 vision tower (ViT + 2x2 downsample + patch merger) and the image / video feature splice into the LM
embeddings.

Parameter names equal HF's ``model.visual.*`` keys without that prefix, so an HF state dict loads as is::

    patch_embed.proj.{weight,bias}                     Conv3d [hidden, C, T, P, P]
    blocks.{i}.norm1.weight, blocks.{i}.norm2.weight    RMSNorm
    blocks.{i}.attn.qkv.{weight,bias}, blocks.{i}.attn.proj.{weight,bias}
    blocks.{i}.attn.q_norm.weight, blocks.{i}.attn.k_norm.weight   per-head RMSNorm [head_dim]
    blocks.{i}.mlp.{gate_proj,up_proj,down_proj}.{weight,bias}
    post_layernorm.weight                              RMSNorm
    downsample.{weight,bias}                           Conv2d [out_hidden, hidden, m, m]
    merger.proj.weight, merger.post_projection_norm.{weight,bias}, merger.{gate_proj,up_proj,down_proj}.weight

The tower is replicated over tensor parallelism (plain torch modules; it is small and usually frozen). The math is
HF's ``Glm5NextVisionModel``: patches are ordered block-major over ``m x m`` merge blocks (the processor's order),
2-D axial RoPE from (row, col) grid positions, non-causal attention inside each frame of each image, q/k RMSNorm
per head, clamped-SwiGLU MLPs, post RMSNorm, the ``m x m`` downsample and the merger (GELU(LayerNorm(proj)) then a
clamped SwiGLU). The Conv3d patch embedding and the Conv2d downsample have kernel == stride == their input, so on
CUDA they are computed as the equivalent matmuls (same parameters, same math, much faster than cuDNN's 3-D conv); on
the CPU the patch embedding is transformers' Conv3d itself, whose rounding the fp32 parity with transformers needs
(this small model amplifies a 1e-6 relative change of the vision features into ~7e-6 of the logits).

The rotary inverse frequencies are recomputed in fp32 on each call (no buffer that a bf16 cast could round).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from megatron.core.transformer.module import MegatronModule

from megatron_glm5.config import Glm5VisionConfig
from megatron_glm5.models.norms import RMSNorm
from megatron_glm5.models.sharding import replicated_sharded_state_dict

__all__ = [
    "Glm5VisionModel",
    "vision_position_ids",
    "vision_cu_seqlens",
    "video_span_mask",
    "image_token_mask",
    "video_token_mask",
    "splice_image_features",
    "splice_video_features",
]


# ----------------------------------------------------------------------------------------------- grid helpers
def vision_position_ids(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """``[num_patches, 2]`` long (row, col) of every patch, laid out block-major over ``merge x merge`` blocks and
    repeated for each of the ``t`` frames (HF ``get_vision_position_ids``)."""
    out = []
    for t, h, w in grid_thw.tolist():
        if h % merge or w % merge:
            raise ValueError(f"image grid {h}x{w} is not divisible by spatial_merge_size {merge}")
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
        rows = rows.transpose(1, 2).flatten()
        cols = cols.transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out, dim=0).to(grid_thw.device)


def vision_cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """int32 ``[num_frames + 1]`` boundaries: every frame of every image is its own attention segment."""
    lens = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))


# ----------------------------------------------------------------------------------------------- blocks
def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class _VisionMLP(nn.Module):
    def __init__(self, dim: int, inner: int, bias: bool, limit: float):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inner, bias=bias)
        self.up_proj = nn.Linear(dim, inner, bias=bias)
        self.down_proj = nn.Linear(inner, dim, bias=bias)
        self.limit = limit

    def forward(self, x):
        return self.down_proj(_clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _VisionAttention(nn.Module):
    def __init__(self, vc: Glm5VisionConfig):
        super().__init__()
        self.num_heads = vc.num_heads
        self.head_dim = vc.hidden_size // vc.num_heads
        self.qkv = nn.Linear(vc.hidden_size, 3 * vc.hidden_size, bias=vc.attention_bias)
        self.proj = nn.Linear(vc.hidden_size, vc.hidden_size, bias=vc.attention_bias)
        self.q_norm = RMSNorm(hidden_size=self.head_dim, eps=vc.rms_norm_eps)
        self.k_norm = RMSNorm(hidden_size=self.head_dim, eps=vc.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # [n, heads, d] each
        q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [n, 1, d] fp32
        qf, kf = q.float(), k.float()
        q = (qf * cos + _rotate_half(qf) * sin).to(q.dtype)
        k = (kf * cos + _rotate_half(kf) * sin).to(k.dtype)
        out = _segment_attention(q, k, v, segments, self.head_dim ** -0.5)
        return self.proj(out.reshape(n, -1))


def _segments_by_length(cu_seqlens: torch.Tensor):
    """Group the attention segments by length: list of (length, LongTensor of start offsets)."""
    cu = cu_seqlens.tolist()
    groups = {}
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            groups.setdefault(b - a, []).append(a)
    return [(L, torch.tensor(starts, dtype=torch.long)) for L, starts in groups.items()]


def _segment_attention(q, k, v, segments, scale):
    """Non-causal attention inside each segment. q/k/v ``[n, heads, d]``. Segments of equal length run as one
    batched SDPA call (a video's frames, same-size images), so a long list of frames costs few kernel launches."""
    n, heads, d = q.shape
    if len(segments) == 1 and segments[0][1].numel() == 1 and segments[0][0] == n:
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=scale)
        return o.transpose(0, 1)
    out = q.new_empty(n, heads, d)
    for L, starts in segments:
        idx = (starts.to(q.device)[:, None] + torch.arange(L, device=q.device)[None, :]).reshape(-1)
        qs, ks, vs = (t.index_select(0, idx).view(-1, L, heads, d).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)  # [g, heads, L, d]
        out = out.index_copy(0, idx, o.transpose(1, 2).reshape(-1, heads, d))
    return out


class _VisionBlock(nn.Module):
    def __init__(self, vc: Glm5VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(hidden_size=vc.hidden_size, eps=vc.rms_norm_eps)
        self.norm2 = RMSNorm(hidden_size=vc.hidden_size, eps=vc.rms_norm_eps)
        self.attn = _VisionAttention(vc)
        self.mlp = _VisionMLP(vc.hidden_size, vc.intermediate_size, vc.attention_bias, vc.swiglu_limit)

    def forward(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class _PatchEmbed(nn.Module):
    def __init__(self, vc: Glm5VisionConfig):
        super().__init__()
        kernel = (vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        self.proj = nn.Conv3d(vc.in_channels, vc.hidden_size, kernel_size=kernel, stride=kernel)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        if pixels.shape[-1] != w[0].numel():
            raise ValueError(f"pixel_values last dim {pixels.shape[-1]} != C*T*P*P = {w[0].numel()}")
        if not pixels.is_cuda:
            return self.proj(pixels.to(w.dtype).view(-1, *w.shape[1:])).view(-1, w.shape[0])
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class _PatchMerger(nn.Module):
    def __init__(self, dim: int, inner: int, limit: float):
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.post_projection_norm = nn.LayerNorm(dim)
        self.gate_proj = nn.Linear(dim, inner, bias=False)
        self.up_proj = nn.Linear(dim, inner, bias=False)
        self.down_proj = nn.Linear(inner, dim, bias=False)
        self.limit = limit

    def forward(self, x):
        x = F.gelu(self.post_projection_norm(self.proj(x)))
        return self.down_proj(_clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


# ----------------------------------------------------------------------------------------------- model
class Glm5VisionModel(MegatronModule):
    """``forward(pixel_values [num_patches, C*T*P*P], image_grid_thw [num_images, 3]) ->
    [num_patches / merge**2, out_hidden_size]`` (HF's ``pooler_output``, all images concatenated in order).

    Videos take the same call (``pixel_values_videos``, ``video_grid_thw``): a ``[t, h, w]`` row is ``t`` frames
    (temporal patches) of ``h x w`` patches, each frame its own attention segment with the same (row, col)
    positions, which is what HF's ``get_video_features`` computes by flattening the grid to ``t`` rows ``[1, h, w]``;
    images and videos may be given in one call (the frames do not interact).

    ``config`` is the ``Glm5Config``; the tower is built from ``config.vision`` (or ``vision_config`` if given).
    Set ``self.recompute_blocks = True`` to checkpoint each ViT block (activation recompute).
    """

    def __init__(self, config, vision_config: Optional[Glm5VisionConfig] = None):
        super().__init__(config=config)
        vc = vision_config if vision_config is not None else config.vision
        if vc is None:
            raise ValueError("Glm5VisionModel: config.vision is None (text-only config)")
        vc.validate()
        self.vision_config = vc
        self.spatial_merge_size = vc.spatial_merge_size
        self.head_dim = vc.hidden_size // vc.num_heads
        self.recompute_blocks = False

        self.patch_embed = _PatchEmbed(vc)
        self.blocks = nn.ModuleList([_VisionBlock(vc) for _ in range(vc.depth)])
        self.post_layernorm = RMSNorm(hidden_size=vc.hidden_size, eps=vc.rms_norm_eps)
        m = vc.spatial_merge_size
        self.downsample = nn.Conv2d(vc.hidden_size, vc.out_hidden_size, kernel_size=m, stride=m)
        self.merger = _PatchMerger(vc.out_hidden_size, vc.projection_intermediate_size, vc.swiglu_limit)

    def rotary_cos_sin(self, position_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(cos, sin)`` ``[num_patches, head_dim]`` of the axial 2-D RoPE: ``[h, w, h, w]`` quarters."""
        d = self.head_dim
        half = d // 2
        inv_freq = 1.0 / (self.vision_config.rope_theta ** (
            torch.arange(0, half, 2, dtype=torch.float, device=position_ids.device) / half))
        freqs = position_ids[..., None].float() * inv_freq  # [n, 2, d/4]
        hw = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)  # [n, d/2]
        ang = torch.cat([hw, hw], dim=-1)
        return ang.cos(), ang.sin()

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        grid = image_grid_thw.to(torch.long)
        n = int(grid.prod(-1).sum())
        if pixel_values.shape[0] != n:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches but image_grid_thw sums to {n}")
        m = self.spatial_merge_size
        pos = vision_position_ids(grid.cpu(), m).to(pixel_values.device)
        cos, sin = self.rotary_cos_sin(pos)
        segments = _segments_by_length(vision_cu_seqlens(grid.cpu()))

        x = self.patch_embed(pixel_values)
        for blk in self.blocks:
            if self.recompute_blocks and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(blk, x, cos, sin, segments, use_reentrant=False)
            else:
                x = blk(x, cos, sin, segments)
        x = self.post_layernorm(x)

        # m x m downsample: each group of m*m consecutive patches is one merge block in (row, col) order.
        w = self.downsample.weight  # [out, hidden, m, m]
        blocks = x.reshape(-1, m * m * x.shape[-1])  # [(i, j, c)]
        x = F.linear(blocks, w.permute(0, 2, 3, 1).reshape(w.shape[0], -1), self.downsample.bias)
        return self.merger(x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Every tensor of the tower is replicated over TP (and DP)."""
        return replicated_sharded_state_dict(self, prefix, sharded_offsets, metadata)


# ----------------------------------------------------------------------------------------------- splice
def video_span_mask(input_ids: torch.Tensor, config, video_span_depth: int = 0) -> torch.Tensor:
    """Bool ``[b, s]``: positions inside a ``video_start .. video_end`` span (HF's rule: more video starts than ends
    up to and including the position). ``video_span_depth``: starts minus ends before ``input_ids[:, 0]`` (non-zero
    for a context-parallel chunk that begins inside a video)."""
    starts = (input_ids == config.video_start_token_id).cumsum(-1)
    ends = (input_ids == config.video_end_token_id).cumsum(-1)
    return starts + video_span_depth > ends


def image_token_mask(input_ids: torch.Tensor, config, video_span_depth: int = 0) -> torch.Tensor:
    """Bool ``[b, s]``: ``image_token_id`` positions outside every ``video_start .. video_end`` span (the image
    features' places; see :func:`video_span_mask` for ``video_span_depth``)."""
    return (input_ids == config.image_token_id) & ~video_span_mask(input_ids, config, video_span_depth)


def video_token_mask(input_ids: torch.Tensor, config, video_span_depth: int = 0) -> torch.Tensor:
    """Bool ``[b, s]``: ``image_token_id`` positions inside a video span (the video features' places: GLM's
    processor writes every frame of a video as ``<begin_image> <image> * k <end_image> "t seconds"`` between
    ``<begin_video>`` and ``<end_video>``)."""
    return (input_ids == config.image_token_id) & video_span_mask(input_ids, config, video_span_depth)


def _splice(mask: torch.Tensor, inputs_embeds: torch.Tensor, features: torch.Tensor, what: str,
            sequence_first: bool) -> torch.Tensor:
    n_tok = int(mask.sum())
    h = inputs_embeds.shape[-1]
    if features.dim() != 2 or features.shape[0] != n_tok or features.shape[-1] != h:
        raise ValueError(f"splice_{what}_features: {n_tok} {what} tokens in input_ids but {what} features of shape "
                         f"{tuple(features.shape)} (expected [{n_tok}, {h}])")
    feats = features.to(device=inputs_embeds.device, dtype=inputs_embeds.dtype)
    mask = mask.unsqueeze(-1).to(inputs_embeds.device)
    if sequence_first:
        return inputs_embeds.transpose(0, 1).masked_scatter(mask, feats).transpose(0, 1).contiguous()
    return inputs_embeds.masked_scatter(mask, feats)


def splice_image_features(input_ids: torch.Tensor, inputs_embeds: torch.Tensor, image_features: torch.Tensor,
                          config, sequence_first: bool = False, video_span_depth: int = 0) -> torch.Tensor:
    """Replace the embeddings at image-token positions (row-major order over ``[b, s]``) with ``image_features``.

    ``input_ids`` ``[b, s]``; ``inputs_embeds`` ``[b, s, h]`` (or ``[s, b, h]`` with ``sequence_first=True``);
    ``image_features`` ``[n_img_tokens, h]``. Image-token ids inside video spans are left alone (HF's placeholder
    rule, :func:`image_token_mask`). Raises ``ValueError`` if the number of image tokens and features differ.
    Differentiable in both ``inputs_embeds`` and ``image_features``.
    """
    return _splice(image_token_mask(input_ids, config, video_span_depth), inputs_embeds, image_features, "image",
                   sequence_first)


def splice_video_features(input_ids: torch.Tensor, inputs_embeds: torch.Tensor, video_features: torch.Tensor,
                          config, sequence_first: bool = False, video_span_depth: int = 0) -> torch.Tensor:
    """:func:`splice_image_features` for videos: ``video_features`` ``[n_video_tokens, h]`` (all frames of all
    videos in order) replace the embeddings at the image-token positions inside video spans
    (:func:`video_token_mask`)."""
    return _splice(video_token_mask(input_ids, config, video_span_depth), inputs_embeds, video_features, "video",
                   sequence_first)
