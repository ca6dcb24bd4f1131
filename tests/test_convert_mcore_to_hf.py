"""Exporting a megatron-core torch_dist checkpoint to HF: bit-exact BF16 round trip, transformers logits, FP8,
the reusable reader, a save root or a checkpoint folder as --load, the tokenizer / chat template / processor files
carried HF -> converter -> exporter (or taken from --hf-assets) so that transformers' Auto classes load the export
offline, and bad input (one error line, exit 2, no output)."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TOOL = os.path.join(ROOT, "tools", "convert_mcore_to_hf.py")

from megatron_glm5.checkpoint.fp8 import FP8_DTYPE, dequantize_fp8_blockwise, is_fp8_in_release  # noqa: E402
from megatron_glm5.checkpoint.hf_keys import is_fp32_island_hf  # noqa: E402
from megatron_glm5.config import tiny_hf_config  # noqa: E402

SHARD_MB = 0.25


def _tensors(path):
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as fh:
                for k in fh.keys():
                    out[k] = fh.get_tensor(k)
    return out


def _bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _no_leftovers(parent):
    return [f for f in os.listdir(parent) if ".tmp-" in f or ".old-" in f]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, mcore):
    """HF bf16 source (with MTP) -> bf16 megatron model -> megatron's own dist_checkpointing.save, in a training
    save's layout: "save" (tracker naming 6) / "mcore" (= save/iter_0000006, with hf_config.json)."""
    from megatron_glm5.cli.make_tiny_hf_checkpoint import write_checkpoint
    from megatron.core import dist_checkpointing

    from megatron_glm5.models.builder import build_model_from_hf

    root = tmp_path_factory.mktemp("mcore_export")
    src = write_checkpoint(str(root / "hf_src"), tiny_hf_config(), fmt="bf16", mtp=True, seed=11)
    model = build_model_from_hf(src, dtype=torch.bfloat16)
    assert model.config.mtp_num_layers == 1
    mc = root / "save" / "iter_0000006"
    mc.mkdir(parents=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(mc))
    (root / "save" / "latest_checkpointed_iteration.txt").write_text("6")
    with open(mc / "hf_config.json", "w") as fh:
        json.dump(model.config.to_hf_dict(), fh)
    del model
    return {"root": root, "src": src, "mcore": str(mc), "save": str(root / "save")}


@pytest.fixture(scope="module")
def exported(ckpts):
    from megatron_glm5.cli.convert_mcore_to_hf import main

    out = str(ckpts["root"] / "hf_bf16")  # from the save root: its tracker names iter_0000006
    assert main(["--load", ckpts["save"], "--out", out, "--shard-mb", str(SHARD_MB), "--no-progress"]) == 0
    return out


@pytest.fixture(scope="module")
def exported_fp8(ckpts):
    from megatron_glm5.cli.convert_mcore_to_hf import main

    out = str(ckpts["root"] / "hf_fp8")
    assert main(["--load", ckpts["mcore"], "--out", out, "--fp8", "--no-progress"]) == 0
    return out


# ------------------------------------------------------------------------------------------------ BF16
def test_bf16_round_trip_is_bit_exact(ckpts, exported):
    src, got = _tensors(ckpts["src"]), _tensors(exported)
    assert set(got) == set(src)
    for k, v in src.items():
        assert got[k].dtype == v.dtype, k
        assert got[k].shape == v.shape, k
        assert torch.equal(_bits(got[k]), _bits(v)), k
    assert {k for k, v in got.items() if v.dtype == torch.float32} == {k for k in got if is_fp32_island_hf(k)}
    assert any(".layers.4.eh_proj" in k for k in got)  # the MTP layer, as layers.{num_layers}


def test_index_config_and_shards(ckpts, exported):
    files = sorted(f for f in os.listdir(exported) if f.endswith(".safetensors"))
    n = len(files)
    assert n > 1
    assert files == [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    with open(os.path.join(exported, "model.safetensors.index.json")) as fh:
        index = json.load(fh)
    got = _tensors(exported)
    assert set(index["weight_map"]) == set(got)
    for f in files:
        with safe_open(os.path.join(exported, f), "pt") as fh:
            assert all(index["weight_map"][k] == f for k in fh.keys())
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in got.values())
    for f in files:  # greedy shards stay under the limit unless one tensor group alone is larger
        size = os.path.getsize(os.path.join(exported, f))
        assert size < SHARD_MB * 2 ** 20 + 64 * 1024, (f, size)
    with open(os.path.join(exported, "config.json")) as fh:
        cfg = json.load(fh)
    assert cfg["dtype"] == "bfloat16" and "quantization_config" not in cfg
    assert cfg["text_config"]["num_nextn_predict_layers"] == 1
    assert sorted(os.listdir(exported)) == sorted(files + ["checksums.sha256", "config.json",
                                                   "model.safetensors.index.json"])
    assert not _no_leftovers(os.path.dirname(exported))


def test_transformers_loads_export_with_same_logits(ckpts, exported):
    from transformers import Glm5NextForConditionalGeneration

    def load(path):
        m, info = Glm5NextForConditionalGeneration.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
        return m.eval(), info

    ref, _ = load(ckpts["src"])
    model, info = load(exported)
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["error_msgs"]
    assert all(".layers.4." in k for k in info["unexpected_keys"]), info["unexpected_keys"]  # MTP, ignored by HF
    ids = torch.randint(0, 250, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref(input_ids=ids).logits, model(input_ids=ids).logits
    assert torch.isfinite(a).all()
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------ FP8
def test_fp8_export(ckpts, exported_fp8):
    src, got = _tensors(ckpts["src"]), _tensors(exported_fp8)
    with open(os.path.join(exported_fp8, "config.json")) as fh:
        cfg = json.load(fh)
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
    text = cfg["text_config"]
    expect_fp8 = {k for k in src if is_fp8_in_release(k, text)}
    fp8_keys = {k for k, v in got.items() if v.dtype == FP8_DTYPE}
    assert fp8_keys == expect_fp8 and fp8_keys
    assert any("experts.0.gate_proj" in k for k in fp8_keys)
    assert any(".layers.4.self_attn.q_a_proj" in k for k in fp8_keys)  # the MTP layer's DSA
    assert set(got) == set(src) | {k + "_scale_inv" for k in fp8_keys}
    for k, v in src.items():
        if k in fp8_keys:
            s = got[k + "_scale_inv"]
            assert s.dtype == torch.float32 and s.shape == (-(-v.shape[0] // 128), -(-v.shape[1] // 128)), k
            deq = dequantize_fp8_blockwise(got[k], s, out_dtype=torch.float32, block_size=[128, 128])
            ref = v.float()
            scale = s.repeat_interleave(128, 0)[:v.shape[0]].repeat_interleave(128, 1)[:, :v.shape[1]]
            # e4m3: 3 mantissa bits -> half-ulp relative error 2^-4, subnormal step 2^-9 of the block scale
            assert ((deq - ref).abs() <= ref.abs() * 2 ** -4 + scale * 2 ** -9 + 1e-12).all(), k
        else:
            assert got[k].dtype == v.dtype and torch.equal(_bits(got[k]), _bits(v)), k


def test_fp8_export_loads_with_load_hf_checkpoint(exported_fp8, mcore):
    from megatron_glm5.checkpoint.hf_io import HFCheckpointReader, load_hf_checkpoint
    from megatron_glm5.config import Glm5Config
    from megatron_glm5.models.builder import build_model

    cfg = Glm5Config.from_hf(exported_fp8, use_cpu_initialization=True, perform_initialization=False)
    model = build_model(cfg, parallel_output=False)
    report = load_hf_checkpoint(model, exported_fp8)
    assert report["loaded"] > 0
    key = "model.language_model.layers.1.mlp.experts.2.down_proj.weight"
    expect = HFCheckpointReader(exported_fp8).get(key, dtype=torch.float32)
    got = dict(model.state_dict())["decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"]
    assert torch.equal(got, expect)


# ------------------------------------------------------------------------------------------------ reader
def test_reader_selected_keys_and_tracker_layout(ckpts, tmp_path):
    from megatron_glm5.checkpoint.mcore_reader import McoreCheckpointReader, iter_hf_tensors

    src = _tensors(ckpts["src"])
    keys = ["model.language_model.layers.3.mlp.experts.5.up_proj.weight", "lm_head.weight",
            "model.language_model.layers.0.self_attn.A_log", "model.visual.blocks.1.attn.qkv.weight"]
    got = dict(iter_hf_tensors(ckpts["mcore"], keys=keys, max_bytes=1))
    assert set(got) == set(keys)
    for k in keys:
        assert got[k].dtype == src[k].dtype and torch.equal(_bits(got[k]), _bits(src[k])), k
    # megatron's training layout: DIR/latest_checkpointed_iteration.txt -> DIR/iter_0000100
    (tmp_path / "iter_0000100").symlink_to(ckpts["mcore"], target_is_directory=True)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("100\n")
    reader = McoreCheckpointReader(str(tmp_path))
    assert reader.load_dir.endswith("iter_0000100")
    ((k, v),) = reader.iter_hf_tensors(keys=["model.language_model.norm.weight"])
    assert torch.equal(_bits(v), _bits(src[k]))


# ------------------------------------------------------------------------------------------------ bad input
def _error_lines(text):
    return [ln for ln in re.split(r"[\r\n]", text) if "convert_mcore_to_hf: error:" in ln]


def _run_cli(*args):
    # a fresh process: not the torch.distributed rendezvous of this one (initialize_megatron exported it)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=env)


def test_missing_dir_cli(tmp_path):
    out = tmp_path / "out"
    r = _run_cli("--load", str(tmp_path / "nope"), "--out", str(out))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == _error_lines(r.stderr) and len(_error_lines(r.stderr)) == 1
    assert "no such directory" in r.stderr
    assert not out.exists()


def test_corrupted_data_cli(ckpts, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(ckpts["mcore"], bad)
    for f in os.listdir(bad):
        if f.endswith(".distcp"):
            with open(bad / f, "r+b") as fh:
                fh.truncate(os.path.getsize(bad / f) // 2)
    out = tmp_path / "out"
    r = _run_cli("--load", str(bad), "--out", str(out))
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(_error_lines(r.stderr)) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not out.exists() and not _no_leftovers(tmp_path)


def _copy_without(src, dst, skip=()):
    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if n in skip])
    return str(dst)


@pytest.mark.parametrize("case", ["no_hf_config", "not_torch_dist", "garbage_metadata", "shape_mismatch",
                                  "missing_tensor"])
def test_bad_input(ckpts, tmp_path, capsys, case):
    from megatron_glm5.cli.convert_mcore_to_hf import main

    args = []
    if case == "no_hf_config":
        load = _copy_without(ckpts["mcore"], tmp_path / "ck", skip=("hf_config.json",))
        expect = "hf_config.json not found"
    elif case == "not_torch_dist":
        load = ckpts["src"]  # an HF directory
        expect = "not a megatron checkpoint (neither a save folder"
    elif case == "garbage_metadata":
        load = _copy_without(ckpts["mcore"], tmp_path / "ck")
        with open(os.path.join(load, ".metadata"), "wb") as fh:
            fh.write(b"\x00not a pickle" * 10)
        expect = "cannot read the torch_dist .metadata"
    elif case == "shape_mismatch":
        load = ckpts["mcore"]
        with open(os.path.join(load, "hf_config.json")) as fh:
            cfg = json.load(fh)
        cfg["text_config"]["intermediate_size"] = 80
        (tmp_path / "cfg.json").write_text(json.dumps(cfg))
        args = ["--hf-config", str(tmp_path / "cfg.json")]
        expect = "shape mismatches"
    else:  # the config asks for a layer the checkpoint does not have
        load = ckpts["mcore"]
        with open(os.path.join(load, "hf_config.json")) as fh:
            cfg = json.load(fh)
        t = cfg["text_config"]
        for k in ("layer_types", "mlp_layer_types", "indexer_types"):
            t[k] = t[k] + t[k][-1:]
        t["num_hidden_layers"] += 1
        (tmp_path / "cfg.json").write_text(json.dumps(cfg))
        args = ["--hf-config", str(tmp_path / "cfg.json")]
        expect = "missing from the checkpoint"
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["--load", load, "--out", str(out), "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("convert_mcore_to_hf: error: "), err
    assert expect in lines[0], lines[0]
    assert not out.exists() and not _no_leftovers(tmp_path)


def test_existing_output_needs_overwrite(ckpts, exported, tmp_path, capsys):
    from megatron_glm5.cli.convert_mcore_to_hf import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(["--load", ckpts["mcore"], "--out", str(out), "--no-progress"]) == 2
    assert (out / "keep.txt").exists()
    assert main(["--load", ckpts["mcore"], "--out", str(out), "--no-progress", "--overwrite",
                 "--shard-mb", "100"]) == 0
    assert not (out / "keep.txt").exists()
    assert os.listdir(out).count("model-00001-of-00001.safetensors") == 1
    assert not _no_leftovers(tmp_path)


# ------------------------------------------------------------------------------------------------ tokenizer / processor
ASSETS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
          "preprocessor_config.json", "processor_config.json")
# the tiny config's multimodal token ids are 250..255 in this order (megatron_glm5.config.tiny_hf_config)
def _write_tiny_hf_assets(hf_dir):
    from megatron_glm5.data.tiny_data import write_tiny_hf_assets

    with open(os.path.join(hf_dir, "config.json")) as fh:
        return write_tiny_hf_assets(hf_dir, json.load(fh))


@pytest.fixture(scope="module")
def hf_with_assets(ckpts):
    """The HF source with tokenizer / chat template / processor files."""
    dst = ckpts["root"] / "hf_assets_src"
    shutil.copytree(ckpts["src"], dst)
    return _write_tiny_hf_assets(str(dst))


@pytest.fixture(scope="module")
def converted_with_assets(ckpts, hf_with_assets):
    """tools/convert_hf_to_mcore.py of the HF source with assets -> its Megatron-LM layout OUT."""
    from megatron_glm5.cli.convert_hf_to_mcore import main

    out = str(ckpts["root"] / "converted")
    assert main(["--hf-dir", hf_with_assets, "--out", out, "--no-progress"]) == 0
    return out


def _offline(monkeypatch):
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(k, "1")


def test_converter_carries_assets_and_export_loads_with_transformers(ckpts, hf_with_assets, converted_with_assets,
                                                                     tmp_path, monkeypatch):
    """HF (with tokenizer + processor files) -> converter (OUT/release carries them, listed in its checksums and
    conversion_info.json) -> exporter --load OUT -> an HF folder that transformers loads offline with
    AutoTokenizer, AutoImageProcessor and AutoModelForImageTextToText, whose logits on a real image + text input
    equal those of the source checkpoint; AutoProcessor builds transformers' Glm5NextProcessor from it and expands
    an image placeholder to the image's tokens."""
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    from megatron_glm5.checkpoint.checksums import read_manifest
    from megatron_glm5.cli.convert_mcore_to_hf import main

    release = os.path.join(converted_with_assets, "release")
    with open(os.path.join(release, "conversion_info.json")) as fh:
        info = json.load(fh)
    assert info["hf_assets"] == sorted(ASSETS) and info["source"] == os.path.abspath(hf_with_assets)
    manifest = read_manifest(release)
    for name in ASSETS:
        assert name in manifest
        with open(os.path.join(release, name), "rb") as a, open(os.path.join(hf_with_assets, name), "rb") as b:
            assert a.read() == b.read(), name

    out = str(tmp_path / "hf")
    assert main(["--load", converted_with_assets, "--out", out, "--no-progress"]) == 0
    for name in ASSETS:
        with open(os.path.join(out, name), "rb") as a, open(os.path.join(hf_with_assets, name), "rb") as b:
            assert a.read() == b.read(), name
    assert set(ASSETS) <= set(read_manifest(out))

    _offline(monkeypatch)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    images = AutoImageProcessor.from_pretrained(out, local_files_only=True)
    assert type(images).__name__.startswith("Glm5NextImageProcessor")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True) == "[gMASK]<sop><|user|>\nhi<|assistant|>\n"
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8))
    pix = images(images=[img], return_tensors="pt")
    n = int(pix["image_grid_thw"].prod()) // 4
    ids = tok("the scan<|begin_of_image|>" + "<|image|>" * n + "<|end_of_image|>what colour is the square?",
              return_tensors="pt")["input_ids"]
    assert int((ids == 250).sum()) == n
    processor = AutoProcessor.from_pretrained(out, local_files_only=True)
    assert type(processor).__name__ == "Glm5NextProcessor"
    batch = processor(text=["the scan<|begin_of_image|><|image|><|end_of_image|>what colour is the square?"],
                      images=[img], return_tensors="pt")
    assert torch.equal(batch["input_ids"], ids) and torch.equal(batch["pixel_values"], pix["pixel_values"])

    def logits(path):
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                            local_files_only=True).eval()
        assert type(model).__name__ == "Glm5NextForConditionalGeneration"
        with torch.no_grad():
            return model(input_ids=ids, pixel_values=pix["pixel_values"],
                         image_grid_thw=pix["image_grid_thw"]).logits

    a, b = logits(hf_with_assets), logits(out)
    assert torch.isfinite(a).all() and torch.equal(a, b)


def test_training_save_exports_assets_from_hf_assets_flag(ckpts, hf_with_assets, tmp_path, capsys):
    """A training save's iter_NNNNNNN holds only hf_config.json: without --hf-assets the export has no tokenizer
    (one notice line), with --hf-assets DIR it carries DIR's files; either --load form gives the same export."""
    from megatron_glm5.cli.convert_mcore_to_hf import main

    capsys.readouterr()
    assert main(["--load", ckpts["mcore"], "--out", str(tmp_path / "plain"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "notice:" in err and "--hf-assets" in err
    assert not set(ASSETS) & set(os.listdir(tmp_path / "plain"))
    for load in (ckpts["mcore"], ckpts["save"]):
        out = tmp_path / ("from_" + os.path.basename(load))
        assert main(["--load", load, "--out", str(out), "--hf-assets", hf_with_assets, "--no-progress"]) == 0
        for name in ASSETS:
            assert (out / name).read_bytes() == open(os.path.join(hf_with_assets, name), "rb").read(), name
    a, b = _tensors(tmp_path / "from_iter_0000006"), _tensors(tmp_path / "from_save")
    assert a.keys() == b.keys() and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


def _bad_asset(d, case, outside):
    if case == "json":
        (d / "tokenizer_config.json").write_text('{"tokenizer_class": ')
        return "tokenizer_config.json: not valid JSON"
    if case == "json_list":
        (d / "preprocessor_config.json").write_text("[1, 2]")
        return "preprocessor_config.json: not a JSON object"
    if case == "symlink_out":
        (d / "tokenizer.json").unlink()
        (d / "tokenizer.json").symlink_to(outside)
        return "outside"
    if case == "too_big":
        (d / "chat_template.jinja").write_bytes(b"x" * (4 * 2 ** 20 + 1))
        return "chat_template.jinja: larger than 4 MiB"
    if case == "not_utf8":
        (d / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
        return "chat_template.jinja: not UTF-8"
    assert case == "directory"
    (d / "special_tokens_map.json").unlink()
    (d / "special_tokens_map.json").mkdir()
    return "special_tokens_map.json: not a regular file"


@pytest.mark.parametrize("case", ["json", "json_list", "symlink_out", "too_big", "not_utf8", "directory"])
def test_bad_assets_exit_2_with_one_line(ckpts, hf_with_assets, tmp_path, capsys, case):
    """A bad tokenizer / processor file in --hf-assets (exporter) or in the HF source (converter): one error line,
    exit 2, no output."""
    from megatron_glm5.cli import convert_hf_to_mcore, convert_mcore_to_hf

    outside = tmp_path / "secret.json"
    outside.write_text("{}")
    src = tmp_path / "src"
    shutil.copytree(hf_with_assets, src)
    expect = _bad_asset(src, case, outside)
    outs = tmp_path / "outs"
    outs.mkdir()
    for prog, run in (("convert_mcore_to_hf", lambda: convert_mcore_to_hf.main(
            ["--load", ckpts["mcore"], "--out", str(outs / "hf"), "--hf-assets", str(src), "--no-progress"])),
                      ("convert_hf_to_mcore", lambda: convert_hf_to_mcore.main(
            ["--hf-dir", str(src), "--out", str(outs / "mc"), "--no-progress"]))):
        capsys.readouterr()
        assert run() == 2, prog
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), lines
        assert expect in lines[0], lines[0]
        assert os.listdir(outs) == [], prog


def test_hf_assets_flag_errors(ckpts, tmp_path, capsys):
    from megatron_glm5.cli.convert_mcore_to_hf import main

    empty = tmp_path / "empty"
    empty.mkdir()
    for assets, expect in ((tmp_path / "nope", "--hf-assets"), (empty, "holds none of tokenizer.json")):
        capsys.readouterr()
        assert main(["--load", ckpts["mcore"], "--out", str(tmp_path / "out"), "--hf-assets", str(assets),
                     "--no-progress"]) == 2
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(lines) == 1 and expect in lines[0], lines
        assert not (tmp_path / "out").exists()
