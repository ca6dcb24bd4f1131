"""HF -> megatron-core torch_dist converter: Megatron-LM's layout of converted weights (OUT/latest_checkpointed_
iteration.txt = release, read by Megatron-LM's own tracker code; OUT/release the checkpoint), bitwise equal to the
single-process HF loader, same files and layout as megatron's own save, fp32 logits equal to tools/hf_forward.py,
loads at TP=2 / EP=2 / PP=2, --workers 2 equals --workers 1, and bad inputs exit 2 with one line and leave nothing
behind."""

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from megatron_glm5.checkpoint.hf_io import HFCheckpointReader, load_hf_checkpoint  # noqa: E402
from megatron_glm5.checkpoint.hf_keys import canonical_name, is_non_persistent, mcore_to_hf  # noqa: E402
from megatron_glm5.config import Glm5Config, tiny_hf_config  # noqa: E402
from tests.helpers import free_port  # noqa: E402

ERR = "convert_hf_to_mcore: error:"


# --------------------------------------------------------------------------------------------- helpers
def _build(hf_dir, dtype=torch.bfloat16, pre=True, post=True, **overrides):
    """A real model of this rank (fp32 build, then cast like the trainer: the fp32 islands stay fp32)."""
    from megatron_glm5.models.builder import build_model

    cfg = Glm5Config.from_hf(hf_dir, use_cpu_initialization=True, perform_initialization=False,
                             params_dtype=torch.float32, **overrides)
    return build_model(cfg, pre_process=pre, post_process=post, parallel_output=False).to_dtype(dtype)


def _load_mcore(model, ckpt, strict="assume_ok_unexpected"):
    from megatron.core import dist_checkpointing

    sd = dist_checkpointing.load(model.sharded_state_dict(), ckpt, strict=strict)
    sd.pop("checkpoint_version", None)  # the common state Megatron-LM's loader reads
    model.load_state_dict(sd, strict=True)
    return model


def _tensors(model):
    return {k: v for k, v in model.state_dict().items() if torch.is_tensor(v) and not is_non_persistent(k)}


def _convert(hf_dir, out, *extra):
    from megatron_glm5.cli.convert_hf_to_mcore import main

    return main(["--hf-dir", str(hf_dir), "--out", str(out), "--no-progress", *extra])


def _copy_ckpt(src, dst, mutate=None, mutate_cfg=None):
    os.makedirs(dst)
    sd = {}
    for f in os.listdir(src):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(src, f)))
    if mutate:
        mutate(sd)
    save_file(sd, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as fh:
        cfg = json.load(fh)
    if mutate_cfg:
        mutate_cfg(cfg)
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return str(dst)


# --------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, mcore):
    """The tiny FP8 + MTP HF checkpoint and its bf16 / fp32 conversions (1 process): "bf16_out" is the converter's
    OUT, "bf16" / "fp32" the checkpoint folders OUT/release."""
    from megatron_glm5.cli.make_tiny_hf_checkpoint import write_checkpoint

    root = tmp_path_factory.mktemp("convert")
    hf = write_checkpoint(str(root / "hf_fp8"), tiny_hf_config(mtp=True), fmt="fp8", mtp=True, seed=11)
    assert _convert(hf, root / "bf16") == 0
    assert _convert(hf, root / "fp32", "--dtype", "fp32") == 0
    return {"hf": hf, "bf16": str(root / "bf16" / "release"), "fp32": str(root / "fp32" / "release"), "root": root,
            "bf16_out": str(root / "bf16")}


@pytest.fixture(scope="module")
def reference(ckpts):
    """What the single-process HF loader gives, cast to bf16 like the trainer (TP1)."""
    m = _build(ckpts["hf"], dtype=torch.float32)
    load_hf_checkpoint(m, ckpts["hf"])
    return m.to_dtype(torch.bfloat16)


# --------------------------------------------------------------------------------------------- TP1
def test_bf16_checkpoint_loads_bitwise_like_hf_loader(ckpts, reference):
    got = _load_mcore(_build(ckpts["hf"]), ckpts["bf16"], strict="raise_all")  # no missing / unexpected key
    ref, out = _tensors(reference), _tensors(got)
    assert ref.keys() == out.keys()
    bad = [k for k in ref if out[k].dtype != ref[k].dtype or not torch.equal(out[k], ref[k])]
    assert not bad, bad
    assert out["decoder.layers.1.self_attention.q_b_proj.weight"].dtype == torch.bfloat16  # FP8 in the source
    assert out["decoder.layers.1.mlp.router.weight"].dtype == torch.float32  # keep_fp32 island
    assert out["decoder.layers.1.mlp.router.expert_bias"].dtype == torch.float32
    assert out["mtp.layers.0.eh_proj.weight"].dtype == torch.bfloat16

    assert sorted(os.listdir(ckpts["bf16_out"])) == ["latest_checkpointed_iteration.txt", "release"]
    with open(os.path.join(ckpts["bf16_out"], "latest_checkpointed_iteration.txt")) as fh:
        assert fh.read() == "release"
    files = sorted(os.listdir(ckpts["bf16"]))
    assets = sorted(f for f in os.listdir(ckpts["hf"]) if f.startswith(("tokenizer", "special_tokens", "chat_template",
                                                                        "preprocessor", "processor")))
    assert assets  # the tiny HF checkpoint ships them, as the release does
    assert files == sorted([".metadata", "__0_0.distcp", "__0_1.distcp", "checksums.sha256", "conversion_info.json",
                            "hf_config.json", "metadata.json"] + assets)
    with open(os.path.join(ckpts["bf16"], "hf_config.json")) as fh:
        assert json.load(fh) == json.loads(json.dumps(Glm5Config.from_hf(ckpts["hf"]).to_hf_dict()))
    with open(os.path.join(ckpts["bf16"], "conversion_info.json")) as fh:
        info = json.load(fh)
    assert info["dtype"] == "bf16" and info["layout"] == {"tp": 1, "pp": 1, "ep": 1}
    assert info["source"] == os.path.abspath(ckpts["hf"]) and info["tensor_bytes"] > 0
    assert info["hf_assets"] == assets  # carried through into the checkpoint
    assert not [f for f in os.listdir(ckpts["root"]) if f.startswith(".")]  # no temporary folder left
    # the meta-device build leaked no meta tensor into megatron's module-level state (later real backward passes)
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    assert MTPLossAutoScaler.main_loss_backward_scale.device.type == "cpu"


def test_megatron_lm_reads_the_tracker_and_loads_release(ckpts):
    """Megatron-LM's own checkpointing code reads OUT as a release checkpoint (what --pretrained-checkpoint OUT
    --finetune does): its tracker parser gives release, its checkpoint name is OUT/release, and megatron-core's
    dist_checkpointing.load fills a freshly built model from there with no missing or unexpected key; our readers
    take OUT and OUT/release alike."""
    from megatron.core import dist_checkpointing
    from megatron.training.checkpointing import (checkpoint_exists, get_checkpoint_name,
                                                 get_checkpoint_tracker_filename, read_metadata)

    from megatron_glm5.checkpoint.tracker import checkpoint_in, resolve_checkpoint_dir

    out = ckpts["bf16_out"]
    assert checkpoint_exists(out)
    iteration, release = read_metadata(get_checkpoint_tracker_filename(out))
    assert (iteration, release) == (0, True)
    name = get_checkpoint_name(out, iteration, release, return_base_dir=True)
    assert os.path.realpath(name) == os.path.realpath(ckpts["bf16"])
    assert dist_checkpointing.check_is_distributed_checkpoint(name)
    model = _build(ckpts["hf"])
    before = {k: v.clone() for k, v in _tensors(model).items()}
    sd = dist_checkpointing.load(model.sharded_state_dict(), name, strict="raise_all")
    sd.pop("checkpoint_version", None)  # the common state Megatron-LM's loader reads
    model.load_state_dict(sd, strict=True)
    after = _tensors(model)
    assert sum(not torch.equal(before[k], after[k]) for k in after) > 0.9 * len(after)  # weights came from OUT
    assert checkpoint_in(out) == resolve_checkpoint_dir(out) == os.path.join(out, "release")
    assert resolve_checkpoint_dir(ckpts["bf16"]) == ckpts["bf16"]


def _tensor_entries(state: dict) -> dict:
    """The tensors of a loaded checkpoint (its common state, e.g. ``checkpoint_version``, left out)."""
    return {k: v for k, v in state.items() if torch.is_tensor(v)}


def test_same_files_and_layout_as_megatron_save(ckpts, reference, tmp_path):
    """megatron's own dist_checkpointing.save of the loaded model writes the same tensors, shapes, dtypes, chunks,
    common state and metadata.json (it only splits the data over 2 files per rank)."""
    from megatron.core import dist_checkpointing

    ref_dir = tmp_path / "mcore_save"
    ref_dir.mkdir()
    from megatron_glm5.checkpoint.tracker import CHECKPOINT_VERSION

    dist_checkpointing.save({**reference.sharded_state_dict(), "checkpoint_version": CHECKPOINT_VERSION},
                            str(ref_dir))
    assert dist_checkpointing.load_common_state_dict(str(ref_dir)) == {"checkpoint_version": CHECKPOINT_VERSION}
    with open(ref_dir / "metadata.json") as a, open(os.path.join(ckpts["bf16"], "metadata.json")) as b:
        assert json.load(a) == json.load(b)
    assert (dist_checkpointing.load_common_state_dict(str(ref_dir))
            == dist_checkpointing.load_common_state_dict(ckpts["bf16"]))
    with open(ref_dir / ".metadata", "rb") as a, open(os.path.join(ckpts["bf16"], ".metadata"), "rb") as b:
        ma, mb = pickle.load(a).state_dict_metadata, pickle.load(b).state_dict_metadata
    assert ma.keys() == mb.keys()
    for k in ma:
        assert type(ma[k]) is type(mb[k]), k
        if hasattr(ma[k], "chunks"):
            assert ma[k].size == mb[k].size and ma[k].properties.dtype == mb[k].properties.dtype, k
            assert sorted(map(repr, ma[k].chunks)) == sorted(map(repr, mb[k].chunks)), k
    a, b = (_tensor_entries(dist_checkpointing.load_plain_tensors(p)) for p in (str(ref_dir), ckpts["bf16"]))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def test_records_are_torch_save_archives(ckpts):
    """Every tensor record of the .distcp files (written by the converter's own record writer) is byte for byte
    the torch.save archive of the tensor it holds, as torch's FileSystemWriter would have written it."""
    import io

    from megatron_glm5.checkpoint.dcp_save import RECORDS

    assert RECORDS._dtype_ok.get(torch.bfloat16) and RECORDS._dtype_ok.get(torch.float32)  # it did write
    for name in ("bf16", "fp32"):
        with open(os.path.join(ckpts[name], ".metadata"), "rb") as fh:
            storage = pickle.load(fh).storage_data
        files = {}
        for info in storage.values():
            if info.relative_path not in files:
                with open(os.path.join(ckpts[name], info.relative_path), "rb") as fh:
                    files[info.relative_path] = fh.read()
            raw = files[info.relative_path][info.offset:info.offset + info.length]
            t = torch.load(io.BytesIO(raw), weights_only=True)
            want = io.BytesIO()
            torch.save(t, want)
            assert raw == want.getvalue(), (name, info)
        assert len(storage) > 50


def test_fp32_logits_equal_hf_forward(ckpts):
    from megatron_glm5.cli import hf_forward

    from megatron_glm5.models.packing import make_packed_seq_params

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 250, (1, 24), generator=g)
    cu = torch.tensor([0, 9, 24], dtype=torch.int32)
    want = hf_forward.run(ckpts["hf"], {"input_ids": ids, "cu_seqlens": cu})
    model = _load_mcore(_build(ckpts["hf"], dtype=torch.float32), ckpts["fp32"], strict="raise_all").eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():
        got = model(ids, packed_seq_params=make_packed_seq_params(cu)).float()
    assert torch.equal(got, want), (got - want).abs().max()


# --------------------------------------------------------------------------------------------- other layouts
def _tp_shard(full, local, param, parts, rank, tp):
    """This TP rank's slice of a TP1 tensor: along the param's ``partition_dim`` ([gate; up] sliced part by part)."""
    if param is None or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if parts > 1 and dim == 0:
        return torch.cat([p.chunk(tp, dim=0)[rank] for p in full.chunk(parts, dim=0)], dim=0)
    return full.chunk(tp, dim=dim)[rank]


def _layout_worker(rank, world, port, hf_dir, ckpt, ref_path):
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    from megatron_glm5.initialize import destroy_megatron, initialize_megatron

    ref = torch.load(ref_path)
    try:
        for tp, pp, ep in [(2, 1, 1), (1, 1, 2), (1, 2, 1)]:
            initialize_megatron(tp=tp, pp=pp, ep=ep)
            sizes = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                         pipeline_dtype=torch.bfloat16)
            if pp > 1:  # the model supports MTP only at PP = 1; the checkpoint's MTP tensors are simply not asked for
                first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
                model = _build(hf_dir, pre=first, post=last, mtp_num_layers=None, **sizes)
            else:
                model = _build(hf_dir, **sizes)
            _load_mcore(model, ckpt)
            params = dict(model.named_parameters())
            n_split = 0
            names = []
            for local, t in _tensors(model).items():
                name = canonical_name(local, model)
                names.append(name)
                want = ref[name]
                if tp > 1:
                    want = _tp_shard(want, t, params.get(local), len(mcore_to_hf(name, model.config.num_layers)),
                                     ps.get_tensor_model_parallel_rank(), tp)
                    n_split += int(want.shape != ref[name].shape)
                assert t.dtype == want.dtype and torch.equal(t, want), (tp, pp, ep, rank, local, name)
            if tp > 1:
                assert n_split > 20, n_split
            if ep > 1:  # this rank holds the global experts 4r..4r+3 of every MoE layer
                for prefix in ("decoder.layers.1.", "mtp.layers.0.mtp_model_layer."):
                    assert f"{prefix}mlp.experts.local_experts.{4 * rank + 3}.linear_fc2.weight" in names
                    assert f"{prefix}mlp.experts.local_experts.{4 * (1 - rank)}.linear_fc2.weight" not in names
            if pp > 1:  # stage r holds the global layers 2r, 2r+1
                layers = {int(n.split(".")[2]) for n in names if n.startswith("decoder.layers.")}
                assert layers == {2 * rank, 2 * rank + 1}, layers
    finally:
        destroy_megatron()


def test_loads_at_tp2_ep2_pp2(ckpts, reference, tmp_path):
    ref_path = str(tmp_path / "ref.pt")
    torch.save(_tensors(reference), ref_path)
    mp.start_processes(_layout_worker, args=(2, free_port(), ckpts["hf"], ckpts["bf16"], ref_path), nprocs=2,
                       join=True, start_method="spawn")


# --------------------------------------------------------------------------------------------- workers
def test_two_workers_equal_one(ckpts, tmp_path):
    from megatron.core import dist_checkpointing

    assert _convert(ckpts["hf"], tmp_path / "w2", "--workers", "2") == 0
    out = tmp_path / "w2" / "release"
    distcp = {f for f in os.listdir(out) if f.endswith(".distcp")}
    assert distcp == {"__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"}
    assert all(os.path.getsize(out / f) > 50_000 for f in distcp)  # balanced
    a, b = (_tensor_entries(dist_checkpointing.load_plain_tensors(p)) for p in (ckpts["bf16"], str(out)))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert dist_checkpointing.load_common_state_dict(str(out)) == dist_checkpointing.load_common_state_dict(
        ckpts["bf16"])
    for f in ("metadata.json", "hf_config.json"):
        with open(out / f, "rb") as x, open(os.path.join(ckpts["bf16"], f), "rb") as y:
            assert x.read() == y.read(), f


# --------------------------------------------------------------------------------------------- bad inputs
LM = "model.language_model."


def _drop(sd):
    del sd[LM + "layers.0.self_attn.q_proj.weight"]


def _extra(sd):
    sd[LM + "layers.0.self_attn.bogus.weight"] = torch.zeros(2)


def _reshape(sd):
    sd[LM + "norm.weight"] = torch.ones(3)


def _hidden(cfg):
    cfg["text_config"]["hidden_size"] = 32
    cfg["vision_config"]["out_hidden_size"] = 32


def _nan(sd):
    k = LM + "layers.1.mlp.experts.5.down_proj.weight_scale_inv"
    sd[k] = torch.full_like(sd[k], float("nan"))


@pytest.mark.parametrize("case,mutate,mutate_cfg,extra,needles", [
    ("missing", _drop, None, [], ["missing keys (1)", "layers.0.self_attn.q_proj.weight"]),
    ("unexpected", _extra, None, [], ["unexpected keys (1)", "layers.0.self_attn.bogus.weight"]),
    ("shape", _reshape, None, [], ["shape mismatches (1)", "norm.weight: checkpoint (3,)"]),
    ("hidden", None, _hidden, [], ["shape mismatches (", "embed_tokens.weight: checkpoint (256, 64)"]),
    ("tp3", None, None, ["--tp", "3"], ["--tp 3 does not divide", "num_attention_heads = 4"]),
    ("ep3", None, None, ["--ep", "3"], ["--ep 3 does not divide n_routed_experts = 8"]),
    ("pp8", None, None, ["--pp", "8"], ["--pp 8 exceeds num_hidden_layers = 4"]),
    ("nan", _nan, None, [], ["NaN/inf", "experts.5.down_proj.weight"]),
    ("nan_2_workers", _nan, None, ["--workers", "2"], ["NaN/inf", "experts.5.down_proj.weight"]),
])
def test_bad_input_exits_2_with_one_line_and_no_output(ckpts, tmp_path, capfd, case, mutate, mutate_cfg, extra,
                                                       needles):
    src = ckpts["hf"] if mutate is None and mutate_cfg is None else _copy_ckpt(
        ckpts["hf"], tmp_path / "src", mutate, mutate_cfg)
    out_parent = tmp_path / "outs"
    out_parent.mkdir()
    capfd.readouterr()
    assert _convert(src, out_parent / "ckpt", *extra) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]  # incl. worker processes
    assert len(err) == 1 and err[0].startswith(ERR), err
    for needle in needles:
        assert needle in err[0], (case, err[0][:400])
    assert os.listdir(out_parent) == []  # no output and no temporary folder


def test_existing_output_and_bad_args_exit_2(ckpts, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    assert _convert(ckpts["hf"], tmp_path / "taken") == 2
    assert _convert(ckpts["hf"], tmp_path / "x", "--workers", "0") == 2
    assert _convert(tmp_path / "nope", tmp_path / "y") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 3 and all(line.startswith(ERR) for line in err), err
    assert sorted(os.listdir(tmp_path)) == ["taken"]
    assert _convert(ckpts["hf"], tmp_path / "taken", "--overwrite") == 0
    assert sorted(os.listdir(tmp_path)) == ["taken"]
    assert os.path.exists(tmp_path / "taken" / "release" / "metadata.json")


def test_mtp_weights_skipped_when_config_has_no_mtp(ckpts, tmp_path):
    """Like transformers: MTP tensors in the checkpoint but no MTP layer in config.json are skipped."""
    def no_mtp(cfg):
        cfg["text_config"].pop("num_nextn_predict_layers")

    src = _copy_ckpt(ckpts["hf"], tmp_path / "src", mutate_cfg=no_mtp)
    assert _convert(src, tmp_path / "out") == 0
    with open(tmp_path / "out" / "release" / "conversion_info.json") as fh:
        skipped = json.load(fh)["hf_keys_skipped"]
    assert skipped and all(k.startswith(LM + "layers.4.") for k in skipped)
    with open(tmp_path / "out" / "release" / ".metadata", "rb") as fh:
        keys = pickle.load(fh).state_dict_metadata.keys()
    assert not [k for k in keys if k.startswith("mtp.")] and "decoder.layers.3.mlp.router.weight" in keys


def test_cli_process_exit_code(ckpts, tmp_path):
    """The real command line: exit status 2 and exactly one stderr line."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_hf_to_mcore.py"), "--hf-dir",
                        ckpts["hf"], "--out", str(tmp_path / "o"), "--tp", "3"], capture_output=True, text=True)
    assert r.returncode == 2
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(ERR + " --tp 3 does not divide"), r.stderr
    assert os.listdir(tmp_path) == []


def test_interrupted_conversion_leaves_no_output(ckpts, tmp_path, monkeypatch):
    from megatron_glm5.checkpoint.hf_to_mcore import convert_hf_to_mcore

    real_get, calls = HFCheckpointReader.get, []

    def flaky_get(self, key, dtype=None, **kw):
        calls.append(key)
        if len(calls) == 25:
            raise RuntimeError("simulated crash while reading " + key)
        return real_get(self, key, dtype, **kw)

    monkeypatch.setattr(HFCheckpointReader, "get", flaky_get)
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_hf_to_mcore(ckpts["hf"], str(tmp_path / "ckpt"), progress=False)
    assert 25 <= len(calls) <= 27  # the other writer thread stops after the tensor it is producing
    assert os.listdir(tmp_path) == []


def test_usable_cpus_and_default_writer_threads(monkeypatch):
    """Thread pools follow the CPUs this process may use: its affinity mask, else the machine's count; the
    converter's default writer threads are that, at most MAX_DEFAULT_THREADS."""
    import os

    from megatron_glm5.checkpoint import cpus
    from megatron_glm5.cli import convert_hf_to_mcore as cli

    assert 1 <= cpus.usable_cpus() <= (os.cpu_count() or 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert cpus.usable_cpus() == 1 and cli.default_writer_threads() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert cpus.usable_cpus() == 64 and cli.default_writer_threads() == cli.MAX_DEFAULT_THREADS
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert cpus.usable_cpus() == 1
