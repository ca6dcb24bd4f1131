"""Training and checkpoint combinations through ``pretrain_glm5_vlm.py`` (issue 51): bf16 without the distributed
optimizer saves and resumes bitwise (with and without the indexer warm-up), an HF checkpoint given to ``--load`` is
refused, a config whose heads do not divide the width trains, a resume of another model function is refused, a
warm-up whose every step was skipped fails, and a checkpoint without its manifest needs the flag that trusts it."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.training_harness import TINY, error_lines, read_dist_checkpoint, run

PROG = "pretrain_glm5_vlm.py: error: "


def _ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc


def _final(root, iteration):
    return read_dist_checkpoint(str(root / f"iter_{iteration:07d}"))


def _bitwise_equal(a, b):
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


# ---------------------------------------------------------------------------- bf16 without the distributed optimizer
BF16 = TINY + ["--mock-data", "--bf16", "--train-iters", "4"]
WARMUP = ["--dsa-indexer-loss-coeff", "1.0", "--dsa-indexer-warmup", "4"]


@pytest.mark.parametrize("extra", [[], WARMUP], ids=["plain", "indexer_warmup"])
def test_bf16_without_distributed_optimizer_saves_and_resumes_bitwise(tmp_path, extra):
    """--bf16 with megatron-core's (non-distributed) bf16 optimizer, whose fp32 islands sit in param groups of their
    own: the save at iteration 2 is written (fp32 main weights and Adam state of every trained parameter, the fp32
    islands' included) and the resume to iteration 4 ends bitwise where a straight run does. Under
    --dsa-indexer-warmup only the indexers train (an fp32 island among them)."""
    import shutil

    args = BF16 + extra
    straight = tmp_path / "straight"
    _ok(run(args + ["--save", str(straight), "--save-interval", "2"]))
    root = tmp_path / "cut"  # the straight run as if stopped after its save of iteration 2
    shutil.copytree(straight, root)
    shutil.rmtree(root / "iter_0000004")
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    two = _final(root, 2)
    assert any(k.startswith("optimizer.state.fp32_param.") for k in two)
    moments = [k for k in two if k.startswith("optimizer.state.exp_avg.")]
    assert any("attn_hc" in k or "compress_ape" in k for k in moments)  # an fp32 island's state is saved
    for key in moments:  # each state tensor has its own weight's shape
        assert two[key].shape == two[key.split("optimizer.state.exp_avg.", 1)[1]].shape, key
    _ok(run(args + ["--save", str(root), "--save-interval", "100", "--load", str(root)]))
    _bitwise_equal(_final(straight, 4), _final(root, 4))
