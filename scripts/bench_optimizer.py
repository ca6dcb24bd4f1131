#!/usr/bin/env python
"""The training optimizer's step alone: megatron-core's distributed optimizer (bf16 model, fp32 master weights) over
``--params`` parameters, with its torch Adam fallback (no Transformer Engine / Apex) in torch's default foreach form,
with ``--torch-fused-adam`` (torch's fused kernel) and with ``--fused-optimizer-step`` (clip, Adam and the bf16
weight write in one kernel per main weight: ``training/fused_optimizer_step.py``).

    python scripts/bench_optimizer.py [--params 2e9] [--tensors 96] [--iters 5]

Built as Megatron-LM's trainer builds them (megatron-core's DDP with a contiguous grad buffer, its
``DistributedOptimizer`` from ``get_megatron_optimizer``) on a stand-in model: ``--tensors`` bf16 matrices holding
``--params`` values in all. The gradients are random (written into DDP's grad buffer); every timed step applies them.
Every step is clipped (``--clip-grad 1``; the random gradients' norm is far above it). Prints the median step time
of each form (the whole ``optimizer.step()``: gradient norm, clip, Adam, the copy into the bf16 weights) and the
fp32 master-weight traffic of the Adam update alone (it reads and writes the weight and both moments and reads the
gradient: 28 bytes a parameter) at that time, then the largest difference of each form's updated weights from the
foreach form's after the same steps (fp32 rounding: the same update in another order of operations). On a
machine without CUDA it runs a small size on the CPU (a smoke run of the script).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _stand_in_model(config, numel: int, tensors: int):
    import torch
    from megatron.core.transformer.module import MegatronModule

    cols = 1024
    rows = max(1, math.ceil(numel / tensors / cols))

    class StandIn(MegatronModule):
        def __init__(self):
            super().__init__(config=config)
            self.weights = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.randn(rows, cols) * 0.02) for _ in range(tensors)])

        def forward(self, x):  # never called
            return x

    return StandIn()


def _timed_steps(optimizer, model, iters: int, dev: str, seed: int) -> float:
    import torch

    times = []
    for i in range(iters + 1):
        gen = torch.Generator(device=dev).manual_seed(seed + i)
        for chunk in model:
            for buf in chunk.buffers:
                buf.grad_data.normal_(generator=gen)
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        ok, _, _ = optimizer.step()
        if dev == "cuda":
            torch.cuda.synchronize()
        assert ok, "the optimizer skipped its step"
        if i:  # the first step allocates the optimizer's state
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def _model_and_optimizer(module, config, form: str):
    """megatron-core DDP (contiguous fp32 grad buffer) around the bf16 ``module`` and its distributed Adam."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from megatron_glm5.training import fused_optimizer_step
    from megatron_glm5.training.optimizer import use_torch_fused_adam

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=Float16Module(config, module))]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95,
                        adam_eps=1e-8, clip_grad=1.0, bf16=True, params_dtype=module.weights[0].dtype,
                        use_distributed_optimizer=True), model)
    if form == "torch_fused":
        use_torch_fused_adam(optimizer)
    elif form == "fused_step":
        fused, refused = fused_optimizer_step.install(optimizer)
        assert fused and not refused, refused
    return model, optimizer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=2e9, help="parameters in all (CPU: at most 2e6)")
    p.add_argument("--tensors", type=int, default=96)
    p.add_argument("--iters", type=int, default=5)
    a = p.parse_args(argv)

    import torch
    from megatron.core.transformer import TransformerConfig

    from megatron_glm5.initialize import initialize_megatron

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    numel = int(a.params if dev == "cuda" else min(a.params, 2e6))
    initialize_megatron()
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=1, bf16=True,
                               params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    results, weights = {}, {}
    forms = (("foreach (torch default)", "foreach"), ("fused (--torch-fused-adam)", "torch_fused"),
             ("--fused-optimizer-step", "fused_step"))
    for name, form in forms:
        torch.manual_seed(0)
        model, optimizer = _model_and_optimizer(_stand_in_model(config, numel, a.tensors).to(dev), config, form)
        n = sum(p.numel() for p in model[0].parameters())
        t = _timed_steps(optimizer, model, a.iters, dev, seed=1)
        results[name] = t
        weights[name] = [p.detach().float().clone() for p in model[0].parameters()]
        print(f"{name:28s} {n / 1e9:6.3f}B parameters on {dev}: {1e3 * t:9.2f} ms/step  "
              f"({28 * n / t / 1e9:7.0f} GB/s of fp32 master-weight traffic)", flush=True)
        del optimizer, model
        if dev == "cuda":
            torch.cuda.empty_cache()
    base = forms[0][0]
    for name, _ in forms[1:]:
        diff = max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
                   for x, y in zip(weights[name], weights[base]))
        print(f"{name} / foreach step time: {results[name] / results[base]:.2f}; largest weight difference after "
              f"{a.iters + 1} steps: {diff:.1e} of the largest weight")
    return 0


if __name__ == "__main__":
    sys.exit(main())
