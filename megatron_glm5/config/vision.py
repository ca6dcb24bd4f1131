"""The GLM-5.3 vision tower's config (HF ``vision_config``) and its HF dict form."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_glm5.config.hf_defaults import HF_VISION_DEFAULTS as _HF
from megatron_glm5.errors import Glm5ConfigError


@dataclass
class Glm5VisionConfig:
    """The GLM-5.3 vision tower (HF ``vision_config``, model_type ``glm5_next_vision``). Each field's default is
    transformers' ``Glm5NextVisionConfig`` default (:mod:`~megatron_glm5.config.hf_defaults`)."""

    depth: int = _HF["depth"]
    """Number of ViT blocks."""
    hidden_size: int = _HF["hidden_size"]
    """ViT width."""
    num_heads: int = _HF["num_heads"]
    """ViT attention heads; head_dim = hidden_size / num_heads."""
    intermediate_size: int = _HF["intermediate_size"]
    """Width of the ViT blocks' clamped-SwiGLU MLP."""
    out_hidden_size: int = _HF["out_hidden_size"]
    """Width after the spatial-merge downsample conv and of the patch merger (equals the LM hidden size)."""
    projection_intermediate_size: int = _HF["projection_intermediate_size"]
    """Width of the patch merger's clamped SwiGLU."""
    patch_size: int = _HF["patch_size"]
    """Spatial patch size of the Conv3d patch embedding."""
    temporal_patch_size: int = _HF["temporal_patch_size"]
    """Temporal patch size (frames per patch)."""
    spatial_merge_size: int = _HF["spatial_merge_size"]
    """Side of the square of patches merged into one LM token."""
    in_channels: int = _HF["in_channels"]
    """Image channels."""
    rms_norm_eps: float = _HF["rms_norm_eps"]
    """Epsilon of the ViT RMSNorms (inside the sqrt)."""
    attention_bias: bool = _HF["attention_bias"]
    """Whether qkv / proj / MLP linears of the ViT blocks have a bias."""
    swiglu_limit: float = _HF["swiglu_limit"]
    """Clamp of the SwiGLU gate (above) and up (both sides) in the ViT MLPs and the merger."""
    rope_theta: float = _HF["rope_theta"]
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
