"""Vision tower and image-feature splice against HF's Glm5NextVisionModel / Glm5NextModel (fp32, CPU)."""

import types

import pytest
import torch
import transformers
from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids

from megatron_glm5.config import Glm5VisionConfig, tiny_config, tiny_hf_config
from megatron_glm5.models.vision import (
    Glm5VisionModel,
    image_token_mask,
    splice_image_features,
    vision_cu_seqlens,
    vision_position_ids,
)
from tests.helpers import rel


def _build(vision_cfg: Glm5VisionConfig = None, seed=0):
    if vision_cfg is None:
        cfg = tiny_config()
        hf_vc = transformers.Glm5NextVisionConfig(**tiny_hf_config()["vision_config"])
    else:
        cfg = tiny_config(vision=vision_cfg)
        hf_vc = transformers.Glm5NextVisionConfig(**vision_cfg.to_hf_dict())
    torch.manual_seed(seed)
    hf = transformers.Glm5NextVisionModel(hf_vc).eval()
    with torch.no_grad():  # non-trivial weights everywhere (norm weights != 1, biases != 0)
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or "norm1" in name or "norm2" in name or "q_norm" in name \
                    or "k_norm" in name or "post_layernorm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.1))
        hf.patch_embed.proj.weight.mul_(4.0)
    ours = Glm5VisionModel(cfg).eval()
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=True)
    assert not missing and not unexpected
    return ours, hf, cfg.vision


def _compare(ours, hf, vc, grid, seed=0, label=""):
    grid = torch.tensor(grid, dtype=torch.long)
    n = int(grid.prod(-1).sum())
    torch.manual_seed(seed)
    pix = torch.randn(n, vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2)
    ref = hf(pix, grid_thw=grid).pooler_output
    out = ours(pix, grid)
    assert out.shape == ref.shape == (n // vc.spatial_merge_size ** 2, vc.out_hidden_size)
    fwd = float(((out - ref).abs().max() / ref.abs().max()).detach())
    assert fwd <= 1e-5, fwd
    g = torch.randn_like(ref)
    (ref * g).sum().backward()
    (out * g).sum().backward()
    hp = dict(hf.named_parameters())
    worst = ("", 0.0)
    for name, p in ours.named_parameters():
        assert p.grad is not None, name
        r = rel(p.grad, hp[name].grad)
        worst = max(worst, (name, r), key=lambda t: t[1])
        assert r <= 1e-4, (name, r)
    print(f"{label} grid={grid.tolist()} fwd max|diff|/max|ref|={fwd:.2e} worst param-grad rel-L2 {worst[0]}={worst[1]:.2e}")


def test_param_names_equal_hf():
    ours, hf, _ = _build()
    assert list(dict(ours.named_parameters())) == list(dict(hf.named_parameters())) or \
        set(dict(ours.named_parameters())) == set(dict(hf.named_parameters()))
    assert set(ours.state_dict()) == set(hf.state_dict())
    for k, v in hf.state_dict().items():
        assert ours.state_dict()[k].shape == v.shape, k


def test_tiny_vision_matches_hf():
    ours, hf, vc = _build()
    _compare(ours, hf, vc, [[1, 4, 6], [1, 2, 2]], label="tiny")


def test_other_sizes_match_hf():
    vc = Glm5VisionConfig(depth=1, hidden_size=64, num_heads=4, intermediate_size=40, out_hidden_size=64,
                          projection_intermediate_size=24, patch_size=4, temporal_patch_size=1, spatial_merge_size=2,
                          in_channels=2, rms_norm_eps=1e-6, attention_bias=False, swiglu_limit=0.7, rope_theta=500.0)
    ours, hf, vc = _build(vc, seed=3)
    # a two-frame entry (each frame is its own attention segment) and two equal-size images (batched SDPA path)
    _compare(ours, hf, vc, [[2, 4, 4], [1, 2, 6], [1, 4, 4], [1, 6, 2]], seed=1, label="other")


def test_merge_1_and_single_image():
    vc = Glm5VisionConfig(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                          projection_intermediate_size=40, patch_size=2, temporal_patch_size=2, spatial_merge_size=1,
                          in_channels=3)
    ours, hf, vc = _build(vc, seed=5)
    _compare(ours, hf, vc, [[1, 3, 5]], seed=2, label="merge1")


def test_grid_helpers_match_hf():
    grid = torch.tensor([[1, 4, 6], [2, 2, 2], [1, 6, 4]])
    assert torch.equal(vision_position_ids(grid, 2), get_vision_position_ids(grid, 2))
    assert torch.equal(vision_cu_seqlens(grid), get_vision_cu_seqlens(grid))
    with pytest.raises(ValueError):
        vision_position_ids(torch.tensor([[1, 3, 4]]), 2)


def test_bad_pixel_count_raises():
    ours, _, vc = _build()
    with pytest.raises(ValueError):
        ours(torch.randn(10, 3 * 2 * 14 * 14), torch.tensor([[1, 2, 2]]))


def test_recompute_blocks_same_result():
    ours, _, vc = _build()
    grid = torch.tensor([[1, 4, 6], [1, 2, 2]])
    pix = torch.randn(28, 3 * 2 * 14 * 14)
    ours.train()
    a = ours(pix, grid)
    a.square().sum().backward()
    ga = [p.grad.clone() for p in ours.parameters()]
    ours.zero_grad()
    ours.recompute_blocks = True
    b = ours(pix, grid)
    b.square().sum().backward()
    assert torch.equal(a, b)
    for x, p in zip(ga, ours.parameters()):
        assert torch.allclose(x, p.grad, rtol=1e-6, atol=1e-7)


def _hf_splice(input_ids, embeds, feats, cfg):
    """HF's Glm5NextModel.get_placeholder_mask + masked_scatter (called with a stand-in ``self``)."""
    stub = types.SimpleNamespace(config=cfg)
    mask, _ = transformers.Glm5NextModel.get_placeholder_mask(stub, input_ids, inputs_embeds=embeds,
                                                              image_features=feats)
    return embeds.masked_scatter(mask, feats)


def test_splice_matches_hf():
    cfg = tiny_config()
    I, VS, VE, IS, IE = (cfg.image_token_id, cfg.video_start_token_id, cfg.video_end_token_id,
                         cfg.image_start_token_id, cfg.image_end_token_id)
    row0 = [5, IS, I, I, IE, 7, VS, I, I, VE, 8, IS, I, I, I, IE, 9]   # video span holds image-token ids
    row1 = [3, 4, VS, I, VE, IS, I, I, IE, 6, 6, 6, 6, 6, 6, 6, 6]
    ids = torch.tensor([row0, row1])
    h = cfg.hidden_size
    torch.manual_seed(0)
    embeds = torch.randn(2, ids.shape[1], h, requires_grad=True)
    mask = image_token_mask(ids, cfg)
    n_img = int(mask.sum())
    assert n_img == 7  # 2 + 3 in row 0, 2 in row 1; the 3 inside video spans are excluded
    assert not bool(mask[0, 7]) and not bool(mask[0, 8]) and not bool(mask[1, 3])
    feats = torch.randn(n_img, h, requires_grad=True)
    ref = _hf_splice(ids, embeds, feats, cfg)
    out = splice_image_features(ids, embeds, feats, cfg)
    assert torch.equal(out, ref)
    # video-span image tokens kept their embeddings
    assert torch.equal(out[0, 7], embeds[0, 7]) and torch.equal(out[1, 3], embeds[1, 3])
    # sequence-first layout gives the same thing
    out_sf = splice_image_features(ids, embeds.transpose(0, 1), feats, cfg, sequence_first=True)
    assert torch.equal(out_sf.transpose(0, 1), ref)
    # differentiable in the features and in the untouched embeddings
    g = torch.randn_like(out)
    (out * g).sum().backward()
    assert torch.equal(feats.grad, g[mask])
    assert torch.equal(embeds.grad[~mask], g[~mask]) and bool((embeds.grad[mask] == 0).all())


def test_splice_count_mismatch_raises():
    cfg = tiny_config()
    ids = torch.tensor([[1, cfg.image_token_id, cfg.image_token_id, 2]])
    embeds = torch.randn(1, 4, cfg.hidden_size)
    with pytest.raises(ValueError, match="image tokens"):
        splice_image_features(ids, embeds, torch.randn(3, cfg.hidden_size), cfg)
    with pytest.raises(ValueError, match="image tokens"):
        splice_image_features(ids, embeds, torch.randn(1, cfg.hidden_size), cfg)


def test_sharded_state_dict_replicated(mcore):
    ours, _, _ = _build()
    sd = ours.sharded_state_dict(prefix="vision_model.")
    assert set(sd) == {f"vision_model.{k}" for k in ours.state_dict()}
    for t in sd.values():
        assert t.global_shape == t.local_shape
