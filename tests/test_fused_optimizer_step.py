"""The fused optimizer step (``training/fused_optimizer_step.py``): megatron-core's distributed optimizer on torch's
AdamW with the clip coefficient, the Adam update and the model-weight write in one pass per main weight, against
megatron-core's own step (CPU: the PyTorch reference of ``kernels/adam.py``, bitwise torch's single-tensor Adam)."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5.config import Glm5Config, tiny_hf_config


def _train(fused: bool, state: dict, steps: int = 3, clip: float = 0.05) -> dict:
    """The tiny text model in bf16 under megatron-core's DDP and distributed optimizer (torch AdamW, weight decay
    0.1, ``--clip-grad`` ``clip``: every step clipped), ``steps`` steps of one row; weights ``state`` (empty: a fresh
    model's, written into it). Returns the model weights, the fp32 main weights, Adam's moments and step counters,
    the gradient norms, each step's main gradients as the optimizer left them and the optimizer's class."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_glm5.models.builder import build_model
    from megatron_glm5.training import fused_optimizer_step
    from megatron_glm5.training.optimizer import optimizer_parts

    cfg = Glm5Config.from_hf(tiny_hf_config(num_layers=2, with_vision=False), use_cpu_initialization=True, bf16=True,
                             params_dtype=torch.bfloat16)
    model = build_model(cfg).bfloat16()
    if state:
        model.load_state_dict(state)
    else:
        state.update({k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)})
    ddp = DistributedDataParallel(config=cfg, module=model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True))
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, bf16=True,
                                                 clip_grad=clip, use_distributed_optimizer=True), [ddp])
    if fused:
        assert fused_optimizer_step.install(opt) == (len([g for part in optimizer_parts(opt)
                                                          for g in part.optimizer.param_groups]), [])
    gen = torch.Generator().manual_seed(3)
    norms, grads = [], []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ids = torch.randint(1, cfg.vocab_size, (1, 16), generator=gen)
        ddp(ids, labels=torch.roll(ids, -1, dims=1)).float().mean().backward()
        ddp.finish_grad_sync()
        ok, norm, _ = opt.step()
        assert ok
        norms.append(norm)
        grads.append([b.grad_data.clone() for buf in ddp.buffers for b in buf.buckets])
    inners = [part.optimizer for part in optimizer_parts(opt)]
    mains = [p for inner in inners for g in inner.param_groups for p in g["params"]]
    return dict(model={n: p.detach().clone() for n, p in ddp.module.named_parameters()},
                main=[p.detach().clone() for p in mains], norms=norms, grads=grads,
                moments=[inner.state[p][k].clone() for inner in inners for g in inner.param_groups
                         for p in g["params"] for k in ("exp_avg", "exp_avg_sq")],
                steps=[float(inner.state[p]["step"]) for inner in inners for g in inner.param_groups
                       for p in g["params"]],
                classes={type(inner).__name__ for inner in inners})


def test_fused_step_equals_megatron_cores_step_cpu(mcore):
    """Three clipped steps (gradient norms ~3 against ``--clip-grad`` 0.05) of megatron-core's distributed optimizer
    on torch AdamW, with and without the fused step: the same gradient norms, bf16 model weights, fp32 main weights,
    Adam moments and step counters bitwise. The fused run leaves the main gradients unscaled (the clip became the
    step's factor: each step's gradients are the unfused run's divided by its clip coefficient, to fp32 rounding),
    and its model weights are its main weights rounded to bf16 (written by the step, not copied after it)."""
    state = {}
    ref = _train(False, state)
    got = _train(True, state)
    assert ref["classes"] == {"AdamW"} and got["classes"] == {"FusedStepAdamW"}
    assert got["norms"] == ref["norms"] and min(ref["norms"]) > 10 * 0.05, ref["norms"]
    assert got["model"].keys() == ref["model"].keys()
    assert [n for n in ref["model"] if not torch.equal(got["model"][n], ref["model"][n])] == []
    assert all(torch.equal(a, b) for a, b in zip(got["main"], ref["main"])) and len(got["main"]) == len(ref["main"])
    assert all(torch.equal(a, b) for a, b in zip(got["moments"], ref["moments"]))
    assert got["steps"] == ref["steps"] == [3.0] * len(ref["steps"])
    for norm, g_fused, g_ref in zip(ref["norms"], got["grads"], ref["grads"]):
        coeff = 0.05 / (norm + 1e-6)
        for a, b in zip(g_fused, g_ref):
            assert torch.allclose(a * coeff, b, rtol=1e-6, atol=0), (norm, (a * coeff - b).abs().max())
            assert not torch.equal(a, b)
    assert any(p.dtype == torch.bfloat16 for p in got["model"].values())


def test_fused_step_leaves_unfit_optimizers_alone(mcore):
    """``install`` names why it leaves an optimizer as it was: megatron-core's non-distributed mixed-precision
    optimizer, an amsgrad Adam; nothing of them changes (class, copy method)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_glm5.models.builder import build_model
    from megatron_glm5.training import fused_optimizer_step
    from megatron_glm5.training.optimizer import optimizer_parts

    cfg = Glm5Config.from_hf(tiny_hf_config(num_layers=1, with_vision=False), use_cpu_initialization=True, bf16=True,
                             params_dtype=torch.bfloat16)
    for distributed, amsgrad, phrase in ((False, False, "not the distributed optimizer"),
                                         (True, True, "amsgrad")):
        model = build_model(cfg).bfloat16()
        ddp = DistributedDataParallel(config=cfg, module=model, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=distributed))
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True,
                                                     use_distributed_optimizer=distributed), [ddp])
        parts = optimizer_parts(opt)
        for part in parts:
            for g in part.optimizer.param_groups:
                g["amsgrad"] = amsgrad
        copies = [part._copy_main_params_to_model_params for part in parts]
        fused, refused = fused_optimizer_step.install(opt)
        assert fused == 0 and refused and all(phrase in r for r in refused), refused
        assert all(type(part.optimizer) in (torch.optim.Adam, torch.optim.AdamW) for part in parts)
        assert [part._copy_main_params_to_model_params for part in parts] == copies


@pytest.mark.parametrize("decoupled", [True, False])
def test_reference_is_torchs_single_tensor_adam(decoupled):
    """``adam_step_reference`` over four steps (grad_scale 0.25, weight decay 0.1, betas 0.8 / 0.95: the lerp's two
    forms at beta1 0.8 and 0.3) equals torch's single-tensor Adam / AdamW on the gradients pre-multiplied by the
    scale, bitwise (weights, moments); its 16-bit ``out`` is the weight rounded."""
    from megatron_glm5.kernels.adam import AdamScalars, adam_step_reference

    for beta1 in (0.8, 0.3):
        gen = torch.Generator().manual_seed(1)
        w0 = torch.randn(37, generator=gen)
        ref = torch.nn.Parameter(w0.clone())
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        opt = cls([ref], lr=1e-2, betas=(beta1, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
        w, m, v = w0.clone(), torch.zeros(37), torch.zeros(37)
        out = torch.empty(37, dtype=torch.bfloat16)
        for step in range(1, 5):
            g = torch.randn(37, generator=gen)
            ref.grad = g * 0.25
            opt.step()
            adam_step_reference(w, g, m, v, AdamScalars(lr=1e-2, beta1=beta1, beta2=0.95, eps=1e-8, weight_decay=0.1,
                                                        decoupled=decoupled, step=step, grad_scale=0.25), out)
        st = opt.state[ref]
        assert torch.equal(w, ref.detach()) and torch.equal(m, st["exp_avg"]) and torch.equal(v, st["exp_avg_sq"])
        assert torch.equal(out, w.bfloat16())


@pytest.mark.gpu
def test_kernel_matches_reference_and_torch_fused_adamw_gpu():
    """The Triton kernel on CUDA over 3 x 2^20 + 17 elements (a partial last block), four steps of AdamW (decay 0.1,
    grad_scale 0.3, random starting moments): weights and moments within fp32 rounding (1e-6 relative) of the
    PyTorch reference and of torch's fused AdamW on the pre-scaled gradients; the bf16 ``out`` is the updated weight
    rounded to nearest, bitwise; the gradient unchanged."""
    from megatron_glm5.kernels.adam import AdamScalars, _launch, adam_step_reference, kernel_applies

    gen = torch.Generator(device="cuda").manual_seed(5)
    n = 3 * 2 ** 20 + 17
    w0 = torch.randn(n, device="cuda", generator=gen)
    m0, v0 = torch.randn(n, device="cuda", generator=gen) * 0.1, torch.rand(n, device="cuda", generator=gen) * 0.01
    got, ref = [w0.clone(), m0.clone(), v0.clone()], [w0.clone(), m0.clone(), v0.clone()]
    torch_w = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([torch_w], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    opt.state[torch_w].update(step=torch.tensor(0.0, device="cuda"), exp_avg=m0.clone(), exp_avg_sq=v0.clone())
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    for step in range(1, 5):
        g = torch.randn(n, device="cuda", generator=gen)
        g0 = g.clone()
        s = AdamScalars(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True, step=step,
                        grad_scale=0.3)
        assert kernel_applies(got[0], g, got[1], got[2], out)
        _launch(got[0], g, got[1], got[2], s, out)
        assert torch.equal(g, g0)
        adam_step_reference(ref[0], g, ref[1], ref[2], s)
        torch_w.grad = g * 0.3
        opt.step()
    st = opt.state[torch_w]
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (a - b).abs().max()
    for a, b in zip(got, (torch_w.detach(), st["exp_avg"], st["exp_avg_sq"])):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (a - b).abs().max()
    assert torch.equal(out, got[0].bfloat16())


def test_a_checkpoint_of_one_form_loads_into_the_other_without_switching_it():
    """Optimizer state saved by torch's fused Adam (``use_torch_fused_adam``: groups ``fused=True``, device step
    counters) and by the fused step (host counters, groups neither fused nor foreach), each loaded into the other:
    the loading optimizer keeps its own form (a checkpoint's param groups would otherwise replace the flags) and
    steps on from the saved counter (2 after one more step); the weights it reaches equal those of the form that saved
    it stepping on (the two forms' arithmetic agrees to fp32 rounding)."""
    from megatron_glm5.training.fused_optimizer_step import fused_step
    from megatron_glm5.training.optimizer import use_torch_fused_adam

    class Part:
        def __init__(self, inner):
            self.optimizer = inner

    def make(form):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(6))
        opt = torch.optim.AdamW([w], lr=1e-2, weight_decay=0.1)
        if form == "torch_fused":
            assert use_torch_fused_adam(Part(opt)) == 1
        else:
            fused_step(opt)
        w.grad = torch.linspace(-1, 1, 6)
        opt.step()
        return w, opt

    for saver, loader in (("torch_fused", "fused_step"), ("fused_step", "torch_fused")):
        _, saved = make(saver)
        w_on, opt_on = make(saver)
        w, opt = make(loader)
        with torch.no_grad():
            w.copy_(w_on)
        opt.load_state_dict(saved.state_dict())
        group = opt.param_groups[0]
        assert (group["fused"], group["foreach"]) == ((True, False) if loader == "torch_fused" else (False, False))
        for ww, oo in ((w, opt), (w_on, opt_on)):
            ww.grad = torch.linspace(1, -1, 6)
            oo.step()
        assert float(opt.state[w]["step"]) == 2.0 and opt.state[w]["step"].device == w.device
        assert torch.allclose(w, w_on, rtol=1e-6, atol=1e-7), (saver, loader, (w - w_on).abs().max())


@pytest.mark.parametrize("extra, flag", [
    (["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16"], "--use-precision-aware-optimizer"),
    (["--use-precision-aware-optimizer", "--optimizer-cpu-offload"], "--optimizer-cpu-offload"),
    (["--use-megatron-fsdp"], "--use-megatron-fsdp"),
])
def test_optimizer_levers_without_their_backend_are_one_line(capsys, extra, flag):
    """Without Transformer Engine (16-bit optimizer state) or CUDA (megatron-core's HybridDeviceOptimizer and
    Megatron-FSDP) the levers are refused in one line naming the flag, exit 2."""
    import torch

    from megatron_glm5.training.arguments import _have_te_fused_adam, parse_args

    if flag == "--use-precision-aware-optimizer" and _have_te_fused_adam():
        pytest.skip("Transformer Engine's FusedAdam is installed")
    if flag in ("--optimizer-cpu-offload", "--use-megatron-fsdp") and torch.cuda.is_available():
        pytest.skip("CUDA is available")
    base = ["--model-preset", "glm5-tiny", "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "2",
            "--lr", "1e-3", "--eval-iters", "0", "--mock-data", "--use-distributed-optimizer"]
    with pytest.raises(SystemExit) as exc:
        parse_args(base + extra, world_size=2, prog="pretrain_glm5_vlm.py")
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert exc.value.code == 2
    assert len(err) == 1 and err[0].startswith("pretrain_glm5_vlm.py: error:") and flag in err[0], err
