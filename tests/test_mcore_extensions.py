"""megatron_glm5.mcore_extensions: the torch versions of the Apex / Transformer Engine calls megatron-core makes,
against plain per-tensor arithmetic, and megatron-core's linear with gradient-accumulation fusion against autograd's
weight gradient added to ``main_grad``."""

import pytest
import torch

from megatron_glm5 import mcore_extensions as ext


def _tensors(dtypes=(torch.float32, torch.float32, torch.bfloat16)):
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (13,), (3, 4, 2)]
    return [torch.randn(s, generator=gen).to(d) for s, d in zip(shapes, dtypes)]


def test_l2norm_is_the_norm_of_all_tensors_together():
    tensors = _tensors()
    total, per = ext.multi_tensor_l2norm(2048, torch.zeros(1, dtype=torch.int), [tensors], True)
    flat = torch.cat([t.double().flatten() for t in tensors])
    assert total.shape == (1,) and total.dtype == torch.float32
    assert abs(total.item() - flat.norm().item()) <= 1e-6 * flat.norm().item()
    assert torch.allclose(per.double(), torch.stack([t.double().norm() for t in tensors]), rtol=1e-6)
    empty, none = ext.multi_tensor_l2norm(2048, torch.zeros(1, dtype=torch.int), [[]], False)
    assert empty.tolist() == [0.0] and none is None


def test_scale_in_place_and_into_other_tensors():
    src = _tensors()
    want = [t * 0.25 for t in src]
    ext.multi_tensor_scale(2048, None, [src, src], 0.25)
    assert all(torch.equal(a, b) for a, b in zip(src, want))
    dst = [torch.zeros_like(t, dtype=torch.bfloat16) for t in src]
    ext.multi_tensor_scale(2048, None, [src, dst], 2.0)
    assert all(torch.equal(d, (s * 2.0).to(torch.bfloat16)) for s, d in zip(src, dst))
    ext.multi_tensor_scale(2048, None, [src, dst], 1.0)
    assert all(torch.equal(d, s.to(torch.bfloat16)) for s, d in zip(src, dst))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wgrad_accumulates_into_fp32_main_grad(dtype):
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(24, 6, generator=gen).to(dtype), torch.randn(24, 5, generator=gen).to(dtype)
    main_grad = torch.randn(5, 6, generator=gen)
    want = main_grad.double() + g.double().t() @ x.double()
    ext.wgrad_gemm_accum(x, g, main_grad)
    assert main_grad.dtype == torch.float32
    assert (main_grad.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_install_points_megatron_core_at_them():
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer
    from megatron.core.tensor_parallel import layers

    ext.install()  # idempotent: conftest's install_patches already ran it
    assert clip_grads.l2_norm_impl is ext.multi_tensor_l2norm
    assert clip_grads.multi_tensor_scale_impl is ext.multi_tensor_scale
    assert mcore_optimizer.multi_tensor_scale_impl is ext.multi_tensor_scale
    assert layers._grad_accum_fusion_available and layers.fused_weight_gradient_mlp_cuda is ext.FusedWeightGradientMlp


def test_grad_norm_and_clipping_through_megatron_core(mcore):
    """megatron-core's get_grad_norm_fp32 / clip_grad_by_total_norm_fp32 on these functions give the norm of all
    gradients and scale them by max_norm / norm."""
    from megatron.core import parallel_state
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32

    params = [torch.nn.Parameter(t.float()) for t in _tensors()]
    for p, g in zip(params, _tensors()):
        p.grad = g.float() * 3
    want = torch.cat([p.grad.double().flatten() for p in params]).norm().item()
    norm = get_grad_norm_fp32([p.grad for p in params], grad_stats_parallel_group=parallel_state.get_model_parallel_group())
    assert abs(norm - want) <= 1e-6 * want
    before = [p.grad.clone() for p in params]
    clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=norm)
    assert all(torch.allclose(p.grad, b * (1.0 / (norm + 1e-6)), rtol=1e-6) for p, b in zip(params, before))


def test_fused_linear_backward_accumulates_into_main_grad():
    """megatron-core's linear with gradient_accumulation_fusion on (as in the trainer on CUDA) adds the weight
    gradient of two micro-batches to main_grad and leaves the dgrad as autograd's."""
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

    gen = torch.Generator().manual_seed(2)
    weight = torch.nn.Parameter(torch.randn(5, 6, generator=gen))
    weight.main_grad = torch.zeros(5, 6)
    xs = [torch.randn(4, 3, 6, generator=gen, requires_grad=True) for _ in range(2)]
    for x in xs:
        y = linear_with_grad_accumulation_and_async_allreduce(x, weight, None, gradient_accumulation_fusion=True,
                                                              allreduce_dgrad=False, sequence_parallel=False)
        (y * y).sum().backward()
    ref_w = torch.nn.Parameter(weight.detach().clone())
    ref_xs = [x.detach().clone().requires_grad_(True) for x in xs]
    for x in ref_xs:
        (torch.nn.functional.linear(x, ref_w) ** 2).sum().backward()
    assert torch.allclose(weight.main_grad, ref_w.grad, rtol=1e-5, atol=1e-6)
    assert all(torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-7) for a, b in zip(xs, ref_xs))


def _ddp_main_grads(fusion: bool, tied: bool, state: dict, zero_out_wgrad=None) -> tuple:
    """The tiny text model with its MTP layer (``tie_word_embeddings`` per ``tied``, weights ``state``; empty: a
    fresh model's, written into it) in megatron-core's DDP, fp32, two micro batches: ``({name: main_grad}, the word
    embedding's zero_out_wgrad)``. ``zero_out_wgrad``: set it on the word embedding before the steps (None: as the
    model leaves it)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_glm5.config import Glm5Config, tiny_hf_config
    from megatron_glm5.models.builder import build_model

    ext.install()
    hf = tiny_hf_config(num_layers=2, with_vision=False, mtp=True)
    hf["tie_word_embeddings"] = tied
    cfg = Glm5Config.from_hf(hf, use_cpu_initialization=True, gradient_accumulation_fusion=fusion)
    model = build_model(cfg)
    if state:
        model.load_state_dict(state)
    else:
        state.update({k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)})
    ddp = DistributedDataParallel(config=cfg, module=model,
                                  ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    weight = ddp.module.embedding.word_embeddings.weight
    if zero_out_wgrad is not None:
        weight.zero_out_wgrad = zero_out_wgrad
    ddp.zero_grad_buffer()
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        ids = torch.randint(1, cfg.vocab_size, (2, 12), generator=gen)
        ddp(ids, labels=torch.roll(ids, -1, dims=1)).sum().backward()
    return ({n: p.main_grad.clone() for n, p in ddp.module.named_parameters() if p.requires_grad},
            getattr(weight, "zero_out_wgrad", None))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_model_main_grads_with_the_fusion_equal_those_without(mcore, tied):
    """The whole model under DDP (its MTP layer reuses the word embedding; ``tied``: so does the output layer): with
    gradient-accumulation fusion every parameter's ``main_grad`` equals the unfused run's. megatron-core marks the
    shared embedding weight ``zero_out_wgrad`` (DDP's hook then adds its ``.grad``); every use adds into main_grad
    here, so the model clears the flag. Set again, the fused embedding hands zeros and the sums still hold."""
    state = {}
    ref, flag_ref = _ddp_main_grads(fusion=False, tied=tied, state=state)
    assert flag_ref is True  # megatron-core's marking of the shared weight (the unfused run keeps it)
    for zero_out in (None, True):
        got, flag = _ddp_main_grads(fusion=True, tied=tied, state=state, zero_out_wgrad=zero_out)
        assert flag is (zero_out is True)
        assert set(got) == set(ref)
        bad = [n for n in ref if not torch.allclose(got[n], ref[n], rtol=1e-5, atol=1e-7)]
        assert not bad, (zero_out, bad[:5])
        assert ref["embedding.word_embeddings.weight"].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_wgrad_bf16_on_cuda_is_one_fp32_gemm_in_place_gpu():
    """bf16 inputs on CUDA: main_grad += g^T x with fp32 accumulation and output, in place (same storage)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(4096, 1024, device="cuda", generator=gen).bfloat16()
    g = torch.randn(4096, 768, device="cuda", generator=gen).bfloat16()
    main_grad = torch.randn(768, 1024, device="cuda", generator=gen)
    ptr = main_grad.data_ptr()
    want = main_grad.double() + g.double().t() @ x.double()
    ext.wgrad_gemm_accum(x, g, main_grad)
    assert main_grad.data_ptr() == ptr
    err = (main_grad.double() - want).abs().max().item() / want.abs().max().item()
    assert err <= 1e-5, err  # fp32 accumulation (a bf16 output would be ~4e-3)


def test_graphed_parts_keep_the_fusion_and_the_start_up_line_counts_the_linears():
    """A GraphedModule leaves its parts' fusion flags as they are (the captured backward adds into main_grad through
    the parameter views' ``main_grad``); ``fusion_off`` (its warm-up's gradient check) turns them off within its
    block only; the start-up line counts fused and unfused linears."""
    from megatron_glm5.models.cuda_graphs import GraphedModule, fusion_off

    def linear(fused):
        lin = torch.nn.Linear(4, 4, bias=False)
        lin.gradient_accumulation_fusion = fused
        return lin

    layer = torch.nn.Module()
    layer.attn, layer.mlp = torch.nn.Sequential(linear(True), linear(False)), torch.nn.Sequential(linear(True))
    flags = lambda: [m.gradient_accumulation_fusion for m in layer.modules()  # noqa: E731
                     if hasattr(m, "gradient_accumulation_fusion")]
    GraphedModule(layer, lambda x: layer.mlp(x), parts=("mlp",))
    assert flags() == [True, False, True]
    with fusion_off([layer.mlp]):
        assert flags() == [True, False, False]
    assert flags() == [True, False, True]
    assert ext.describe_fusion([layer]) == ("gradient-accumulation fusion: 2 linears add their weight gradient into "
                                            "main_grad in the GEMM, 1 through DDP's hook")


def test_parameter_views_of_a_graph_carry_main_grad():
    """The views a captured graph takes gradients of carry their parameter's ``main_grad`` (the same tensor) and
    ``zero_out_wgrad``, with ``grad_added_to_main_grad`` starting False whatever the parameter's flag."""
    from megatron_glm5.models.cuda_graphs import aliased_parameters

    lin = torch.nn.Linear(3, 2, bias=True)
    main_grad = torch.zeros(2, 3)
    lin.weight.main_grad, lin.weight.grad_added_to_main_grad, lin.weight.zero_out_wgrad = main_grad, True, True
    with aliased_parameters(lin, [lin.weight, lin.bias]) as (w, b):
        assert lin.weight is w and w.main_grad is main_grad
        assert w.data_ptr() == lin.weight.data_ptr() and w.grad_added_to_main_grad is False and w.zero_out_wgrad
        assert not hasattr(b, "main_grad") and not hasattr(b, "grad_added_to_main_grad")
    assert isinstance(lin.weight, torch.nn.Parameter) and lin.weight.grad_added_to_main_grad is True


def test_embedding_gradient_goes_into_main_grad(mcore):
    """The word embedding under the fusion: two micro batches' rows (repeated ids included) are added to main_grad
    in fp32, equal to autograd's dense gradient; the forward is megatron-core's."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    from megatron_glm5.config import tiny_config
    from megatron_glm5.models.embedding_grad import FusedGradVocabEmbedding, fuse_embedding_grad

    cfg = tiny_config()
    emb = VocabParallelEmbedding(50, 8, init_method=torch.nn.init.normal_, config=cfg,
                                 tp_group=parallel_state.get_tensor_model_parallel_group())
    ref = torch.nn.Parameter(emb.weight.detach().clone())
    fuse_embedding_grad(emb)
    assert isinstance(emb, FusedGradVocabEmbedding) and list(emb.state_dict()) == ["weight"]
    emb.weight.main_grad, emb.weight.grad_added_to_main_grad = torch.zeros(50, 8), False
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, 50, (2, 9), generator=gen) for _ in range(2)]
    batches[0][0, :3] = 7  # a row used several times
    for ids in batches:
        out = emb(ids)
        assert torch.equal(out, torch.nn.functional.embedding(ids, ref))
        (out ** 2).sum().backward()
        (torch.nn.functional.embedding(ids, ref) ** 2).sum().backward()
    assert emb.weight.grad_added_to_main_grad
    assert torch.allclose(emb.weight.main_grad, ref.grad, rtol=1e-6, atol=1e-7)
