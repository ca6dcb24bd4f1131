"""The fused sparse MLA Triton kernel (dsa_backend='fused') against its PyTorch references, on the GPU.

Kernel level: ``sparse_mla`` vs ``sparse_mla_reference`` (fp32 masked dense) on fresh random inputs -- forward and
gradients, unused (-1) slots anywhere, rows with no valid slot, widths that are not a multiple of the block,
head counts that are not a power of two (padded head blocks), batch rows. Module level: the KPool DSA layer with
the real indexer on a packed row (document boundaries, pool tails, top-k larger than some documents) against the
'torch' backend, forward and every gradient, fp32 and bf16.
"""

import pytest
import torch

from megatron_glm5.config import Glm5Config, tiny_hf_config
from megatron_glm5.models.packing import make_packed_seq_params
from tests.helpers import rel

pytestmark = pytest.mark.gpu


def _random_selection(b, s, W, gen, hole_frac=0.2):
    """Distinct causal positions per row, ``-1`` holes scattered anywhere, some rows empty."""
    idx = torch.full((b, s, W), -1, dtype=torch.int64)
    for bi in range(b):
        for i in range(s):
            n = min(i + 1, W)
            idx[bi, i, :n] = torch.randperm(i + 1, generator=gen)[:n]
            perm = torch.randperm(W, generator=gen)
            idx[bi, i] = idx[bi, i, perm]  # valid slots not a prefix
    holes = torch.rand(b, s, W, generator=gen) < hole_frac
    idx[holes] = -1
    idx[:, 3] = -1  # an empty row
    return idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,s,H,R,W", [(1, 200, 16, 64, 45), (2, 96, 20, 32, 70), (1, 130, 64, 128, 130),
                                       (1, 160, 64, 512, 150), (1, 90, 96, 64, 100)])
def test_kernel_matches_reference(dtype, b, s, H, R, W):
    """Default tilings: bf16 runs the split backward (dq kernel + the transposed-form dkv kernel), fp32 the fused
    one; the released widths (64 heads, latent 512) and a head count over one 64-head block are included."""
    from megatron_glm5.kernels.sparse_mla import sparse_mla, sparse_mla_reference

    gen = torch.Generator().manual_seed(s + H)
    q = torch.randn(b, s, H, R, generator=gen).cuda().to(dtype).requires_grad_(True)
    kv = torch.randn(b, s, R, generator=gen).cuda().to(dtype).requires_grad_(True)
    idx = _random_selection(b, s, W, gen).cuda()
    scale = R ** -0.5
    w = torch.randn(b, s, H, R, generator=gen).cuda()

    ref = sparse_mla_reference(q.detach().double(), kv.detach().double(), idx, scale)
    qd, kd = q.detach().double().requires_grad_(True), kv.detach().double().requires_grad_(True)
    (sparse_mla_reference(qd, kd, idx, scale) * w.double()).sum().backward()

    out = sparse_mla(q, kv, idx, scale)
    (out.float() * w).sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()
    assert out[:, 3].abs().max() == 0  # empty rows are zero
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    e_o, e_q, e_k = rel(out, ref), rel(q.grad, qd.grad), rel(kv.grad, kd.grad)
    print(f"{dtype} b={b} s={s} H={H} R={R} W={W}: out {e_o:.2e} dq {e_q:.2e} dkv {e_k:.2e}")
    assert e_o < tol and e_q < tol and e_k < 2 * tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,s,first,H,R,W", [(1, 200, 120, 64, 512, 150), (2, 96, 35, 20, 32, 70)])
def test_fewer_queries_than_latent_rows(dtype, b, s, first, H, R, W):
    """The queries of positions ``first..s-1`` only (the rest of a sequence whose first queries run dense) over all
    ``s`` latent rows: the latent gradient has every row's shape, and output and gradients equal the reference's."""
    from megatron_glm5.kernels.sparse_mla import sparse_mla, sparse_mla_reference

    gen = torch.Generator().manual_seed(s + first)
    q = torch.randn(b, s - first, H, R, generator=gen).cuda().to(dtype).requires_grad_(True)
    kv = torch.randn(b, s, R, generator=gen).cuda().to(dtype).requires_grad_(True)
    idx = _random_selection(b, s, W, gen)[:, first:].contiguous().cuda()
    scale = R ** -0.5
    w = torch.randn(b, s - first, H, R, generator=gen).cuda()

    qd, kd = q.detach().double().requires_grad_(True), kv.detach().double().requires_grad_(True)
    ref = sparse_mla_reference(qd, kd, idx, scale)
    (ref * w.double()).sum().backward()
    out = sparse_mla(q, kv, idx, scale)
    (out.float() * w).sum().backward()
    assert kv.grad.shape == kv.shape and q.grad.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    e_o, e_q, e_k = rel(out, ref), rel(q.grad, qd.grad), rel(kv.grad, kd.grad)
    print(f"{dtype} b={b} queries {first}..{s - 1} of {s}: out {e_o:.2e} dq {e_q:.2e} dkv {e_k:.2e}")
    assert e_o < tol and e_q < tol and e_k < 2 * tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,s,H,R,W", [(1, 160, 64, 512, 150), (2, 96, 20, 32, 70)])
def test_kernel_reads_head_major_queries_and_gradients(dtype, b, s, H, R, W):
    """Queries laid out head-major (``[H, b, s, R]`` memory, as the DSA layer's einsum makes them) and an output
    gradient in that layout are read in place: the output and dq equal the contiguous run's bitwise (same
    arithmetic, no copies), dkv to its fp32 atomics' order."""
    from megatron_glm5.kernels.sparse_mla import sparse_mla

    gen = torch.Generator().manual_seed(s * H + R)
    q_hm = torch.randn(H, b, s, R, generator=gen).cuda().to(dtype)
    kv0 = torch.randn(b, s, R, generator=gen).cuda().to(dtype)
    idx = _random_selection(b, s, W, gen).cuda()
    w_hm = torch.randn(H, b, s, R, generator=gen).cuda()
    scale = R ** -0.5

    def run(head_major):
        store = (q_hm if head_major else q_hm.permute(1, 2, 0, 3).contiguous()).clone().requires_grad_(True)
        q = store.permute(1, 2, 0, 3) if head_major else store
        kv = kv0.clone().requires_grad_(True)
        out = sparse_mla(q, kv, idx, scale)
        (out.permute(2, 0, 1, 3).float() * w_hm).sum().backward()  # dO arrives head-major too
        dq = store.grad.permute(1, 2, 0, 3) if head_major else store.grad
        return out.detach(), dq, kv.grad

    (o_c, dq_c, dkv_c), (o_h, dq_h, dkv_h) = run(False), run(True)
    assert torch.equal(o_h, o_c) and torch.equal(dq_h, dq_c)
    assert rel(dkv_h, dkv_c) < (1e-6 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("b,s,H,R,W", [(1, 200, 16, 64, 45), (1, 160, 64, 512, 150)])
def test_fused_backward_in_bf16(monkeypatch, b, s, H, R, W):
    """The single fused backward kernel (the fp32 default) stays right for bf16 too; and the transposed-form dkv
    kernel gives the fused kernel's dkv, with every persistent program count (fewer programs than work items)."""
    from megatron_glm5.kernels import sparse_mla as sm

    gen = torch.Generator().manual_seed(11)
    q = (torch.randn(b * s, H, R, generator=gen) * 0.5).cuda().to(torch.bfloat16)
    kv = torch.randn(b * s, R, generator=gen).cuda().to(torch.bfloat16)
    go = torch.randn(b * s, H, R, generator=gen).cuda().to(torch.bfloat16)
    idx = _random_selection(b, s, W, gen).cuda()
    idx_f, n_end = sm.prepare_indices(idx, s)
    scale = R ** -0.5
    o, lse = sm._sparse_mla_fwd(q, kv, idx_f, n_end, scale)
    qd, kd = q.double().requires_grad_(True), kv.double().requires_grad_(True)
    sm.sparse_mla_reference(qd.view(b, s, H, R), kd.view(b, s, R), idx, scale).backward(go.double().view(b, s, H, R))
    results = {}
    for name, cfg in (("split", dict(sm.BWD_CONFIG)), ("fused", dict(sm.BWD_CONFIG_FP32)),
                      ("split, 3 programs", {**sm.BWD_CONFIG, "dkv": {**sm.BWD_CONFIG["dkv"], "programs": 3}})):
        monkeypatch.setattr(sm, "BWD_CONFIG", cfg)
        dq, dkv = sm._sparse_mla_bwd(go, q, kv, o, lse, idx_f, n_end, scale)
        assert torch.isfinite(dq).all() and torch.isfinite(dkv).all(), name
        results[name] = (dq, dkv)
        e_q, e_k = rel(dq, qd.grad), rel(dkv, kd.grad)
        print(f"{name} H={H} R={R}: dq {e_q:.2e} dkv {e_k:.2e}")
        assert e_q < 1.5e-2 and e_k < 3e-2, name
    # dkv is summed with fp32 atomics in no fixed order, then rounded to bf16: a few elements land one bf16 step
    # (2^-8 relative) apart between runs (~3e-5 in norm on an H100); a work item left out moves it by
    # far more
    assert rel(results["split, 3 programs"][1], results["split"][1]) < 5e-4
    assert rel(results["split"][1], results["fused"][1]) < 1e-2


def _dsa_pair(dtype, **over):
    from megatron_glm5.models.kpool_dsa import Glm5DSAttention, get_dsa_module_spec

    t = dict(tiny_hf_config(with_vision=False)["text_config"])
    t.update(num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32,
             index_topk=32, index_kpool=4, index_n_heads=8, index_head_dim=32)
    t.update(over)
    mods = []
    for backend in ("torch", "fused"):
        cfg = Glm5Config.from_hf({"text_config": t}, dsa_backend=backend, use_cpu_initialization=True)
        torch.manual_seed(0)
        m = Glm5DSAttention(cfg, get_dsa_module_spec().submodules, layer_number=2)
        mods.append(m)
    mods[1].load_state_dict(mods[0].state_dict())
    with torch.no_grad():
        for m in mods:
            torch.manual_seed(1)
            for p in m.parameters():
                p.normal_(0.0, 0.2)
            m.q_a_layernorm.weight.add_(1.0)
            m.kv_a_layernorm.weight.add_(1.0)
            m.indexer.k_norm.weight.add_(1.0)
    return [m.cuda().to(dtype) for m in mods]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,tail", [([150, 3, 97, 250], True), ([61, 139], False)])
def test_fused_backend_matches_torch_backend(mcore, dtype, lens, tail):
    """Packed row with documents shorter and longer than index_topk (32 tokens = 8 pools of 4), a 3-token
    document (only tail positions), tails on and off: the fused backend equals the masked-dense one."""
    ref_mod, fused_mod = _dsa_pair(dtype, index_kpool_always_select_tail=tail)
    s = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    psp = make_packed_seq_params(cu)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(s, 1, ref_mod.hidden_size, generator=gen).cuda().to(dtype)
    w = torch.randn(s, 1, ref_mod.hidden_size, generator=gen).cuda()
    res = []
    for m in (ref_mod, fused_mod):
        xi = x.clone().requires_grad_(True)
        out, topk = m(xi, packed_seq_params=psp)
        (out.float() * w).sum().backward()
        res.append((out.float(), topk, xi.grad.float(), {n: p.grad.float() for n, p in m.named_parameters()
                                                          if p.grad is not None}))
    assert torch.equal(res[0][1], res[1][1])  # the same selection
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    assert torch.isfinite(res[1][0]).all() and torch.isfinite(res[1][2]).all()
    assert rel(res[1][0], res[0][0]) < tol
    assert rel(res[1][2], res[0][2]) < tol
    assert res[0][3].keys() == res[1][3].keys()
    for n in res[0][3]:
        assert torch.isfinite(res[1][3][n]).all(), n
        assert rel(res[1][3][n], res[0][3][n]) < 2 * tol, n


def test_memory_is_linear_in_sequence_length(mcore):
    """Peak extra memory of the kernel's forward + backward grows linearly: 4x the tokens -> about 4x the bytes
    (the masked-dense reference would grow 16x)."""
    from megatron_glm5.kernels.sparse_mla import sparse_mla

    H, R, W = 16, 64, 256
    peaks = []
    for s in (2048, 8192):
        q = torch.randn(1, s, H, R, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(1, s, R, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        pos = torch.arange(s, device="cuda")[:, None]
        idx = (pos - torch.arange(W, device="cuda")[None]).clamp(min=-1)[None]    # the W previous tokens
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        sparse_mla(q, kv, idx, 0.1).float().sum().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    ratio = peaks[1] / peaks[0]
    print(f"peak extra memory {peaks[0] / 2**20:.1f} MiB -> {peaks[1] / 2**20:.1f} MiB (x{ratio:.2f})")
    assert ratio < 5.0
