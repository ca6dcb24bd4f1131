"""The shared test helpers (tests/helpers.py, the log readers of tests/training_harness.py) and the tiers that
tests/conftest.py gives the tests."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests import helpers
from tests.training_harness import log_iterations, saved_iteration

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# two lines as Megatron-LM's training_log prints them (column padding and all), and a line that is not one
MEGATRON_LOG = (
    " [2026-12-05 21:49:16.973222] iteration        4/      20 | consumed samples:           16 | elapsed time per "
    "iteration (ms): 812.5 | learning rate: 1.000000E-06 | global batch size:     4 | lm loss: 6.012345E+00 | "
    "indexer loss: 2.500000E-01 | loss scale: 1.0 | grad norm: 13.745 | number of skipped iterations:   1 | "
    "number of nan iterations:   0 |\n"
    "some other line: 1 | 2\n"
    " [2026-12-05 21:49:17.973222] iteration       12/      20 | consumed samples:           48 | lm loss: "
    "5.5E+00 |\n"
)


def test_rel_and_rel_max_values():
    b = torch.tensor([3.0, 4.0])
    a = torch.tensor([3.0, 4.5])
    assert helpers.rel(a, b) == pytest.approx(0.5 / 5.0, rel=1e-12)
    assert helpers.rel_max(a, b) == pytest.approx(0.5 / 4.0, rel=1e-12)
    assert helpers.rel(b, b) == 0.0 and helpers.rel_max(b, b) == 0.0
    zero = torch.zeros(3)
    assert helpers.rel_max(zero, zero) == 0.0 and helpers.rel_max(torch.ones(3), zero) == float("inf")
    assert helpers.rel(zero, zero) == 0.0
    # fp64 arithmetic on 16-bit inputs: the difference of two bf16 values is not rounded to bf16
    x = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    y = torch.tensor([1.0078125, 2.0], dtype=torch.bfloat16)
    assert helpers.rel(y, x) == pytest.approx(0.0078125 / 5 ** 0.5, rel=1e-12)


def test_log_iterations_reads_the_values_whatever_the_padding():
    lines = log_iterations(MEGATRON_LOG)
    assert [it["iteration"] for it in lines] == [4, 12] and lines[0]["train iters"] == 20
    first = lines[0]
    assert first["consumed samples"] == 16 and first["lm loss"] == 6.012345 and first["indexer loss"] == 0.25
    assert first["learning rate"] == 1e-6 and first["number of skipped iterations"] == 1
    assert first["elapsed time per iteration (ms)"] == 812.5 and first["global batch size"] == 4
    assert lines[1] == {"iteration": 12, "train iters": 20, "consumed samples": 48.0, "lm loss": 5.5}


def test_saved_iteration():
    assert saved_iteration("  successfully saved checkpoint from iteration       4 to ckpt [ t 1/1, p 1/1 ]") == 4
    assert saved_iteration("successfully saved checkpoint from iteration 40 to x") == 40
    assert saved_iteration("saving checkpoint at iteration       4 to ckpt") is None


@pytest.mark.parametrize("worker", ["gw0", "gw1", "gw7"])
def test_free_port_stays_in_the_worker_range(monkeypatch, worker):
    """Each xdist worker takes ports from its own range, below the kernel's ephemeral ports; the ports are free."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setattr(helpers, "_port_cycle", None)
    index = int(worker[2:])
    lo = helpers._PORT_BASE + index * helpers._PORT_SPAN
    ports = [helpers.free_port() for _ in range(5)]
    assert all(lo <= p < lo + helpers._PORT_SPAN for p in ports), ports
    assert len(set(ports)) == 5 and lo + helpers._PORT_SPAN <= 32768


def _rank_and_world(offset):
    return int(os.environ["RANK"]) + offset, int(os.environ["WORLD_SIZE"])


def _rank_fails():
    if os.environ["RANK"] == "1":
        raise ValueError("rank one refuses")
    return 0


def test_spawn_returns_in_rank_order_and_reports_a_failing_rank():
    assert helpers.spawn(_rank_and_world, 2, 10, timeout=300) == [(10, 2), (11, 2)]
    with pytest.raises(RuntimeError, match="rank 1 failed:(.|\n)*ValueError: rank one refuses"):
        helpers.spawn(_rank_fails, 2, timeout=300)


COLLECT_TIERS = """
import json, sys
import pytest

class Tiers:
    def pytest_collection_finish(self, session):
        self.got = {i.nodeid: [m.name for m in i.iter_markers() if m.name in TIERS] for i in session.items}

TIERS = ("unit", "numerics", "distributed", "e2e", "gpu")
plugin = Tiers()
assert pytest.main(["--collect-only", "-q", "-p", "no:xdist", *sys.argv[1:]], plugins=[plugin]) == 0
print(json.dumps(plugin.got))
"""


def test_tiers_of_known_tests():
    """The tier conftest.py gives tests of each kind, and every test gets exactly one tier."""
    want = {
        "tests/test_rms_norm.py::test_rms_norm_matches_hf_cpu": "numerics",   # a module against transformers
        "tests/test_context_parallel.py::test_modules_cp_equal_whole_row": "distributed",  # helpers.spawn
        "tests/test_kpool_dsa.py::test_tensor_parallel_2_matches_hf": "distributed",  # mp.start_processes
        "tests/test_helpers.py::test_saved_iteration": "unit",
        "tests/test_parallel_training.py::test_layout_that_does_not_divide_is_refused": "e2e",  # training_harness.run
        "tests/test_pool_mass.py::test_kernels_equal_the_pytorch_target_on_the_interpreter": "e2e",  # a module fixture
        "tests/test_kda.py::test_fla_backend_matches_torch": "gpu",
    }
    proc = subprocess.run([sys.executable, "-c", COLLECT_TIERS, *sorted({k.split("::")[0] for k in want})],
                          cwd=REPO, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(got) > 100 and all(len(tiers) == 1 for tiers in got.values()), got
    tiers = {nodeid.split("[", 1)[0]: tiers[0] for nodeid, tiers in got.items()}
    assert {k: tiers.get(k) for k in want} == want
