"""Vocab-parallel cross entropy (``kernels/cross_entropy.py``) against megatron-core's and F.cross_entropy: loss and
logit gradients, fp32 and bf16, on one rank and with the vocabulary split over 2 gloo ranks; the Triton kernels
against their PyTorch references on the GPU."""

import pytest
import torch

from megatron_glm5.kernels import cross_entropy as ce
from tests.parallel_harness import spawn


def _inputs(s, b, v, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(s, b, v, generator=g) * 3).to(dtype)
    target = torch.randint(0, v, (s, b), generator=g)
    w = torch.rand(s, b, generator=g)
    return logits, target, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_megatron_and_torch_on_one_rank(mcore, dtype):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as mcore_ce

    logits, target, w = _inputs(7, 3, 1000, dtype, 0)
    x1 = logits.clone().requires_grad_(True)
    loss = ce.vocab_parallel_cross_entropy(x1, target)
    (loss * w).sum().backward()
    assert torch.equal(x1.detach(), logits)                                    # the logits are not modified
    assert loss.dtype == torch.float32 and x1.grad.dtype == dtype

    x2 = logits.clone().requires_grad_(True)
    ref = mcore_ce(x2.clone(), target)
    (ref * w).sum().backward()
    x3 = logits.double().requires_grad_(True)
    exact = torch.nn.functional.cross_entropy(x3.reshape(-1, 1000), target.reshape(-1), reduction="none").view(7, 3)
    (exact * w.double()).sum().backward()

    tol = 1e-6 if dtype == torch.float32 else 1e-6
    assert (loss.double() - exact).abs().max() / exact.abs().max() < tol
    assert (loss - ref).abs().max() / ref.abs().max() < 1e-6
    gtol = 1e-6 if dtype == torch.float32 else 8e-3                           # bf16 gradient rounding
    assert ((x1.grad.double() - x3.grad).norm() / x3.grad.norm()) < gtol
    assert ((x1.grad.float() - x2.grad.float()).norm() / x2.grad.float().norm()) < gtol


def test_targets_off_the_shard_and_the_references():
    """row_stats with -1 targets gives 0 target logits; softmax_grad leaves those rows without the one-hot term."""
    x = torch.randn(5, 33)
    t = torch.tensor([3, -1, 0, 32, -1], dtype=torch.int32)
    m, sum_exp, x_t = ce.row_stats_reference(x, t)
    assert torch.allclose(m, x.amax(-1)) and torch.allclose(torch.log(sum_exp) + m, torch.logsumexp(x, -1))
    assert x_t.tolist() == [x[0, 3].item(), 0.0, x[2, 0].item(), x[3, 32].item(), 0.0]
    lse = torch.logsumexp(x, -1)
    g = torch.rand(5)
    dx = ce.softmax_grad_reference(x, t, lse, g)
    p = torch.softmax(x, -1) * g[:, None]
    assert torch.allclose(dx[1], p[1]) and torch.allclose(dx[4], p[4])
    assert torch.allclose(dx[0, 3], p[0, 3] - g[0]) and torch.allclose(dx[3, 32], p[3, 32] - g[3])


def _tp_rank(dtype_name, shard_bias):
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    dtype = getattr(torch, dtype_name)
    logits, target, w = _inputs(6, 2, 300, dtype, 1)
    logits[..., :150] += shard_bias                                            # one shard holds the row maxima
    v = 300 // world
    x = logits[..., rank * v:(rank + 1) * v].clone().requires_grad_(True)
    loss = ce.vocab_parallel_cross_entropy(x, target, torch.distributed.group.WORLD)
    (loss * w).sum().backward()
    return loss, x.grad


@pytest.mark.parametrize("dtype_name,shard_bias", [("float32", 0.0), ("float32", 30.0), ("bfloat16", 5.0)])
def test_vocab_split_over_two_ranks_matches_one_rank(dtype_name, shard_bias):
    dtype = getattr(torch, dtype_name)
    logits, target, w = _inputs(6, 2, 300, dtype, 1)
    logits[..., :150] += shard_bias
    x = logits.clone().requires_grad_(True)
    full = ce.vocab_parallel_cross_entropy(x, target)
    (full * w).sum().backward()
    ranks = spawn(_tp_rank, 2, dtype_name, shard_bias, timeout=300)
    for r, (loss, grad) in enumerate(ranks):
        assert (loss - full).abs().max() / full.abs().max() < 1e-6
        ref = x.grad[..., r * 150:(r + 1) * 150].float()
        assert ((grad.float() - ref).norm() / ref.norm()) < (1e-6 if dtype == torch.float32 else 8e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,v", [(37, 5000), (8, 4096), (3, 154880 // 4 + 3)])
def test_triton_kernels_match_references(dtype, n, v):
    g = torch.Generator().manual_seed(n + v)
    x = (torch.randn(n, v, generator=g) * 4).to(dtype).cuda()
    t = torch.randint(-1, v, (n,), generator=g).to(torch.int32).cuda()
    t[0] = v - 1
    m, sum_exp, x_t = ce.row_stats(x, t)
    mr, lr, xtr = ce.row_stats_reference(x, t)
    assert torch.equal(m, mr) and torch.equal(x_t, xtr)
    assert ((sum_exp - lr).abs() / lr).max() < 1e-5
    lse = mr + torch.log(lr)
    grad = torch.rand(n, generator=g).cuda()
    dx = torch.full_like(x, float("nan"))
    dx = ce.softmax_grad(x, t, lse, grad)
    dref = ce.softmax_grad_reference(x, t, lse, grad)
    assert torch.isfinite(dx).all()
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert ((dx.float() - dref.float()).norm() / dref.float().norm()) < tol


def test_model_loss_is_cross_entropy_of_its_logits(tmp_path, mcore):
    """The model's per-token loss [b, s] (labels path) is F.cross_entropy of the logits it returns without labels."""
    from megatron_glm5.cli.make_tiny_hf_checkpoint import write_checkpoint
    from megatron_glm5.config import tiny_hf_config
    from megatron_glm5.models.builder import build_model_from_hf

    ckpt = write_checkpoint(str(tmp_path / "ckpt"), tiny_hf_config(with_vision=False), fmt="fp32", seed=3)
    model = build_model_from_hf(ckpt, mtp_num_layers=None)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 240, (2, 19), generator=g)
    labels = torch.randint(0, model.config.vocab_size, (2, 19), generator=g)
    with torch.no_grad():
        loss = model(ids, labels=labels)
        logits = model(ids)
    assert loss.shape == (2, 19) and logits.shape[:2] == (2, 19)
    ref = torch.nn.functional.cross_entropy(logits.double().reshape(38, -1), labels.reshape(-1),
                                            reduction="none").view(2, 19)
    assert (loss.double() - ref).abs().max() / ref.abs().max() < 1e-6
