"""Kimi Delta Attention: the conv, the chunked delta rule and the megatron module against references.

References: per-document ``F.conv1d``; FLA's CPU ``naive_recurrent_kda`` (loaded by file path, ``fla.ops.kda``
needs triton); HF's ``recurrent_kimi_delta_attention`` / ``chunk_kimi_delta_attention`` and
``Glm5NextTextLinearAttention`` run on every document separately.
"""

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from megatron_glm5.config import Glm5Config, tiny_hf_config
from megatron_glm5.models.kda import (
    KimiDeltaAttention,
    causal_depthwise_conv1d,
    chunk_kda_torch,
    get_kda_module_spec,
    l2norm,
    recurrent_kda_reference,
)
from megatron_glm5.models.packing import make_packed_seq_params
from tests.helpers import rel, rel_max, spawn

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

HF_MOD = "transformers.models.glm5_next.modeling_glm5_next"


def _load_fla_naive():
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("flash-linear-attention is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", "kda", "naive.py")
    mspec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    mod = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(mod)
    return mod


def _docs(cu):
    return list(zip(cu[:-1].tolist(), cu[1:].tolist()))


def _random_core_inputs(b, s, H, K, V, gate="bounded", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, H, K, generator=gen)
    k = torch.randn(b, s, H, K, generator=gen)
    v = torch.randn(b, s, H, V, generator=gen)
    raw = torch.randn(b, s, H, K, generator=gen) * 2
    if gate == "bounded":
        g = -5.0 * torch.sigmoid(raw)
    else:  # unbounded softplus gate with large decay rates: long chunks see exp(-hundreds)
        g = -torch.exp(torch.rand(H, 1, generator=gen) * 2.8)[None, None] * F.softplus(raw)
    beta = torch.rand(b, s, H, generator=gen)
    return q, k, v, g, beta


# ============================================================================ conv
def test_causal_depthwise_conv1d_packed():
    torch.manual_seed(1)
    W, c = 4, 6
    cu = torch.tensor([0, 2, 9, 21, 33], dtype=torch.int32)  # first document shorter than W
    x = torch.randn(1, 33, c)
    w = torch.randn(c, W)
    out = causal_depthwise_conv1d(x, w, cu)
    ref = torch.cat([F.conv1d(x[:, a:e].transpose(1, 2), w[:, None], padding=W - 1, groups=c)[..., : e - a]
                     for a, e in _docs(cu)], -1).transpose(1, 2)
    err = rel_max(out, ref)
    print(f"conv packed rel max err {err:.2e}")
    assert err < 1e-6
    # checkpoint layout [c, 1, W] and no packing (batch rows are documents)
    xb = torch.randn(3, 10, c)
    ref_b = F.conv1d(xb.transpose(1, 2), w[:, None], padding=W - 1, groups=c)[..., :10].transpose(1, 2)
    assert rel_max(causal_depthwise_conv1d(xb, w[:, None]), ref_b) < 1e-6


# ============================================================================ core delta rule
@pytest.mark.parametrize("chunk_size,gate", [(16, "bounded"), (64, "bounded"), (32, "softplus")])
def test_chunk_kda_vs_fla_naive(chunk_size, gate):
    naive = _load_fla_naive()
    H, K, V = 3, 16, 12
    cu = torch.tensor([0, 5, 70, 71, 140, 161], dtype=torch.int32)  # unaligned, docs shorter than a chunk
    q, k, v, g, beta = _random_core_inputs(1, 161, H, K, V, gate=gate)
    scale = K ** -0.5
    out = chunk_kda_torch(q, k, v, g, beta, scale=scale, cu_seqlens=cu, chunk_size=chunk_size, use_qk_l2norm=True)
    qn, kn = l2norm(q), l2norm(k)
    ref = torch.cat([naive.naive_recurrent_kda(qn[:, a:e], kn[:, a:e], v[:, a:e], g[:, a:e], beta[:, a:e],
                                               scale=scale)[0] for a, e in _docs(cu)], 1)
    err = rel_max(out, ref)
    print(f"chunk_kda_torch vs fla naive (C={chunk_size}, {gate}) rel max err {err:.2e}")
    assert torch.isfinite(out).all()
    assert err < 1e-5
    # without l2norm in the call (inputs pre-normalised): same result
    out2 = chunk_kda_torch(qn, kn, v, g, beta, scale=scale, cu_seqlens=cu, chunk_size=chunk_size)
    assert rel_max(out2, ref) < 1e-5


def test_chunk_kda_vs_hf_one_document():
    hf = pytest.importorskip(HF_MOD)
    q, k, v, g, beta = _random_core_inputs(2, 100, 2, 16, 16, seed=3)
    out = chunk_kda_torch(q, k, v, g, beta, chunk_size=32, use_qk_l2norm=True)
    ref_rec, _ = hf.recurrent_kimi_delta_attention(q, k, v, g=g, beta=beta, initial_state=None,
                                                   output_final_state=False, use_qk_l2norm_in_kernel=True)
    ref_chunk, _ = hf.chunk_kimi_delta_attention(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    e1, e2 = rel_max(out, ref_rec), rel_max(out, ref_chunk)
    print(f"chunk_kda_torch vs HF recurrent {e1:.2e}, vs HF chunk {e2:.2e}")
    assert e1 < 1e-5 and e2 < 1e-5


def test_chunk_kda_gradients():
    H, K, V = 2, 8, 8
    cu = torch.tensor([0, 9, 30, 31, 75], dtype=torch.int32)
    inputs = _random_core_inputs(1, 75, H, K, V, seed=5)
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(1, 75, H, V, generator=gen)

    def grads(fn, **kw):
        xs = [t.clone().requires_grad_(True) for t in inputs]
        (fn(*xs, cu_seqlens=cu, use_qk_l2norm=True, **kw) * w).sum().backward()
        return [t.grad for t in xs]

    ours = grads(chunk_kda_torch, chunk_size=16)
    ref = grads(recurrent_kda_reference)
    errs = [rel(a, b) for a, b in zip(ours, ref)]
    print("chunk_kda_torch grad rel L2 (q, k, v, g, beta): " + ", ".join(f"{e:.2e}" for e in errs))
    assert max(errs) < 1e-4


# ============================================================================ module
def _hf_text_dict(**changes):
    t = dict(tiny_hf_config()["text_config"])
    t.update(changes)
    return t


def _build_pair(text, **overrides):
    """HF Glm5NextTextLinearAttention with random non-trivial weights + our module holding the same weights."""
    from transformers import Glm5NextTextConfig
    hf_mod = pytest.importorskip(HF_MOD)

    torch.manual_seed(11)
    hf = hf_mod.Glm5NextTextLinearAttention(Glm5NextTextConfig(**text), layer_idx=0).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            elif name.startswith("o_norm"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.startswith("conv1d"):
                p.copy_(torch.randn_like(p) * 0.4)
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    cfg = Glm5Config.from_hf({"text_config": text}, **overrides)
    ours = KimiDeltaAttention(cfg, get_kda_module_spec().submodules, layer_number=1)
    sd = _hf_to_ours_state_dict(hf.state_dict())
    missing, unexpected = ours.load_state_dict(sd, strict=False)
    assert not unexpected and all(m.endswith("_extra_state") for m in missing), (missing, unexpected)
    return hf, ours


_HF_NAME = {"forget_gate.f_a_proj.weight": "f_a_proj.weight", "forget_gate.f_b_proj.weight": "f_b_proj.weight",
            "forget_gate.A_log": "A_log", "forget_gate.dt_bias": "dt_bias"}


def _hf_to_ours_state_dict(hf_sd):
    out = {}
    for name, t in hf_sd.items():
        if name == "conv1d.weight":
            out["q_conv1d"], out["k_conv1d"], out["v_conv1d"] = t.chunk(3, 0)
        else:
            out[_HF_NAME.get(name, name)] = t
    return out


def _ours_grads_as_hf(ours):
    g = {n: p.grad for n, p in ours.named_parameters()}
    out = {"conv1d.weight": torch.cat([g.pop("q_conv1d"), g.pop("k_conv1d"), g.pop("v_conv1d")], 0)}
    inv = {v: k for k, v in _HF_NAME.items()}
    out.update({inv.get(n, n): t for n, t in g.items()})
    return out


def _check_module_against_hf(hf, ours, lengths, label):
    h = ours.hidden_size
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    s = int(cu[-1])
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(s, 1, h, generator=gen)
    w = torch.randn(s, 1, h, generator=gen)

    xo = x.clone().requires_grad_(True)
    out, bias = ours(xo, packed_seq_params=make_packed_seq_params(cu))
    assert bias is None and out.shape == (s, 1, h)
    (out * w).sum().backward()

    xh = x.clone().transpose(0, 1).requires_grad_(True)  # [1, s, h]
    ref = torch.cat([hf(xh[:, a:e]) for a, e in _docs(cu)], 1)  # each document on its own
    (ref * w.transpose(0, 1)).sum().backward()
    ref = ref.transpose(0, 1)

    err = rel_max(out.detach(), ref.detach())
    gx = rel(xo.grad, xh.grad.transpose(0, 1))
    ours_g = _ours_grads_as_hf(ours)
    hf_g = {n: p.grad for n, p in hf.named_parameters()}
    assert set(ours_g) == set(hf_g), (set(ours_g) ^ set(hf_g))
    gp = {n: rel(ours_g[n], hf_g[n]) for n in hf_g}
    print(f"[{label}] out rel max err {err:.2e}; input grad rel L2 {gx:.2e}; worst param grad rel L2 "
          f"{max(gp.values()):.2e} ({max(gp, key=gp.get)})")
    assert err <= 1e-5
    assert gx <= 1e-4
    assert max(gp.values()) <= 1e-4, gp


def test_module_matches_hf_packed(mcore):
    hf, ours = _build_pair(_hf_text_dict())
    names = sorted(n for n, _ in ours.named_parameters())
    assert names == sorted(["q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d", "k_conv1d", "v_conv1d",
                            "f_a_proj.weight", "f_b_proj.weight", "A_log", "dt_bias", "b_proj.weight",
                            "g_a_proj.weight", "g_b_proj.weight", "o_norm.weight", "o_proj.weight"])
    _check_module_against_hf(hf, ours, [37, 2, 70, 19], "bounded gate, 4x16, W=4, C=64")


def test_module_matches_hf_softplus_gate(mcore):
    hf, ours = _build_pair(_hf_text_dict(linear_lower_bound=None))
    assert ours.lower_bound is None
    _check_module_against_hf(hf, ours, [50, 3, 44], "softplus gate")


def test_module_matches_hf_other_sizes(mcore):
    text = _hf_text_dict(linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=3)
    hf, ours = _build_pair(text, kda_chunk_size=16)
    assert ours.q_conv1d.shape == (16, 1, 3) and ours.A_log.shape == (2,) and ours.dt_bias.shape == (16,)
    _check_module_against_hf(hf, ours, [1, 23, 40, 2], "2x8, W=3, C=16")


def test_module_batch_rows_are_documents(mcore):
    hf, ours = _build_pair(_hf_text_dict())
    x = torch.randn(2, 30, ours.hidden_size)  # HF layout [b, s, h]
    with torch.no_grad():
        out, _ = ours(x.transpose(0, 1).contiguous())
        ref = hf(x)
    assert rel_max(out.transpose(0, 1), ref) <= 1e-5


def test_module_init_dtype_and_sharded_state_dict(mcore):
    cfg = Glm5Config.from_hf({"text_config": _hf_text_dict()})
    m = KimiDeltaAttention(cfg, get_kda_module_spec().submodules, layer_number=1)
    # HF init of the forget gate: A_log = 0 with the bounded gate, dt_bias = inv-softplus of [1e-3, 1e-1]
    assert torch.all(m.A_log == 0)
    dt = F.softplus(m.dt_bias)
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 1e-1 * 1.001
    assert torch.all(m.o_norm.weight == 1)
    for name in ("q_conv1d", "k_conv1d", "v_conv1d", "A_log", "dt_bias"):
        p = getattr(m, name)
        assert p.keep_fp32 and p.tensor_model_parallel and p.partition_dim == 0
    m.bfloat16()
    assert m.q_proj.weight.dtype == torch.bfloat16 and m.o_norm.weight.dtype == torch.bfloat16
    for name in ("q_conv1d", "k_conv1d", "v_conv1d", "A_log", "dt_bias"):
        assert getattr(m, name).dtype == torch.float32, name
    out, _ = m(torch.randn(12, 2, cfg.hidden_size, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()

    sd = m.sharded_state_dict(prefix="layers.0.self_attn.")
    assert set(sd) >= {f"layers.0.self_attn.{n}" for n in ("q_conv1d", "A_log", "dt_bias", "q_proj.weight",
                                                           "f_a_proj.weight", "o_norm.weight", "o_proj.weight")}
    assert sd["layers.0.self_attn.q_conv1d"].global_shape == (cfg.kda_dim, 1, cfg.linear_conv_kernel_dim)
    assert sd["layers.0.self_attn.A_log"].global_shape == (cfg.linear_num_heads,)


# ============================================================================ tensor parallel (2 gloo ranks)
def _tp_worker(sequence_parallel):
    """This rank's ``{"out" | "x.grad" | parameter: relative difference}`` (run by :func:`tests.helpers.spawn`)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from transformers import Glm5NextTextConfig

    from megatron_glm5.initialize import initialize_megatron

    if not torch.cuda.is_available():  # a spawned process: the reference's CPU path as in the test process
        from conftest import _transformers_reference_on_cpu

        _transformers_reference_on_cpu()
    hf_mod = __import__(HF_MOD, fromlist=["Glm5NextTextLinearAttention"])
    initialize_megatron(tp=world, seed=1234)
    text = _hf_text_dict()
    torch.manual_seed(5)  # same on both ranks: identical HF weights
    hf = hf_mod.Glm5NextTextLinearAttention(Glm5NextTextConfig(**text), layer_idx=0).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if name.startswith("o_norm") else
                    torch.randn_like(p) * (0.5 if p.dim() == 1 else 0.4 / p.shape[-1] ** 0.5))
    cfg = Glm5Config.from_hf({"text_config": text}, tensor_model_parallel_size=world,
                             sequence_parallel=sequence_parallel)
    ours = KimiDeltaAttention(cfg, get_kda_module_spec().submodules, layer_number=1)
    assert ours.num_heads_local * world == ours.num_heads
    replicated = ("f_a_proj.weight", "g_a_proj.weight", "o_norm.weight")
    dims = {"o_proj.weight": 1}

    def shard(name, t):
        return t if name in replicated else t.chunk(world, dims.get(name, 0))[rank]

    full_sd = _hf_to_ours_state_dict(hf.state_dict())
    ours.load_state_dict({n: shard(n, t) for n, t in full_sd.items()}, strict=False)

    cu = torch.tensor([0, 30, 32, 64], dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 1, cfg.hidden_size, generator=gen)
    w = torch.randn(64, 1, cfg.hidden_size, generator=gen)
    xs = (x.chunk(world, 0)[rank] if sequence_parallel else x).clone().requires_grad_(True)
    ws = w.chunk(world, 0)[rank] if sequence_parallel else w
    out = ours(xs, packed_seq_params=make_packed_seq_params(cu))[0]
    (out * ws).sum().backward()

    xh = x.transpose(0, 1).clone().requires_grad_(True)
    ref = torch.cat([hf(xh[:, a:e]) for a, e in _docs(cu)], 1)
    (ref * w.transpose(0, 1)).sum().backward()
    ref, ref_gx = ref.detach().transpose(0, 1), xh.grad.transpose(0, 1)
    if sequence_parallel:
        ref, ref_gx = ref.chunk(world, 0)[rank], ref_gx.chunk(world, 0)[rank]
    errs = {"out": rel_max(out.detach(), ref), "x.grad": rel(xs.grad, ref_gx)}
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    hf_grads = _hf_to_ours_state_dict(hf_grads)
    for name, p in ours.named_parameters():
        errs[name] = rel(p.grad, shard(name, hf_grads[name]))
    return errs


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_matches_single_rank(sequence_parallel):
    results = dict(enumerate(spawn(_tp_worker, 2, sequence_parallel, timeout=120)))
    for rank, res in sorted(results.items()):
        assert isinstance(res, dict), res
        worst = max(res, key=res.get)
        print(f"TP=2 sp={sequence_parallel} rank {rank}: out {res['out']:.2e}, worst grad {worst} {res[worst]:.2e}")
        assert res["out"] <= 1e-5
        assert all(v <= 1e-4 for k, v in res.items() if k != "out"), res


# ============================================================================ FLA backend (GPU)
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_backend_matches_torch(mcore, dtype):
    """kda_backend='fla' against 'torch': output, input and parameter gradients on a packed row. fp32 at the tiny
    widths; bf16 at the released KDA widths (64 heads of 128), the shapes FLA's bf16 kernels are compiled and tuned
    for in training (see :func:`test_fla_fused_backend_matches_torch`)."""
    pytest.importorskip("triton")
    released = dict(hidden_size=256, linear_num_heads=64, linear_head_dim=128)
    text = _hf_text_dict(**(released if dtype == torch.bfloat16 else {}))
    cfg = Glm5Config.from_hf({"text_config": text}, kda_backend="torch")
    torch_mod = KimiDeltaAttention(cfg, get_kda_module_spec().submodules, layer_number=1).cuda()
    fla_mod = KimiDeltaAttention(cfg, get_kda_module_spec().submodules, layer_number=1).cuda()
    fla_mod.load_state_dict(torch_mod.state_dict())
    fla_mod.backend = "fla"
    with torch.no_grad():  # non-trivial gate parameters
        for m in (torch_mod, fla_mod):
            torch.manual_seed(0)
            m.A_log.normal_(0, 0.5)
            m.dt_bias.normal_(0, 1.0)
    torch_mod.to(dtype)
    fla_mod.to(dtype)
    cu = torch.tensor([0, 100, 101, 300, 512], dtype=torch.int32, device="cuda")
    x = torch.randn(512, 1, cfg.hidden_size, device="cuda", dtype=dtype)
    w = torch.randn_like(x)
    res = []
    for m in (torch_mod, fla_mod):
        xi = x.clone().requires_grad_(True)
        out = m(xi, packed_seq_params=make_packed_seq_params(cu))[0]
        (out.float() * w.float()).sum().backward()
        res.append((out.float(), xi.grad.float(), {n: p.grad.float() for n, p in m.named_parameters()}))
    # FLA's triton kernels use TF32 tensor-core dots for fp32 inputs: fp32 agreement is at TF32 level
    tol_out, tol_grad = (5e-3, 1e-2) if dtype == torch.float32 else (3e-2, 5e-2)
    assert rel_max(res[1][0], res[0][0]) < tol_out
    assert rel(res[1][1], res[0][1]) < tol_grad
    for n in res[0][2]:
        assert rel(res[1][2][n], res[0][2][n]) < tol_grad, n


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,lower_bound", [(torch.bfloat16, -5.0), (torch.bfloat16, None),
                                               (torch.float32, -5.0)], ids=["bf16-lb5", "bf16-softplus", "fp32-lb5"])
def test_fla_fused_backend_matches_torch(mcore, dtype, lower_bound):
    """kda_backend='fla_fused' (FLA conv + in-kernel gate / beta / l2norm + fused gated norm) against the 'torch'
    layer: output, input gradient and every parameter gradient (conv, A_log, dt_bias, norm weight included) on a
    packed row with a one-token document; bounded and softplus gates.

    The KDA widths are the released ones (64 heads of 128, FLA's tuned path; only the model width is small): FLA's
    kernels take the head count as a compile-time constant and autotune per head count, so these shapes reuse what
    a bf16 training run (or ``scripts/bench_train_step.py``) has compiled and tuned; other head counts make FLA
    compile and autotune its whole KDA kernel set again (minutes on the first run). The first case is the
    production setting (bf16, lower bound -5)."""
    pytest.importorskip("triton")
    text = _hf_text_dict(hidden_size=256, linear_num_heads=64, linear_head_dim=128, linear_lower_bound=lower_bound)
    cfg = Glm5Config.from_hf({"text_config": text}, kda_backend="torch")
    ref = KimiDeltaAttention(cfg, get_kda_module_spec().submodules, layer_number=1).cuda()
    fused = KimiDeltaAttention(cfg, get_kda_module_spec().submodules, layer_number=1).cuda()
    fused.load_state_dict(ref.state_dict())
    fused.backend = "fla_fused"
    with torch.no_grad():
        for m in (ref, fused):
            torch.manual_seed(0)
            m.A_log.normal_(0, 0.5)
            m.dt_bias.normal_(0, 1.0)
            m.o_norm.weight.normal_(1.0, 0.2)
    ref.to(dtype)
    fused.to(dtype)
    assert fused.A_log.dtype == torch.float32  # fp32 islands kept
    cu = torch.tensor([0, 100, 101, 300, 512], dtype=torch.int32, device="cuda")
    x = torch.randn(512, 1, cfg.hidden_size, device="cuda", dtype=dtype)
    w = torch.randn_like(x, dtype=torch.float32)
    res = []
    for m in (ref, fused):
        xi = x.clone().requires_grad_(True)
        out = m(xi, packed_seq_params=make_packed_seq_params(cu))[0]
        (out.float() * w).sum().backward()
        res.append((out.float(), xi.grad.float(), {n: p.grad.float() for n, p in m.named_parameters()}))
    tol_out, tol_grad = (5e-3, 1e-2) if dtype == torch.float32 else (3e-2, 5e-2)
    assert torch.isfinite(res[1][0]).all() and torch.isfinite(res[1][1]).all()
    print(f"fla_fused {dtype} lb={lower_bound}: out {rel_max(res[1][0], res[0][0]):.2e} "
          f"dx {rel(res[1][1], res[0][1]):.2e}")
    assert rel_max(res[1][0], res[0][0]) < tol_out
    assert rel(res[1][1], res[0][1]) < tol_grad
    for n in res[0][2]:
        assert torch.isfinite(res[1][2][n]).all(), n
        assert rel(res[1][2][n], res[0][2][n]) < tol_grad, n


def _fused_layer_variants(attr: str, values, **text_changes):
    """The bf16 'fla_fused' KDA layer on a packed row of 512 tokens, run once per value of the layer attribute
    ``attr``: ``{value: (output, input gradient, {parameter: gradient})}`` in fp32."""
    text = _hf_text_dict(hidden_size=256, linear_lower_bound=-5.0, **text_changes)
    cfg = Glm5Config.from_hf({"text_config": text}, kda_backend="fla_fused")
    layer = KimiDeltaAttention(cfg, get_kda_module_spec().submodules, layer_number=1).cuda().to(torch.bfloat16)
    cu = torch.tensor([0, 100, 101, 300, 512], dtype=torch.int32, device="cuda")
    x = torch.randn(512, 1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    w = torch.randn_like(x, dtype=torch.float32)
    res = {}
    for value in values:
        setattr(layer, attr, value)
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out = layer(xi, packed_seq_params=make_packed_seq_params(cu))[0]
        (out.float() * w).sum().backward()
        res[value] = (out.float(), xi.grad.float(), {n: p.grad.float() for n, p in layer.named_parameters()})
    return res


@pytest.mark.gpu
def test_fla_fused_saved_intermediates_match_recompute(mcore):
    """``kda_save_intermediates`` (FLA's ``disable_recompute``: the backward reads the forward's w, u, gated q / k,
    v_new and chunk states instead of recomputing them) gives the same output and gradients as recomputing them,
    bf16 at the released KDA widths on a packed row."""
    pytest.importorskip("triton")
    res = _fused_layer_variants("save_intermediates", (False, True), linear_num_heads=64, linear_head_dim=128)
    print(f"saved vs recomputed: out {rel_max(res[True][0], res[False][0]):.2e} "
          f"dx {rel(res[True][1], res[False][1]):.2e}")
    assert torch.equal(res[True][0], res[False][0])  # the forward is the same computation
    assert rel(res[True][1], res[False][1]) < 2e-3
    for n, g in res[False][2].items():
        assert torch.isfinite(res[True][2][n]).all(), n
        assert rel(res[True][2][n], g) < 2e-3, n


@pytest.mark.gpu
def test_fla_fused_conv_kernels_agree(mcore):
    """The 'fla_fused' KDA layer with ``kda_conv_kernel`` 'triton' (``kernels/short_conv.py``) and 'fla' on a
    packed bf16 row: the same output and gradients up to bf16 rounding."""
    pytest.importorskip("fla")
    res = _fused_layer_variants("conv_kernel_name", ("fla", "triton"), linear_num_heads=8, linear_head_dim=64)
    print(f"triton vs fla conv: out {rel_max(res['triton'][0], res['fla'][0]):.2e} "
          f"dx {rel(res['triton'][1], res['fla'][1]):.2e}")
    assert rel_max(res["triton"][0], res["fla"][0]) < 2e-2
    assert rel(res["triton"][1], res["fla"][1]) < 2e-2
    for n, g in res["fla"][2].items():
        assert rel(res["triton"][2][n], g) < 2e-2, n


def test_fla_tune_configs_env(monkeypatch):
    """GLM5_FLA_TUNE_CONFIGS: unset or 0 leaves FLA's autotuners alone (nothing imported); junk is a named error."""
    from megatron_glm5.kernels import fla_tuning

    monkeypatch.delenv(fla_tuning.ENV_VAR, raising=False)
    assert fla_tuning.limit_fla_autotuning_from_env() == 0
    monkeypatch.setenv(fla_tuning.ENV_VAR, "0")
    assert fla_tuning.limit_fla_autotuning_from_env() == 0
    for bad in ("four", "-1", "2.5"):
        monkeypatch.setenv(fla_tuning.ENV_VAR, bad)
        with pytest.raises(ValueError, match=fla_tuning.ENV_VAR):
            fla_tuning.limit_fla_autotuning_from_env()


@pytest.mark.gpu
def test_fla_autotuning_trim_gpu():
    """Trimming cuts every FLA autotuner with more than N configs to N; a second trim finds nothing left to cut.
    N = 1: the GPU lane has already trimmed every list to $GLM5_FLA_TUNE_CONFIGS (2) at collection."""
    from megatron_glm5.kernels.fla_tuning import limit_fla_autotuning

    assert limit_fla_autotuning(1) > 0
    assert limit_fla_autotuning(1) == 0
