"""training/memory_report.py: the weights, gradient buffers and optimizer state of this rank's parameters, by
hand-counted bytes on a small module set, and the trainer's report line in place of Megatron-LM's GPT formula."""

import argparse

import pytest
import torch

from megatron_glm5.training.memory_report import rank_memory


def _modules():
    """A bf16 [3, 4] linear (fp32 main_grad), an fp32 [5] norm weight (fp32 main_grad), a frozen bf16 [7] weight,
    a bf16 [2, 2] expert-parallel weight (``allreduce = False``, fp32 main_grad) and the first linear again (a tied
    weight: counted once)."""
    lin = torch.nn.Linear(4, 3, bias=False).to(torch.bfloat16)
    lin.weight.main_grad = torch.zeros(3, 4)
    norm = torch.nn.Module()
    norm.weight = torch.nn.Parameter(torch.ones(5))
    norm.weight.main_grad = torch.zeros(5)
    frozen = torch.nn.Module()
    frozen.weight = torch.nn.Parameter(torch.ones(7, dtype=torch.bfloat16), requires_grad=False)
    expert = torch.nn.Module()
    expert.weight = torch.nn.Parameter(torch.ones(2, 2, dtype=torch.bfloat16))
    expert.weight.main_grad = torch.zeros(2, 2)
    expert.weight.allreduce = False
    return [torch.nn.ModuleList([lin, norm, frozen, expert]), torch.nn.ModuleList([lin])]


@pytest.mark.parametrize("optimizer,distributed,states", [("adam", False, 2), ("adam", True, 2), ("sgd", True, 1),
                                                           ("lion", False, 1)])
def test_bytes_of_each_kind_of_parameter(optimizer, distributed, states):
    """12 bf16 + 5 fp32 + 7 frozen bf16 + 4 expert-parallel bf16 parameters: weights 2*12 + 4*5 + 2*7 + 2*4 bytes;
    fp32 gradient buffers for the 21 trained; fp32 state per trained weight (master copy for the bf16 ones, the
    optimizer's moments), over DP 4 (expert-parallel ones over expert DP 2) with the distributed optimizer."""
    dp, edp = (4, 2) if distributed else (1, 1)
    mem = rank_memory(_modules(), optimizer, distributed, 4, 2, sgd_momentum=0.9)
    assert (mem.parameters, mem.expert_parallel_parameters, mem.frozen_parameters) == (28, 4, 7)
    assert mem.weight_bytes == 2 * 12 + 4 * 5 + 2 * 7 + 2 * 4
    assert mem.grad_bytes == 4 * (12 + 5 + 4)
    want = 12 * 4 * (states + 1) / dp + 5 * 4 * states / dp + 4 * 4 * (states + 1) / edp
    assert mem.optimizer_bytes == pytest.approx(want, rel=1e-12)
    assert mem.total_bytes == pytest.approx(mem.weight_bytes + mem.grad_bytes + want, rel=1e-12)


def test_unknown_optimizer_state_is_not_estimated():
    """An optimizer without a state count here (``soap``): no optimizer bytes, the rest counted."""
    mem = rank_memory(_modules(), "soap", True, 4, 2)
    assert mem.optimizer_bytes is None and mem.total_bytes == mem.weight_bytes + mem.grad_bytes > 0


def test_report_line(monkeypatch, capsys, mcore):
    """The trainer's hook prints this rank's count and bytes (``args`` as Megatron-LM passes them)."""
    from megatron_glm5.training import flops, memory_report

    monkeypatch.setattr(flops, "_MODEL_CHUNKS", _modules())
    args = argparse.Namespace(optimizer="adam", use_distributed_optimizer=False, sgd_momentum=0.9)
    total, activations, same = memory_report.report_theoretical_memory(args, num_microbatches=2, verbose=True)
    out = capsys.readouterr().out
    want = (66 + 84 + (12 * 12 + 5 * 8 + 4 * 12)) / (1024 * 1024)
    assert total == same == pytest.approx(want) and activations is None
    assert "Number of parameters on this rank in billions: 0.0000 (expert-parallel 0.0000, frozen 0.0000)" in out
    assert f"weight and optimizer={want:.2f} MB" in out and "activations not estimated" in out


def test_same_report_printed_once_and_cpu_memory_line(monkeypatch, capsys, mcore):
    """Megatron-LM asks after the first two iterations: the same figures print once (figures that change print
    again); on CPU the memory line is the process's peak resident memory, not CUDA's zeros."""
    import resource

    from megatron_glm5.training import flops, memory_report

    monkeypatch.setattr(flops, "_MODEL_CHUNKS", _modules())
    monkeypatch.setattr(memory_report, "_REPORTED", {"last": None})
    args = argparse.Namespace(optimizer="adam", use_distributed_optimizer=False, sgd_momentum=0.9)
    first = memory_report.report_theoretical_memory(args, num_microbatches=2, verbose=True)
    assert capsys.readouterr().out.count("Theoretical memory footprints") == 1
    assert memory_report.report_theoretical_memory(args, num_microbatches=2, verbose=True) == first
    assert capsys.readouterr().out == ""
    args.optimizer = "soap"  # (the tiny figures round to the same MB: the state text differs)
    memory_report.report_theoretical_memory(args, num_microbatches=2, verbose=True)
    assert "Theoretical memory footprints" in capsys.readouterr().out
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    memory_report.report_memory_cpu("(after 1 iterations)")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    line = capsys.readouterr().out.strip()
    peak = float(line.rsplit(": ", 1)[1])
    assert line.startswith("[Rank 0] (after 1 iterations) memory (MB) | process peak resident: ")
    assert 0 < before - 0.005 <= peak <= after + 0.005  # printed to 2 decimals
