"""The environment the README's two commands leave runs an exported checkpoint in transformers on CPU: the test run
finds FLA on its own path (``MEGATRON_GLM5_TEST_SITE``, set by scripts/run_tests.sh), the environment does not, so
transformers' Glm5Next takes its PyTorch KDA there instead of FLA's Triton kernels (which need a GPU driver)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

TEST_SITE = os.environ.get("MEGATRON_GLM5_TEST_SITE")

_FORWARD = """
import sys, importlib.util, torch
from transformers import AutoModelForImageTextToText
assert importlib.util.find_spec("fla") is None, "flash-linear-attention is importable in the environment"
model = AutoModelForImageTextToText.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ids = torch.arange(3, 27).reshape(2, 12) % model.config.text_config.vocab_size
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, sys.argv[2])
"""


@pytest.mark.skipif(TEST_SITE is None, reason="scripts/run_tests.sh keeps FLA out of the environment (it sets "
                                              "MEGATRON_GLM5_TEST_SITE)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs FLA's kernels in transformers")
def test_the_environment_runs_an_exported_checkpoint_in_transformers_on_cpu(tmp_path):
    from transformers import AutoModelForImageTextToText

    from megatron_glm5.cli.make_tiny_hf_checkpoint import write_checkpoint
    from megatron_glm5.config import tiny_hf_config

    ckpt = write_checkpoint(str(tmp_path / "hf"), tiny_hf_config(), fmt="bf16", seed=3)
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) !=
            os.path.abspath(TEST_SITE)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    out = tmp_path / "logits.pt"
    proc = subprocess.run([sys.executable, "-c", _FORWARD, ckpt, str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the same forward here, where conftest gives transformers' Glm5Next its PyTorch KDA (FLA is importable)
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.arange(3, 27).reshape(2, 12) % model.config.text_config.vocab_size
    with torch.no_grad():
        want = model(input_ids=ids).logits
    got = torch.load(out)
    assert got.shape == want.shape
    assert torch.equal(got, want)
