"""--log-throughput's FLOPs (megatron_glm5/training/flops.py) against torch's FLOP counter on the tiny model."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode


def _model(mcore, **kw):
    from megatron_glm5.config import tiny_config
    from megatron_glm5.models.builder import build_model
    from megatron_glm5.training.flops import weight_counts

    cfg = tiny_config(mtp_num_layers=1, use_cpu_initialization=True, **kw)
    torch.manual_seed(0)
    model = build_model(cfg)
    return cfg, model, weight_counts([model], cfg)


@pytest.mark.parametrize("seq_length", [32, 96])
def test_text_forward_flops_match_the_counted_matmuls(mcore, seq_length):
    """The formula's forward FLOPs of one row against torch's count of the model's matrix products (absorbed sparse
    DSA, chunked KDA; rows longer than index_topk, so the selection is sparse at 96): within 12 % (the chunked delta
    rule pads short rows to a chunk and solves the chunk's triangular system, which the formula leaves out)."""
    from megatron_glm5.training.flops import text_forward_flops_per_row

    cfg, model, counts = _model(mcore, dsa_backend="sparse")
    assert seq_length <= cfg.index_topk or seq_length > cfg.index_topk + cfg.index_kpool
    tokens = torch.randint(0, cfg.vocab_size, (1, seq_length))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(tokens, labels=tokens, loss_mask=torch.ones(1, seq_length))
    trained, forward_only = text_forward_flops_per_row(cfg, counts, seq_length)
    ratio = counter.get_total_flops() / (trained + forward_only)
    assert 1.0 <= ratio <= 1.12, ratio


def test_vision_flops_are_the_counted_matmuls_plus_attention(mcore):
    """The vision tower's matrix products, counted by torch, equal the formula's weight term exactly; attention
    (torch's CPU SDPA is not counted) is 2 x 2 x hidden x L per patch and block, forward."""
    from megatron_glm5.training.flops import vision_flops

    cfg, model, counts = _model(mcore)
    vc = cfg.vision
    grid = torch.tensor([[1, 8, 12], [1, 4, 4]])
    patches = int(grid.prod(-1).sum())
    pixels = torch.randn(patches, vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.vision_model(pixels, grid)
    frames_sq = float(((grid[:, 1] * grid[:, 2]) ** 2).sum())
    attention = 4.0 * vc.depth * vc.hidden_size * frames_sq
    assert counter.get_total_flops() == vision_flops(cfg, counts, patches, frames_sq, trained=False) - attention
    assert vision_flops(cfg, counts, patches, frames_sq, trained=True) == 3 * vision_flops(
        cfg, counts, patches, frames_sq, trained=False)


def test_selected_positions_by_hand():
    """Query i reads kpool * min(topk / kpool, (i + 1) // kpool) pool positions plus the (i + 1) % kpool tail."""
    from megatron_glm5.training.flops import selected_positions, visible_pools

    # kpool 4, topk 8 (two pools), 11 queries: visible 1..11 -> pools 0,0,0,1,1,1,1,2,2,2,2 (capped at 2)
    # positions = 4 * pools + tail = [1,2,3,4,5,6,7,8,9,10,11] up to 8 (dense), then 8+1, 8+2, 8+3
    assert selected_positions(11, 8, 4, True) == sum(range(1, 12))
    assert selected_positions(14, 8, 4, True) == sum(range(1, 12)) + (8 + 0) + (8 + 1) + (8 + 2)
    assert selected_positions(14, 8, 4, False) == 4 * (0 + 0 + 0 + 1 + 1 + 1 + 1 + 2 * 7)
    assert visible_pools(9, 4) == 0 + 0 + 0 + 1 + 1 + 1 + 1 + 2 + 2


def test_megatron_counts_with_this_formula():
    from megatron.training import training

    from megatron_glm5.training import flops

    flops.install()
    assert training.num_floating_point_operations is flops.num_floating_point_operations


def test_video_patches_count_like_image_patches(mcore):
    """A micro batch's video_grid_thw is counted as the tower runs it: a [t, h, w] video is t frames of h x w patches
    (what the same frames as t images give), added to the images' count; the tower's matrix products on a row of an
    image and a video, counted by torch through the model's embedding, equal the formula's weight term."""
    from megatron_glm5.training import flops

    cfg, model, counts = _model(mcore)
    vc = cfg.vision
    image, video = torch.tensor([[1, 4, 4]]), torch.tensor([[3, 4, 6], [2, 2, 2]])
    flops._VISION.clear()
    flops.record_images(7, None, video)
    flops.record_images(8, torch.tensor([[1, 4, 6]] * 3 + [[1, 2, 2]] * 2), None)
    assert flops._VISION[7] == flops._VISION[8] == [3 * 24 + 2 * 4, 3 * 24 ** 2 + 2 * 4 ** 2]
    flops.record_images(9, image, video)
    patches, frames_sq = flops._VISION[9]
    assert (patches, frames_sq) == (16 + 80, 16 ** 2 + 3 * 24 ** 2 + 2 * 4 ** 2)
    flops._VISION.clear()

    width = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    n_img, n_vid = 16 // 4, 80 // 4
    ids = torch.tensor([[5, cfg.image_start_token_id] + [cfg.image_token_id] * n_img + [cfg.image_end_token_id, 6,
                         cfg.video_start_token_id] + [cfg.image_token_id] * n_vid + [cfg.video_end_token_id, 7]])
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.embed(ids, torch.randn(16, width), image, pixel_values_videos=torch.randn(80, width),
                    video_grid_thw=video)
    attention = 4.0 * vc.depth * vc.hidden_size * frames_sq
    assert counter.get_total_flops() == flops.vision_flops(cfg, counts, patches, frames_sq, trained=False) - attention
