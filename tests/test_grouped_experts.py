"""GroupedExperts (torch._grouped_mm) against megatron-core's SequentialMLP: same parameters, same keys, same
numbers (CPU fp32 through PyTorch's CPU grouped GEMM and through the fallback; GPU bf16)."""

import pytest
import torch

from megatron_glm5.config import Glm5Config, tiny_hf_config
from megatron_glm5.models.grouped_experts import GroupedExperts
from tests.helpers import rel


def _config(backend, **over):
    hf = tiny_hf_config(with_vision=False)
    hf["text_config"].update(over)
    return Glm5Config.from_hf(hf, moe_experts_backend=backend, use_cpu_initialization=True)


def _moe_pair(device="cpu", dtype=torch.float32, **over):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_glm5.models.layer_specs import get_moe_spec

    mods = []
    for backend in ("sequential", "grouped"):
        cfg = _config(backend, **over)
        torch.manual_seed(0)
        mods.append(build_module(get_moe_spec(cfg), config=cfg, layer_number=2).to(device=device, dtype=dtype))
    seq, grp = mods
    grp.load_state_dict(seq.state_dict())
    with torch.no_grad():  # a non-zero expert bias so routing is not trivially uniform
        for m in (seq, grp):
            m.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, m.router.expert_bias.numel()))
    assert isinstance(grp.experts, GroupedExperts) and not isinstance(seq.experts, GroupedExperts)
    return seq, grp


def _run(m, x, w):
    xi = x.clone().requires_grad_(True)
    out, _ = m(xi)
    (out.float() * w).sum().backward()
    return out.float(), xi.grad.float(), {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}


def test_same_parameters_and_checkpoint_keys(mcore):
    seq, grp = _moe_pair()
    assert list(seq.state_dict()) == list(grp.state_dict())
    assert sorted(seq.sharded_state_dict(prefix="mlp.")) == sorted(grp.sharded_state_dict(prefix="mlp."))
    grp_sd = grp.sharded_state_dict(prefix="mlp.")
    for k, v in seq.sharded_state_dict(prefix="mlp.").items():
        g = grp_sd[k]
        assert type(v) is type(g) and v.key == g.key, k
        if hasattr(v, "global_shape"):
            assert (v.global_shape, v.global_offset) == (g.global_shape, g.global_offset), k


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU test: megatron's router moves a CPU weight to the GPU "
                                                      "where there is one (it failed on the H200)")
@pytest.mark.parametrize("force_grouped", [True, False])
def test_grouped_matches_sequential_cpu(mcore, force_grouped):
    """fp32 on CPU: the grouped arithmetic (torch._grouped_mm's CPU kernel) and the fallback both equal the
    per-expert loop, forward and every gradient. Tokens are few, so some experts get no token (empty groups)."""
    if force_grouped and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm missing")
    seq, grp = _moe_pair()
    grp.experts.plan = grp.experts.plan.replace(grouped_experts_on_cpu=force_grouped)
    torch.manual_seed(1)
    s = 7  # 7 tokens x top-2 over 8 experts
    x = torch.randn(s, 1, seq.config.hidden_size)
    w = torch.randn(s, 1, seq.config.hidden_size)
    out_s, dx_s, g_s = _run(seq, x, w)
    out_g, dx_g, g_g = _run(grp, x, w)
    counts = torch.bincount(seq.router(x.view(s, -1))[1].nonzero()[:, 1], minlength=8)
    assert (counts == 0).any(), counts  # empty groups covered
    assert rel(out_g, out_s) < 1e-6
    assert rel(dx_g, dx_s) < 1e-6
    assert g_s.keys() == g_g.keys()
    for n in g_s:
        assert rel(g_g[n], g_s[n]) < 1e-6, n


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU test: megatron's router moves a CPU weight to the GPU "
                                                      "where there is one (it failed on the H200)")
@pytest.mark.parametrize("layout", ["back_to_back", "split"])
def test_grouped_weight_gradients_go_into_main_grad_cpu(mcore, layout):
    """Gradient-accumulation fusion on the experts' linears, every expert weight carrying a ``main_grad`` and
    ``grad_added_to_main_grad`` (megatron DDP's contract), grouped path on CPU: over two micro batches the grouped
    GEMMs add their weight gradients into main_grads laid out back to back (as the distributed optimizer's expert
    layout places them) equal to the unfused run's summed ``.grad`` (1e-6), and mark the weights
    ``grad_added_to_main_grad``; main_grads that are separate tensors keep autograd's path (``.grad`` the sum,
    main_grad untouched). The other parameters' gradients and the input's equal the unfused run's either way; the
    start-up line (`describe_fusion`) counts the expert linears as fused or as falling back accordingly (and as fused
    where the tokens take the per-expert loop, whose linears add into main_grad themselves)."""
    _, grp = _moe_pair()
    grp.experts.plan = grp.experts.plan.replace(grouped_experts_on_cpu=True)
    torch.manual_seed(3)
    s, h = 9, grp.config.hidden_size
    batches = [(torch.randn(s, 1, h), torch.randn(s, 1, h)) for _ in range(2)]
    linears = [getattr(e, name) for e in grp.experts.local_experts for name in ("linear_fc1", "linear_fc2")]
    experts = {id(lin.weight) for lin in linears}

    def two_micro_batches():
        dx = []
        for x, w in batches:
            xi = x.clone().requires_grad_(True)
            (grp(xi)[0] * w).sum().backward()
            dx.append(xi.grad)
        return dx

    dx_ref = two_micro_batches()
    ref = {n: p.grad.clone() for n, p in grp.named_parameters()}
    grp.zero_grad(set_to_none=True)
    for lin in linears:
        lin.gradient_accumulation_fusion = True
    buffers = []
    for weights in grp.experts.expert_weight_sets():
        buf = torch.zeros(len(weights), *weights[0].shape)
        buffers.append(buf)
        for e, wt in enumerate(weights):
            wt.main_grad = buf[e] if layout == "back_to_back" else torch.zeros_like(buf[e])
            wt.grad_added_to_main_grad = False
    dx = two_micro_batches()
    assert all(rel(a, b) < 1e-6 for a, b in zip(dx, dx_ref))
    for n, p in grp.named_parameters():
        if id(p) not in experts:
            assert rel(p.grad, ref[n]) < 1e-6, n
        elif layout == "back_to_back":
            assert p.grad_added_to_main_grad and rel(p.main_grad, ref[n]) < 1e-6, n
        else:
            assert not p.grad_added_to_main_grad and not p.main_grad.any() and rel(p.grad, ref[n]) < 1e-6, n
    assert all(buf.abs().sum() > 0 for buf in buffers) == (layout == "back_to_back")
    from megatron_glm5.mcore_extensions import describe_fusion

    others = [m for m in grp.modules() if hasattr(m, "gradient_accumulation_fusion") and m not in linears]
    assert others and not any(m.gradient_accumulation_fusion for m in others)  # the shared expert's
    fused = len(linears) if layout == "back_to_back" else 0
    fallback = "" if layout == "back_to_back" else f" ({len(linears)} routed-expert linears: their main_grads are not"
    assert describe_fusion([grp]).startswith(
        f"gradient-accumulation fusion: {fused} linears add their weight gradient into main_grad in the GEMM, "
        f"{len(linears) + len(others) - fused} through DDP's hook{fallback}"), describe_fusion([grp])
    grp.experts.plan = grp.experts.plan.replace(grouped_experts_on_cpu=False)  # the per-expert loop: linears fuse
    assert describe_fusion([grp]) == (f"gradient-accumulation fusion: {len(linears)} linears add their weight "
                                      f"gradient into main_grad in the GEMM, {len(others)} through DDP's hook")


@pytest.mark.gpu
def test_grouped_matches_sequential_gpu_bf16(mcore):
    """bf16 on the GPU: torch._grouped_mm against the per-expert loop (both bf16 GEMMs with fp32 accumulation)."""
    seq, grp = _moe_pair(device="cuda", dtype=torch.bfloat16, hidden_size=256, moe_intermediate_size=128,
                         n_routed_experts=16, num_experts_per_tok=4)
    torch.manual_seed(2)
    s = 1000
    x = torch.randn(s, 1, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(s, 1, 256, device="cuda")
    out_s, dx_s, g_s = _run(seq, x, w)
    out_g, dx_g, g_g = _run(grp, x, w)
    from megatron_glm5.models.grouped_experts import stacked_weights

    for ws in grp.experts.expert_weight_sets():  # packed again after .to(cuda, bf16): the GEMMs read them in place
        assert stacked_weights(ws).data_ptr() == ws[0].data_ptr()
    assert torch.isfinite(out_g).all() and torch.isfinite(dx_g).all()
    assert rel(out_g, out_s) < 1e-2
    assert rel(dx_g, dx_s) < 1e-2
    for n in g_s:
        assert torch.isfinite(g_g[n]).all(), n
        assert rel(g_g[n], g_s[n]) < 2e-2, n


@pytest.mark.gpu
@pytest.mark.parametrize("limit,offset,dtype", [(10.0, 0.0, torch.bfloat16), (None, 0.0, torch.float32),
                                                (1.5, 0.5, torch.float32)])
def test_fused_clamped_swiglu_matches_reference_gpu(limit, offset, dtype):
    """The Triton clamped SwiGLU (kernels/glu.py) against grouped_glu's PyTorch ops: output and the gradients of
    y1 and the probabilities, ragged sizes, values on both sides of the clamp (fp32: to rounding; bf16: against an
    fp32 run of the reference, no worse than the bf16 reference plus rounding)."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from megatron_glm5.kernels.glu import clamped_swiglu
    from megatron_glm5.models.grouped_experts import grouped_glu

    gen = torch.Generator().manual_seed(7 + int(offset * 10))
    R, F = 333, 200
    y1 = (torch.randn(R, 2 * F, generator=gen) * 4).to(dtype).cuda()
    probs = torch.rand(R, generator=gen).cuda()
    g = torch.randn(R, F, generator=gen).cuda()
    cfg = SimpleNamespace(activation_func_clamp_value=limit, activation_func=torch.nn.functional.silu,
                          glu_linear_offset=offset)

    def run(fn, run_dtype):
        y = y1.to(run_dtype).clone().requires_grad_(True)
        p = probs.clone().requires_grad_(True)
        out = fn(y, p)
        assert out.dtype == run_dtype
        (out.float() * g).sum().backward()
        return out.float(), y.grad.float(), p.grad.float()

    fused = run(lambda y, p: clamped_swiglu(y, p, limit, offset), dtype)
    ref = run(lambda y, p: grouped_glu(y, p, cfg), dtype)
    exact = run(lambda y, p: grouped_glu(y, p, cfg), torch.float32)
    for name, o, r, e in zip(("out", "d_y1", "d_probs"), fused, ref, exact):
        assert torch.isfinite(o).all(), name
        err, err_ref = rel(o, e), rel(r, e)
        print(f"glu {dtype} limit={limit} {name}: fused {err:.1e} (torch {err_ref:.1e})")
        assert err < (2e-6 if dtype == torch.float32 else err_ref * 1.5 + 2e-3), (name, err, err_ref)


def test_stacked_weights_alias_the_packed_storage(mcore):
    """The experts' weights are packed back to back (also after a dtype cast), so the grouped GEMM's stacked view is
    the parameters' own memory; its gradient reaches every expert's ``.grad`` as ``torch.stack``'s does. Weights
    not packed (a re-homed one) give the copy, with the same numbers."""
    from megatron_glm5.models.grouped_experts import stacked_weights

    _, grp = _moe_pair()
    for dtype in (torch.float32, torch.float64):
        grp = grp.to(dtype)
        for ws in grp.experts.expert_weight_sets():
            assert ws[0].dtype == dtype
            view = stacked_weights(ws)
            assert view.data_ptr() == ws[0].data_ptr()
            assert torch.equal(view, torch.stack(ws))
            g = torch.randn_like(view)
            (view * g).sum().backward()
            for e, w in enumerate(ws):
                assert torch.equal(w.grad, g[e])
                w.grad = None
    ws = grp.experts.expert_weight_sets()[0]
    before = torch.stack(ws).detach().clone()
    ws[3].data = ws[3].data.clone()  # re-homed: the stack copies again
    view = stacked_weights(ws)
    assert view.data_ptr() != ws[0].data_ptr() and torch.equal(view, before)
    grp.experts.pack_expert_weights()
    assert stacked_weights(ws).data_ptr() == ws[0].data_ptr() and torch.equal(torch.stack(ws), before)


def test_packed_weights_load_and_save_their_own_values(mcore):
    """Loading a state dict into packed weights keeps them packed and gives each expert its own values; the state
    dict's tensors hold each expert's values (the packing changes no key and no number)."""
    seq, grp = _moe_pair()
    with torch.no_grad():
        for p in seq.parameters():
            p.add_(torch.randn_like(p))
    grp.load_state_dict(seq.state_dict())
    ws = grp.experts.expert_weight_sets()[1]
    assert ws[1].data_ptr() == ws[0].data_ptr() + ws[0].nbytes
    sd_seq, sd_grp = seq.state_dict(), grp.state_dict()
    assert list(sd_seq) == list(sd_grp)
    for k in sd_seq:
        if isinstance(sd_seq[k], torch.Tensor):
            assert torch.equal(sd_seq[k], sd_grp[k]), k


@pytest.mark.parametrize("expert_order", [True, False])
def test_packed_experts_keep_their_alias_under_megatron_ddp(mcore, expert_order):
    """The expert weights stay back-to-back slices of one storage once megatron's DDP has moved every parameter into
    its buffer (placed by the distributed optimizer's layout, as pretrain_glm5_vlm.py runs with --bf16), so
    ``stacked_weights`` hands the grouped GEMM a view, not a copy; megatron-core's own layout (reverse module order:
    each expert's fc2 next to its fc1) splits them. The values are the model's either way."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_glm5.models.builder import build_model
    from megatron_glm5.models.grouped_experts import _stacked_alias, install_expert_buffer_layout

    install_expert_buffer_layout()
    layout_fn = DistributedOptimizer.compute_full_param_layout
    if not expert_order:
        layout_fn = layout_fn.wrapped  # megatron-core's own
    cfg = Glm5Config.from_hf(tiny_hf_config(with_vision=False), moe_experts_backend="grouped", bf16=True,
                             use_cpu_initialization=True)
    torch.manual_seed(0)
    model = build_model(cfg).bfloat16()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert experts and all(_stacked_alias([e.linear_fc1.weight for e in g.local_experts]) is not None
                           for g in experts)  # packed at construction
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    layout = layout_fn([p for p in model.parameters() if p.requires_grad], None, 1, ddp_config,
                       expert_data_parallel_world_size=1)
    ddp = DistributedDataParallel(config=cfg, module=model, ddp_config=ddp_config, full_param_layout=layout)
    aliased = [_stacked_alias([getattr(e, name).weight for e in g.local_experts]) is not None
               for g in ddp.module.modules() if isinstance(g, GroupedExperts) for name in ("linear_fc1", "linear_fc2")]
    assert len(aliased) == 2 * len(experts)
    assert all(aliased) if expert_order else not any(aliased)
    for n, p in ddp.module.named_parameters():
        assert torch.equal(p, before[n]), n


def _ddp_expert_main_grads(fusion: bool, state: dict) -> tuple:
    """The tiny text model (grouped experts on CPU, weights ``state``; empty: a fresh model's, written into it) in
    megatron-core's DDP with the distributed optimizer's buffer layout (``install_expert_buffer_layout``'s expert
    order), fp32, two micro batches: ``({name: main_grad}, {expert weight name: grad_added_to_main_grad})``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_glm5 import mcore_extensions as ext
    from megatron_glm5.models.builder import build_model
    from megatron_glm5.models.grouped_experts import install_expert_buffer_layout

    ext.install()
    install_expert_buffer_layout()
    cfg = Glm5Config.from_hf(tiny_hf_config(num_layers=2, with_vision=False), use_cpu_initialization=True,
                             moe_experts_backend="grouped", gradient_accumulation_fusion=fusion)
    model = build_model(cfg)
    if state:
        model.load_state_dict(state)
    else:
        state.update({k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)})
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert experts
    for m in experts:
        m.plan = m.plan.replace(grouped_experts_on_cpu=True)
    ddp = DistributedDataParallel(config=cfg, module=model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True))
    ddp.zero_grad_buffer()
    gen = torch.Generator().manual_seed(6)
    for _ in range(2):
        ids = torch.randint(1, cfg.vocab_size, (1, 16), generator=gen)
        ddp(ids, labels=torch.roll(ids, -1, dims=1)).sum().backward()
    names = {id(w): n for n, w in ddp.module.named_parameters()}
    flags = {names[id(w)]: w.grad_added_to_main_grad
             for m in experts for ws in m.expert_weight_sets() for w in ws}
    return {n: p.main_grad.clone() for n, p in ddp.module.named_parameters() if p.requires_grad}, flags


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU test: megatron's router moves a CPU weight to the GPU "
                                                      "where there is one (it failed on the H200)")
def test_model_expert_weight_gradients_go_into_the_ddp_buffer_cpu(mcore):
    """The whole tiny model in megatron-core's DDP with the distributed optimizer's layout, grouped experts on CPU,
    two micro batches: with gradient-accumulation fusion every grouped GEMM finds its experts' main_grads back to
    back in DDP's buffer and adds into them (each expert weight marked ``grad_added_to_main_grad``, so DDP's hook
    adds nothing), and every parameter's main_grad equals the unfused run's (1e-5)."""
    state = {}
    ref, ref_flags = _ddp_expert_main_grads(False, state)
    got, flags = _ddp_expert_main_grads(True, state)
    assert flags and all(flags.values()) and not any(ref_flags.values()), (flags, ref_flags)
    assert set(got) == set(ref)
    bad = [n for n in ref if not torch.allclose(got[n], ref[n], rtol=1e-5, atol=1e-7)]
    assert not bad, bad[:5]
    assert all(ref[n].abs().sum() > 0 for n in flags)
