"""Loading HF GLM-5.3 checkpoints on one process: sharded index, FP8, MTP, fp32 islands, and failures with lists."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file


from megatron_glm5.checkpoint.fp8 import dequantize_fp8_blockwise  # noqa: E402
from megatron_glm5.checkpoint.hf_io import CheckpointMismatchError, load_hf_checkpoint  # noqa: E402
from megatron_glm5.checkpoint.hf_keys import canonical_name, mcore_to_hf  # noqa: E402
from megatron_glm5.config import Glm5Config, tiny_hf_config  # noqa: E402


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from megatron_glm5.cli.make_tiny_hf_checkpoint import write_checkpoint

    root = tmp_path_factory.mktemp("ckpts")
    hf = tiny_hf_config()
    return {
        "fp32": write_checkpoint(str(root / "fp32"), hf, fmt="fp32", seed=5),
        "sharded": write_checkpoint(str(root / "sharded"), hf, fmt="fp32", seed=5, shard_mb=0.05),
        "fp8_mtp": write_checkpoint(str(root / "fp8_mtp"), hf, fmt="fp8", mtp=True, seed=5),
    }


def _all_tensors(path):
    out = {}
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def _build(path, **kw):
    from megatron_glm5.models.builder import build_model

    cfg = Glm5Config.from_hf(path, use_cpu_initialization=True, perform_initialization=False, **kw)
    return build_model(cfg, parallel_output=False)


def _copy_ckpt(src, dst, mutate):
    os.makedirs(dst)
    sd = _all_tensors(src)
    mutate(sd)
    save_file(sd, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as fh:
        cfg = json.load(fh)
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return dst


def test_every_parameter_comes_from_its_key(ckpts, mcore):
    m = _build(ckpts["fp32"])
    load_hf_checkpoint(m, ckpts["fp32"])
    sd = _all_tensors(ckpts["fp32"])
    for local, t in m.state_dict().items():
        if local.endswith(("local_tokens_per_expert", "_extra_state")):
            continue
        names = mcore_to_hf(canonical_name(local, m), m.config.num_layers)
        ref = torch.cat([sd[n] for n in names], 0) if len(names) > 1 else sd[names[0]]
        assert torch.equal(t, ref), local


def test_sharded_index_equals_single_file(ckpts, mcore):
    assert os.path.exists(os.path.join(ckpts["sharded"], "model.safetensors.index.json"))
    a, b = _build(ckpts["fp32"]), _build(ckpts["sharded"])
    load_hf_checkpoint(a, ckpts["fp32"])
    load_hf_checkpoint(b, ckpts["sharded"])
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        if torch.is_tensor(x):
            assert torch.equal(x, y), k


def test_fp8_checkpoint_dequantised_and_mtp_loaded(ckpts, mcore):
    path = ckpts["fp8_mtp"]
    raw = _all_tensors(path)
    fp8_keys = [k for k, v in raw.items() if v.dtype == torch.float8_e4m3fn]
    assert any("experts.0.gate_proj" in k for k in fp8_keys) and any("q_a_proj" in k for k in fp8_keys)
    assert not any("self_attn.o_proj" in k and ".layers.0." in k for k in fp8_keys)  # KDA o_proj stays BF16
    m = _build(path)
    assert m.config.mtp_num_layers == 1
    load_hf_checkpoint(m, path)
    sd = dict(m.state_dict())
    n = m.config.num_layers
    key = "model.language_model.layers.1.mlp.experts.3.down_proj.weight"
    expect = dequantize_fp8_blockwise(raw[key], raw[key + "_scale_inv"], out_dtype=torch.float32)
    assert torch.equal(sd["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"], expect)
    assert torch.equal(sd["mtp.layers.0.eh_proj.weight"], raw[f"model.language_model.layers.{n}.eh_proj.weight"].float())
    assert torch.equal(sd["mtp.layers.0.final_layernorm.weight"],
                       raw[f"model.language_model.layers.{n}.shared_head.norm.weight"].float())


def test_mtp_weights_skipped_when_config_has_no_mtp(ckpts, mcore):
    m = _build(ckpts["fp8_mtp"], mtp_num_layers=None)
    report = load_hf_checkpoint(m, ckpts["fp8_mtp"])
    assert report["skipped"] and all(".layers.4." in k for k in report["skipped"])


def test_fp32_islands_survive_bf16(ckpts, mcore):
    m = _build(ckpts["fp32"])
    load_hf_checkpoint(m, ckpts["fp32"])
    m.to_dtype(torch.bfloat16)
    dtypes = {k: p.dtype for k, p in m.named_parameters()}
    for suffix in ("attn_hc.base", "attn_hc.scale", "ffn_hc.base", "ffn_hc.scale", "self_attention.A_log",
                   "self_attention.dt_bias", "self_attention.q_conv1d", "mlp.router.weight",
                   "indexer.index_kpool_compress_ape"):
        hits = [k for k in dtypes if k.endswith(suffix)]
        assert hits, suffix
        assert all(dtypes[k] == torch.float32 for k in hits), suffix
    assert dtypes["decoder.layers.1.self_attention.q_b_proj.weight"] == torch.bfloat16
    assert m.decoder.layers[1].mlp.router.expert_bias.dtype == torch.float32


def test_missing_unexpected_and_mismatched_keys_are_listed(ckpts, tmp_path, mcore):
    src = ckpts["fp32"]
    lm = "model.language_model."

    def drop(sd):
        del sd[lm + "layers.0.self_attn.q_proj.weight"]
        del sd[lm + "layers.1.mlp.experts.2.up_proj.weight"]

    def extra(sd):
        sd[lm + "layers.0.self_attn.bogus.weight"] = torch.zeros(2)

    def reshape(sd):
        sd[lm + "norm.weight"] = torch.ones(3)

    for name, mutate, needles in [
        ("drop", drop, ["missing keys (2)", "layers.0.self_attn.q_proj.weight", "layers.1.mlp.experts.2.up_proj.weight"]),
        ("extra", extra, ["unexpected keys (1)", "layers.0.self_attn.bogus.weight"]),
        ("reshape", reshape, ["shape mismatches (1)", "norm.weight"]),
    ]:
        path = _copy_ckpt(src, str(tmp_path / name), mutate)
        with pytest.raises(CheckpointMismatchError) as e:
            load_hf_checkpoint(_build(path), path)
        for needle in needles:
            assert needle in str(e.value), (name, str(e.value)[:300])


def test_fp8_nan_after_dequantisation_is_fatal(ckpts, tmp_path, mcore):
    def poison(sd):
        k = [k for k in sd if k.endswith("weight_scale_inv")][0]
        sd[k] = torch.full_like(sd[k], float("nan"))

    path = _copy_ckpt(ckpts["fp8_mtp"], str(tmp_path / "nan"), poison)
    with pytest.raises(CheckpointMismatchError, match="NaN/inf"):
        load_hf_checkpoint(_build(path), path)
