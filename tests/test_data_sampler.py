"""MegatronPretrainingSampler (resume, DP slicing), the DataLoader, and collate (plain and packed THD rows)."""

import pytest
import torch

from megatron_glm5.data.collate import collate
from megatron_glm5.data.sampler import MegatronPretrainingSampler, build_data_loader
from megatron_glm5.models.packing import make_packed_seq_params, row_cu_seqlens


@pytest.mark.parametrize("mbs, dp", [(1, 1), (2, 1), (2, 3), (3, 2)])
def test_sampler_resume_and_dp_slices(mbs, dp):
    total = 53
    full = [list(MegatronPretrainingSampler(total, 0, mbs, r, dp)) for r in range(dp)]
    step = mbs * dp
    n_steps = total // step
    for r in range(dp):
        assert len(full[r]) == n_steps == len(MegatronPretrainingSampler(total, 0, mbs, r, dp))
        for k, batch in enumerate(full[r]):  # rank r takes slice r of each global micro-batch
            assert batch == list(range(k * step + r * mbs, k * step + (r + 1) * mbs))
    for k in range(1, n_steps):  # resume at consumed_samples = k global micro-batches: the same remaining stream
        for r in range(dp):
            assert list(MegatronPretrainingSampler(total, k * step, mbs, r, dp)) == full[r][k:]
    with pytest.raises(ValueError):
        MegatronPretrainingSampler(total, total, mbs, 0, dp)
    with pytest.raises(ValueError):
        MegatronPretrainingSampler(total, 0, mbs, dp, dp)


class _Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, i):
        return {"tokens": torch.arange(4) + 10 * i, "loss_mask": torch.full((4,), float(i))}


def test_data_loader_resume_and_plain_collate():
    full = [b["tokens"] for b in build_data_loader(_Rows(), 0, 2, 1, 2)]
    resumed = [b["tokens"] for b in build_data_loader(_Rows(), 8, 2, 1, 2)]
    assert len(full) == 5 and len(resumed) == 3
    assert all(a.equal(b) for a, b in zip(full[2:], resumed))
    assert full[0].equal(torch.stack([torch.arange(4) + 20, torch.arange(4) + 30]))  # rank 1: samples 2, 3
    b = collate([_Rows()[0], _Rows()[5]])
    assert b["loss_mask"].shape == (2, 4) and b["loss_mask"][1].eq(5.0).all()


def _packed(s, bounds, n_patches, seed):
    g = torch.Generator().manual_seed(seed)
    row = {"tokens": torch.randint(0, 100, (s,), generator=g), "labels": torch.randint(0, 100, (s,), generator=g),
           "loss_mask": torch.rand(s, generator=g), "cu_seqlens": torch.tensor(bounds, dtype=torch.int32)}
    if n_patches:
        row["pixel_values"] = torch.randn(n_patches, 6, generator=g)
        row["image_grid_thw"] = torch.tensor([[1, 2, n_patches // 2]])
    return row


def test_packed_collate_is_one_thd_row():
    rows = [_packed(8, [0, 3, 8], 4, 0), _packed(8, [0, 8], 0, 1), _packed(8, [0, 2, 5, 8], 6, 2)]
    b = collate(rows)
    assert b["tokens"].shape == b["labels"].shape == b["loss_mask"].shape == (1, 24)
    for k in ("tokens", "labels", "loss_mask"):
        assert b[k][0].equal(torch.cat([r[k] for r in rows]))
    assert b["cu_seqlens"].dtype == torch.int32 and b["cu_seqlens"].tolist() == [0, 3, 8, 16, 18, 21, 24]
    assert b["pixel_values"].equal(torch.cat([rows[0]["pixel_values"], rows[2]["pixel_values"]]))
    assert b["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 3]]
    psp = make_packed_seq_params(b["cu_seqlens"])
    assert row_cu_seqlens(psp, 24, "cpu").equal(b["cu_seqlens"]) and psp.max_seqlen_q == 8
    assert "pixel_values" not in collate([rows[1], rows[1]])
    with pytest.raises(ValueError, match="mixes packed rows"):
        collate([rows[0], _Rows()[0]])


def test_row_boundaries_checked_once_per_packed_seq_params(monkeypatch):
    """Every layer asks for the row's boundaries: they are read (a host sync on CUDA) and checked once per
    PackedSeqParams and cu_seqlens tensor; a new tensor, another length or bad boundaries are checked again."""
    from megatron_glm5.models import packing

    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real(t))
    psp = make_packed_seq_params(torch.tensor([0, 5, 9, 24]))
    first = row_cu_seqlens(psp, 24, "cpu")
    for _ in range(5):
        assert row_cu_seqlens(psp, 24, "cpu") is first
        assert packing.row_boundaries(psp, 24) == [0, 5, 9, 24]
    assert len(reads) == 1 and first.dtype == torch.int32 and first.tolist() == [0, 5, 9, 24]
    psp.cu_seqlens_q = torch.tensor([0, 12, 24], dtype=torch.int32)   # a new tensor: checked again
    assert packing.row_boundaries(psp, 24) == [0, 12, 24] and row_cu_seqlens(psp, 24, "cpu").tolist() == [0, 12, 24]
    with pytest.raises(ValueError, match="row length 25"):
        row_cu_seqlens(psp, 25, "cpu")
    psp.cu_seqlens_q = torch.tensor([0, 14, 12, 24], dtype=torch.int32)
    with pytest.raises(ValueError, match="non-decreasing"):
        packing.row_boundaries(psp, 24)


def test_fla_cu_seqlens_are_the_same_objects_for_every_layer():
    """FLA caches its chunk indices by tensor identity: every KDA layer of a step (and its backward) must get the
    same two int64 boundary tensors, or each layer rebuilds them with a host-synchronizing copy."""
    from megatron_glm5.models import packing

    psp = make_packed_seq_params(torch.tensor([0, 5, 9, 24]))
    dev, host = packing.fla_cu_seqlens(psp, 24, "cpu")
    assert dev.dtype == host.dtype == torch.int64 and dev.tolist() == host.tolist() == [0, 5, 9, 24]
    for _ in range(3):
        again = packing.fla_cu_seqlens(psp, 24, "cpu")
        assert again[0] is dev and again[1] is host
    psp.cu_seqlens_q = torch.tensor([0, 12, 24], dtype=torch.int32)   # a new row: new tensors
    assert packing.fla_cu_seqlens(psp, 24, "cpu")[1].tolist() == [0, 12, 24]
    t = torch.arange(6).view(2, 3)
    assert packing.to_device_async(t, "cpu").equal(t)
