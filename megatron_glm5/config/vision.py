"""The GLM-5.3 vision tower's config (HF ``vision_config``) and its HF dict form."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_glm5.errors import Glm5ConfigError


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
