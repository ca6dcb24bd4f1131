"""HF (BF16) -> tools/convert_hf_to_mcore.py -> tools/convert_mcore_to_hf.py -> HF is bit-exact."""

import os

import torch
from safetensors.torch import load_file



def _tensors(path):
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def test_bf16_round_trip_through_both_tools_is_bit_exact(tmp_path, mcore):
    from megatron_glm5.cli.convert_hf_to_mcore import main as to_mcore
    from megatron_glm5.cli.convert_mcore_to_hf import main as to_hf
    from megatron_glm5.cli.make_tiny_hf_checkpoint import write_checkpoint

    from megatron_glm5.config import tiny_hf_config

    src = write_checkpoint(str(tmp_path / "src"), tiny_hf_config(), fmt="bf16", mtp=True, seed=4, shard_mb=0.1)
    assert to_mcore(["--hf-dir", src, "--out", str(tmp_path / "mcore"), "--dtype", "bf16", "--no-progress"]) == 0
    assert to_hf(["--load", str(tmp_path / "mcore"), "--out", str(tmp_path / "back"), "--shard-mb", "0.2",
                  "--no-progress"]) == 0
    a, b = _tensors(src), _tensors(str(tmp_path / "back"))
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k
    assert any(".layers.4.eh_proj" in k for k in b)  # the MTP layer made the trip too
