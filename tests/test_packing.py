"""models/packing.py: the batch's PackedSeqParams moved to the model's device with its boundaries checked and
remembered on the host copy (the layers' reads of them then touch no device tensor)."""

import pytest
import torch

from megatron_glm5.models.packing import make_packed_seq_params, packed_seq_params_to, row_boundaries, row_cu_seqlens


def test_boundaries_remembered_from_the_host_copy(monkeypatch):
    """``[0, 3, 10, 16]`` (int64 from a loader): after the move ``cu_seqlens_q`` is int32 and ``cu_seqlens_kv`` the
    same tensor; the layers' boundaries come from what was checked, without reading ``cu_seqlens_q`` again (its
    ``tolist`` made to fail), and the device copy handed out is that tensor."""
    psp = make_packed_seq_params(torch.tensor([0, 3, 10, 16]))
    assert packed_seq_params_to(psp, "cpu", 16) is psp
    assert psp.cu_seqlens_q.dtype == torch.int32 and psp.cu_seqlens_kv is psp.cu_seqlens_q
    assert psp.cu_seqlens_q.tolist() == [0, 3, 10, 16]
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("read the boundaries again"))
    assert row_boundaries(psp, 16) == [0, 3, 10, 16]
    assert row_cu_seqlens(psp, 16, "cpu") is psp.cu_seqlens_q


def test_boundaries_that_do_not_end_at_the_row_length_are_refused():
    """A row of 16 tokens whose boundaries end at 15: the same ValueError the layers raise; no params: None."""
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to the row length 16"):
        packed_seq_params_to(make_packed_seq_params(torch.tensor([0, 3, 15])), "cpu", 16)
    assert packed_seq_params_to(None, "cpu", 16) is None
