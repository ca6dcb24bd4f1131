"""scripts/bench_train_step.py --trainer: reading Megatron-LM's log of a pretrain_glm5_vlm.py run (CPU)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from bench_train_step import kernel_table, parse_trainer_log, trainer_command  # noqa: E402

def _line(it: int, ms: float, tflops: float, loss: float) -> str:
    """One of Megatron-LM's per-interval log lines (the fields the parser reads, in its order and format)."""
    return (f" [2026-12-05 21:49:16.973222] iteration {it:8d}/      20 | consumed samples: {it:12d} | elapsed time per "
            f"iteration (ms): {ms:.1f} | throughput per GPU (TFLOP/s/GPU): {tflops:.1f} | learning rate: "
            f"1.000000E-06 | global batch size:     1 | lm loss: {loss:.6E} | grad norm: 13.745 |\n")


def _memory(it: int, peak_mb: float) -> str:
    return (f"[Rank 0] (after {it} iterations) memory (MB) | allocated: 53525.29 | max allocated: {peak_mb:.2f} | "
            f"reserved: 58214.00 | max reserved: 58214.00\n")


# a trainer's log at 4K on an H100, --log-interval 5: iteration 1 alone, then every 5
_LOG = (_line(1, 232453.2, 0.2, 12.78614) + _memory(1, 53525.29) + _line(5, 46656.5, 0.9, 12.73626)
        + _memory(5, 61632.86) + _line(10, 196.4, 224.2, 12.47994) + _line(15, 194.6, 226.3, 12.06499)
        + _line(20, 200.9, 219.2, 11.36068) + "MoE CUDA graphs: 4 layers, 80 replays, 0 eager calls\n")


def test_trainer_log_leaves_the_warm_up_intervals_out():
    rec = parse_trainer_log(_LOG, log_interval=5)
    assert [r[0] for r in rec["intervals"]] == [1, 5, 10, 15, 20]
    assert rec["seconds"] == pytest.approx((196.4 + 194.6 + 200.9) / 3 / 1e3)
    assert rec["tflops"] == pytest.approx((224.2 + 226.3 + 219.2) / 3)
    assert rec["loss"] == pytest.approx(11.36068) and rec["first_loss"] == pytest.approx(12.78614)
    assert rec["peak_gib"] == pytest.approx(61632.86 / 1024)
    # a run of one logged interval: that interval, warm-up and all
    short = _line(1, 232453.2, 0.2, 12.78614) + _line(5, 46656.5, 0.9, 12.73626)
    assert parse_trainer_log(short, log_interval=5)["seconds"] == pytest.approx(46.6565)


def test_trainer_log_without_iterations_is_an_error():
    with pytest.raises(ValueError, match="elapsed time per iteration"):
        parse_trainer_log("Traceback (most recent call last):\n  torch.OutOfMemoryError: CUDA out of memory\n", 10)


def test_trainer_command_is_the_users_run():
    cmd = trainer_command("cfg.json", 4096, 30, 10, recompute=True, extra=["--no-moe-cuda-graph"])
    assert cmd[1].endswith("pretrain_glm5_vlm.py")
    joined = " ".join(cmd)
    for part in ("--hf-config cfg.json", "--mock-data", "--seq-length 4096", "--train-iters 30", "--log-interval 10",
                 "--use-distributed-optimizer", "--recompute-granularity full"):
        assert part in joined, part
    assert cmd[-1] == "--no-moe-cuda-graph"


def test_kernel_table_counts_busy_time_and_totals_per_step():
    # two steps; kernel "b" overlaps "a" by 500 us, so busy = 2000 + 1500 + 1000 us over 2 steps
    ev = [{"ph": "X", "cat": "kernel", "name": "a", "ts": 0.0, "dur": 2000.0},
          {"ph": "X", "cat": "kernel", "name": "b", "ts": 1500.0, "dur": 2000.0},
          {"ph": "X", "cat": "kernel", "name": "a", "ts": 10000.0, "dur": 1000.0},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 50000.0}]
    lines = kernel_table({"traceEvents": ev}, steps=2).splitlines()
    assert lines[0] == "per step: window 5.50 ms, GPU busy 2.25 ms, kernel time 2.50 ms in 2 kernels"
    assert lines[2].split() == ["1.500", "1", "60.0%", "a"]
    assert lines[3].split() == ["1.000", "0", "40.0%", "b"]
