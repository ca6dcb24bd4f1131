"""The checkpoint tools as a hostile or careless user meets them: nothing runs code from a checkpoint, nothing that
was an input is deleted, every bad input is one line + exit 2 with nothing written, checksums catch flipped bytes,
two writers of one output cannot collide, a killed run leaves nothing that confuses the next one, and a checkpoint
written by transformers (no MTP weights) loads and converts."""

import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_glm5.cli import convert_hf_to_mcore as to_mcore_cli
from megatron_glm5.cli import convert_mcore_to_hf as to_hf_cli
from megatron_glm5.cli import hf_forward as hf_forward_cli
from megatron_glm5.cli import make_tiny_hf_checkpoint as tiny_cli
from megatron_glm5.cli.make_tiny_hf_checkpoint import write_checkpoint
from megatron_glm5.config import tiny_hf_config

LM = "model.language_model."
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# --------------------------------------------------------------------------------------------- helpers
def _tree_digest(path):
    """{relative file: sha256} of everything under ``path`` (inputs must come out of every test unchanged)."""
    out = {}
    for dp, _, fs in os.walk(path):
        for f in fs:
            p = os.path.join(dp, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _tensors(path):
    sd = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(path, f)))
    return sd


def _config(path):
    with open(os.path.join(path, "config.json")) as fh:
        return json.load(fh)


def _write_hf(dst, sd, cfg, shards=None):
    """An HF checkpoint from a state dict; ``shards``: {file: [keys]} with an index (keys may repeat)."""
    os.makedirs(dst)
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    if shards is None:
        save_file(sd, os.path.join(dst, "model.safetensors"))
        return str(dst)
    wm = {}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, os.path.join(dst, fname))
        wm.update({k: fname for k in keys})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": wm}, fh)
    return str(dst)


def _one_error(capfd, prog):
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), lines
    assert "Traceback" not in lines[0]
    return lines[0]


def _env():
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _convert(src, out, *extra):
    return to_mcore_cli.main(["--hf-dir", str(src), "--out", str(out), "--no-progress", *extra])


def _export(load, out, *extra):
    return to_hf_cli.main(["--load", str(load), "--out", str(out), "--no-progress", *extra])


@pytest.fixture(scope="module")
def ck(tmp_path_factory, mcore):
    """A tiny FP8 HF checkpoint with MTP, its torch_dist conversion ("mcore_out": the converter's OUT, "mcore": its
    checkpoint folder OUT/release), and a transformers-style one without MTP."""
    root = tmp_path_factory.mktemp("safety")
    hf = write_checkpoint(str(root / "hf"), tiny_hf_config(mtp=True), fmt="fp8", mtp=True, seed=3)
    assert _convert(hf, root / "mcore") == 0
    no_mtp = write_checkpoint(str(root / "hf_no_mtp"), tiny_hf_config(mtp=True), fmt="bf16", mtp=False, seed=3)
    return {"root": root, "hf": hf, "mcore": str(root / "mcore" / "release"), "mcore_out": str(root / "mcore"),
            "no_mtp": no_mtp}


# --------------------------------------------------------------------------------------------- security
class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_metadata_pickle_never_runs(ck, tmp_path, capfd):
    load = tmp_path / "ck"
    shutil.copytree(ck["mcore"], load)
    os.remove(load / "checksums.sha256")  # the unpickler itself must refuse, not only the checksum
    marker = tmp_path / "pwned"
    with open(load / ".metadata", "wb") as fh:
        pickle.dump(_Payload(marker), fh)
    capfd.readouterr()
    assert _export(load, tmp_path / "out") == 2
    line = _one_error(capfd, "convert_mcore_to_hf")
    assert "refused to load posix.system" in line, line
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_metadata_storage_paths_stay_inside(ck, tmp_path, capfd):
    from megatron_glm5.checkpoint.safe_load import load_dcp_metadata

    load = tmp_path / "ck"
    shutil.copytree(ck["mcore"], load)
    os.remove(load / "checksums.sha256")
    md = load_dcp_metadata(str(load))
    for info in md.storage_data.values():
        info.relative_path = "../../etc/passwd"
    with open(load / ".metadata", "wb") as fh:
        pickle.dump(md, fh)
    capfd.readouterr()
    assert _export(load, tmp_path / "out") == 2
    assert "outside" in _one_error(capfd, "convert_mcore_to_hf")


@pytest.mark.parametrize("where", ["dotdot", "absolute", "symlink"])
def test_index_shard_paths_outside_the_checkpoint_refused(ck, tmp_path, capfd, where):
    sd, cfg = _tensors(ck["hf"]), _config(ck["hf"])
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    save_file({k: sd[k] for k in sorted(sd)[:3]}, str(outside / "s.safetensors"))
    src = _write_hf(tmp_path / "src", sd, cfg, shards={"a.safetensors": sorted(sd)[3:], "b.safetensors": sorted(sd)[:3]})
    os.remove(os.path.join(src, "b.safetensors"))
    name = {"dotdot": "../elsewhere/s.safetensors", "absolute": str(outside / "s.safetensors"),
            "symlink": "b.safetensors"}[where]
    if where == "symlink":
        os.symlink(outside / "s.safetensors", os.path.join(src, "b.safetensors"))
    idx = os.path.join(src, "model.safetensors.index.json")
    with open(idx) as fh:
        index = json.load(fh)
    index["weight_map"] = {k: (name if v == "b.safetensors" else v) for k, v in index["weight_map"].items()}
    with open(idx, "w") as fh:
        json.dump(index, fh)
    capfd.readouterr()
    assert _convert(src, tmp_path / "out") == 2
    assert "outside" in _one_error(capfd, "convert_hf_to_mcore") or where == "absolute"
    assert not (tmp_path / "out").exists()


def test_hub_cache_snapshot_links_are_allowed(ck, tmp_path):
    """A Hugging Face hub cache snapshot links its files into the repository's blobs/: that is not "outside"."""
    from megatron_glm5.checkpoint.hf_io import HFCheckpointReader

    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for f in os.listdir(ck["hf"]):
        shutil.copy(os.path.join(ck["hf"], f), repo / "blobs" / f"blob-{f}")
        os.symlink(f"../../blobs/blob-{f}", snap / f)
    assert sorted(HFCheckpointReader(str(snap)).keys()) == sorted(_tensors(ck["hf"]))


def test_missing_shard_is_one_line(ck, tmp_path, capfd):
    sd, cfg = _tensors(ck["hf"]), _config(ck["hf"])
    src = _write_hf(tmp_path / "src", sd, cfg, shards={"a.safetensors": sorted(sd)[3:], "b.safetensors": sorted(sd)[:3]})
    os.remove(os.path.join(src, "b.safetensors"))
    capfd.readouterr()
    assert _convert(src, tmp_path / "out") == 2
    assert "shard b.safetensors named in the index is missing" in _one_error(capfd, "convert_hf_to_mcore")
    assert sorted(os.listdir(tmp_path)) == ["src"]


# --------------------------------------------------------------------------------------------- nothing lost
@pytest.mark.parametrize("rel", ["equal", "contains", "inside"])
def test_overwrite_never_deletes_an_input(ck, tmp_path, capfd, rel):
    root = tmp_path / "data"
    src = root / "hf"
    shutil.copytree(ck["hf"], src)
    load = root / "mc"
    shutil.copytree(ck["mcore_out"], load)  # a save root: its tracker names release
    before = _tree_digest(root)
    for tool, inp, prog in ((_convert, src, "convert_hf_to_mcore"), (_export, load, "convert_mcore_to_hf")):
        out = {"equal": inp, "contains": root, "inside": inp / "sub"}[rel]
        capfd.readouterr()
        assert tool(inp, out, "--overwrite") == 2
        assert "input" in _one_error(capfd, prog)
        assert _tree_digest(root) == before
    # hf_forward: --output may not be the input file nor lie inside the checkpoint
    inp = tmp_path / "in.pt"
    torch.save({"input_ids": torch.zeros(1, 4, dtype=torch.long)}, inp)
    for output in (inp, src / "model.safetensors"):
        capfd.readouterr()
        assert hf_forward_cli.main(["--hf-dir", str(src), "--input", str(inp), "--output", str(output)]) == 2
        _one_error(capfd, "hf_forward")
    assert _tree_digest(root) == before


def test_tiny_tool_keeps_an_existing_out(tmp_path, capfd):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    capfd.readouterr()
    assert tiny_cli.main(["--out", str(out), "--layers", "2", "--no-vision"]) == 2
    assert "already exists" in _one_error(capfd, "make_tiny_hf_checkpoint")
    assert (out / "keep.txt").read_text() == "precious"
    assert tiny_cli.main(["--out", str(out), "--layers", "2", "--no-vision", "--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary, no lock left


def test_second_writer_of_the_same_out_is_refused(ck, tmp_path, capfd):
    """A real second process holds the lock of --out for its whole run; the converter is refused at once."""
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from megatron_glm5.checkpoint.atomic import atomic_output_dir
            with atomic_output_dir({str(out)!r}) as tmp:
                open(tmp + "/from_first_writer", "w").close()
                print("ready", flush=True)
                sys.stdin.readline()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert holder.stdout.readline().strip() == "ready"
        capfd.readouterr()
        assert _convert(ck["hf"], out) == 2
        line = _one_error(capfd, "convert_hf_to_mcore")
        assert "being written by another process" in line and f"pid {holder.pid}" in line, line
        assert not out.exists()
    finally:
        holder.communicate("\n", timeout=60)
    assert holder.returncode == 0 and os.listdir(out) == ["from_first_writer"]  # the first writer finished intact
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_sigkill_then_rerun(ck, tmp_path, capfd):
    """A converter killed mid-write leaves no --out; the next run names and removes its temporary, then succeeds."""
    out = tmp_path / "out"
    ready = tmp_path / "ready"
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from megatron_glm5.checkpoint.hf_io import HFCheckpointReader
        from megatron_glm5.cli.convert_hf_to_mcore import main
        real, n = HFCheckpointReader.get, [0]
        def slow_get(self, key, dtype=None, **kw):
            n[0] += 1
            if n[0] == 20:
                open({str(ready)!r}, "w").close()
                time.sleep(600)
            return real(self, key, dtype, **kw)
        HFCheckpointReader.get = slow_get
        main(["--hf-dir", {ck["hf"]!r}, "--out", {str(out)!r}, "--no-progress"])
    """)], env=_env(), stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not ready.exists():
            assert child.poll() is None and time.time() < deadline
            time.sleep(0.1)
        left = [f for f in os.listdir(tmp_path) if f.startswith(".out.tmp-")]
        assert len(left) == 1 and any(f.endswith(".distcp") for f in os.listdir(tmp_path / left[0] / "release"))
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
    assert not out.exists()
    capfd.readouterr()
    assert _convert(ck["hf"], out) == 0
    err = capfd.readouterr().err
    assert f"removed 1 temporary folder(s) left by an interrupted run: {left[0]}" in err, err
    assert sorted(os.listdir(tmp_path)) == ["out", "ready"]
    from megatron.core import dist_checkpointing

    a, b = dist_checkpointing.load_plain_tensors(ck["mcore"]), dist_checkpointing.load_plain_tensors(str(out / "release"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def test_killed_between_the_two_renames_puts_the_previous_output_back(tmp_path, capfd):
    """publish_dir moves an existing --out aside, then renames the new one in: a run killed in between leaves no
    --out; the next writer puts the previous one back (and, without --overwrite, then refuses to replace it)."""
    out = tmp_path / "out"
    (tmp_path / ".out.old-x1" / "previous").mkdir(parents=True)
    (tmp_path / ".out.old-x1" / "previous" / "weights").write_text("previous")
    (tmp_path / ".out.tmp-x2").mkdir()
    capfd.readouterr()
    assert tiny_cli.main(["--out", str(out), "--layers", "2", "--no-vision"]) == 2
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 2 and "put the previous" in err[0] and "already exists" in err[1], err
    assert (out / "weights").read_text() == "previous" and sorted(os.listdir(tmp_path)) == ["out"]


def test_outputs_get_the_umask_permissions(ck, tmp_path):
    old = os.umask(0o027)
    try:
        assert _export(ck["mcore"], tmp_path / "out") == 0
    finally:
        os.umask(old)
    assert (os.stat(tmp_path / "out").st_mode & 0o777) == 0o750
    assert all((os.stat(tmp_path / "out" / f).st_mode & 0o777) == 0o640 for f in os.listdir(tmp_path / "out"))
    for d in (ck["mcore_out"], ck["mcore"]):  # the converter's OUT and OUT/release
        assert os.stat(d).st_mode & 0o777 == 0o777 & ~old
        assert all((os.stat(os.path.join(d, f)).st_mode & 0o777) == (0o777 if os.path.isdir(os.path.join(d, f))
                                                                      else 0o666) & ~old for f in os.listdir(d))


def test_remapping_while_writer_threads_read(ck, tmp_path, monkeypatch):
    """The reader drops its file mappings every few bytes while 3 writer threads read: same checkpoint bytes."""
    import megatron_glm5.checkpoint.lazy_sources as lazy_sources
    from megatron.core import dist_checkpointing

    monkeypatch.setattr(lazy_sources, "_REMAP_BYTES", 1)
    assert _convert(ck["hf"], tmp_path / "out", "--threads", "3") == 0
    a = dist_checkpointing.load_plain_tensors(ck["mcore"])
    b = dist_checkpointing.load_plain_tensors(str(tmp_path / "out" / "release"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


# --------------------------------------------------------------------------------------------- checksums
def _flip(path, frac=0.5):
    with open(path, "r+b") as fh:
        fh.seek(int(os.path.getsize(path) * frac))
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x01]))


def test_flipped_byte_is_an_error(ck, tmp_path, capfd):
    assert subprocess.run(["sha256sum", "--quiet", "-c", "checksums.sha256"], cwd=ck["mcore"]).returncode == 0
    load = tmp_path / "ck"
    shutil.copytree(ck["mcore"], load)
    distcp = sorted(f for f in os.listdir(load) if f.endswith(".distcp"))[0]
    _flip(load / distcp)
    capfd.readouterr()
    assert _export(load, tmp_path / "out") == 2
    line = _one_error(capfd, "convert_mcore_to_hf")
    assert distcp in line and "checksum mismatch" in line, line
    assert not (tmp_path / "out").exists()
    # the exporter's own output carries a manifest; the HF loader verifies it
    assert _export(ck["mcore"], tmp_path / "hf") == 0
    _flip(tmp_path / "hf" / "model-00001-of-00001.safetensors", 0.9)
    inp = tmp_path / "in.pt"
    torch.save({"input_ids": torch.zeros(1, 4, dtype=torch.long)}, inp)
    capfd.readouterr()
    assert hf_forward_cli.main(["--hf-dir", str(tmp_path / "hf"), "--input", str(inp),
                                "--output", str(tmp_path / "o.pt")]) == 2
    assert "checksum mismatch" in _one_error(capfd, "hf_forward")
    assert not (tmp_path / "o.pt").exists()


# --------------------------------------------------------------------------------------------- no silent results
def _scale_key(sd):
    return sorted(k for k in sd if k.endswith("mlp.experts.3.down_proj.weight_scale_inv"))[0]


def _set_scale(value):
    def f(sd, cfg):
        k = _scale_key(sd)
        sd[k] = sd[k].clone()
        sd[k][0, 0] = value
    return f


def _dup_across_shards(sd, cfg):
    return {"a.safetensors": sorted(sd)[: len(sd) // 2 + 1], "b.safetensors": sorted(sd)[len(sd) // 2:]}


def _scale_beside_bf16(sd, cfg):
    sd[LM + "layers.0.self_attn.q_proj.weight_scale_inv"] = torch.ones(1, 1)


def _scale_grid(sd, cfg):
    k = _scale_key(sd)
    sd[k] = torch.ones(sd[k].shape[0] + 1, sd[k].shape[1])


def _nan_bf16(sd, cfg):
    k = LM + "layers.0.self_attn.q_proj.weight"
    sd[k] = sd[k].clone()
    sd[k][1, 2] = float("nan")


def _inf_bf16(sd, cfg):
    k = LM + "norm.weight"
    sd[k] = sd[k].clone()
    sd[k][0] = float("inf")


def _int_weight(sd, cfg):
    k = LM + "layers.0.input_layernorm.weight"
    sd[k] = sd[k].to(torch.int32)


def _cfg(**kv):
    def f(sd, cfg):
        cfg["text_config"].update(kv)
    return f


@pytest.mark.parametrize("case,mutate,needle", [
    ("duplicate_across_shards", _dup_across_shards, "duplicate tensor name"),
    ("scale_beside_bf16", _scale_beside_bf16, "not FP8"),
    ("scale_zero", _set_scale(0.0), "must be positive and finite"),
    ("scale_negative", _set_scale(-1.0), "1 <= 0"),
    ("scale_nan", _set_scale(float("nan")), "1 NaN/inf"),
    ("scale_inf", _set_scale(float("inf")), "1 NaN/inf"),
    ("scale_grid", _scale_grid, "does not match weight"),
    ("nan_bf16", _nan_bf16, "q_proj.weight: contains NaN/inf"),
    ("inf_bf16", _inf_bf16, "norm.weight: contains NaN/inf"),
    ("int_weight", _int_weight, "stored as I32"),
    ("bool_string", _cfg(norm_topk_prob="false"), "norm_topk_prob: must be true or false"),
    ("eps_zero", _cfg(rms_norm_eps=0), "rms_norm_eps: must be a positive finite number"),
    ("eps_negative", _cfg(rms_norm_eps=-1e-5), "rms_norm_eps"),
    ("int_string", _cfg(hidden_size="64"), "hidden_size: must be a positive integer"),
])
def test_bad_checkpoint_is_one_line_exit_2_nothing_written(ck, tmp_path, capfd, case, mutate, needle):
    sd, cfg = _tensors(ck["hf"]), _config(ck["hf"])
    shards = mutate(sd, cfg)
    src = _write_hf(tmp_path / "src", sd, cfg, shards=shards)
    before = _tree_digest(src)
    outs = tmp_path / "outs"
    outs.mkdir()
    capfd.readouterr()
    assert _convert(src, outs / "ckpt") == 2
    line = _one_error(capfd, "convert_hf_to_mcore")
    assert needle in line, (case, line)
    assert os.listdir(outs) == [] and _tree_digest(src) == before


@pytest.mark.parametrize("case,batch,needle", [
    ("float_cu_seqlens", {"cu_seqlens": torch.tensor([0.0, 3.0, 8.0])}, "integer tensor"),
    ("decreasing_cu_seqlens", {"cu_seqlens": torch.tensor([0, 5, 3, 8])}, "increase strictly"),
    ("repeated_cu_seqlens", {"cu_seqlens": torch.tensor([0, 3, 3, 8])}, "increase strictly"),
    ("pixel_width", {"pixel_values": torch.zeros(4, 10), "image_grid_thw": torch.tensor([[1, 2, 2]])},
     "C*T*P*P = 1176"),
    ("grid_merge", {"pixel_values": torch.zeros(3, 1176), "image_grid_thw": torch.tensor([[1, 1, 3]])},
     "multiples of vision_config.spatial_merge_size"),
    ("image_tokens", {"pixel_values": torch.zeros(4, 1176), "image_grid_thw": torch.tensor([[1, 2, 2]])},
     "0 image tokens"),
    ("not_a_tensor", {"cu_seqlens": [0, 8]}, "must be a tensor"),
])
def test_hf_forward_inputs_checked_before_the_model_loads(ck, tmp_path, capfd, monkeypatch, case, batch, needle):
    import megatron_glm5.models.builder as builder

    def never(*a, **k):
        raise AssertionError("the model was built before the inputs were checked")

    monkeypatch.setattr(builder, "build_model_from_hf", never)
    inp = tmp_path / "in.pt"
    torch.save({"input_ids": torch.randint(0, 200, (1, 8)), **batch}, inp)
    capfd.readouterr()
    assert hf_forward_cli.main(["--hf-dir", ck["hf"], "--input", str(inp), "--output", str(tmp_path / "o.pt")]) == 2
    assert needle in _one_error(capfd, "hf_forward")
    assert sorted(os.listdir(tmp_path)) == ["in.pt"]


def test_os_errors_are_one_line(ck, tmp_path, capfd, monkeypatch):
    """A full disk while writing, and an --out below a file: one line, exit 2, nothing left."""
    import megatron_glm5.checkpoint.safetensors_io as st

    real = st.SafetensorsStreamWriter.write

    def full_disk(self, name, tensor):
        raise OSError(28, "No space left on device", self.path)

    monkeypatch.setattr(st.SafetensorsStreamWriter, "write", full_disk)
    capfd.readouterr()
    assert _export(ck["mcore"], tmp_path / "out") == 2
    assert "No space left on device" in _one_error(capfd, "convert_mcore_to_hf")
    monkeypatch.setattr(st.SafetensorsStreamWriter, "write", real)
    assert os.listdir(tmp_path) == []
    (tmp_path / "file").write_text("x")
    assert _export(ck["mcore"], tmp_path / "file" / "out") == 2
    assert "not a directory" in _one_error(capfd, "convert_mcore_to_hf")


# --------------------------------------------------------------------------------------------- fuzz
def _fuzz_variants(rng, src_file, n):
    data = open(src_file, "rb").read()
    hlen = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + hlen])
    name = sorted(k for k in header if k != "__metadata__")[0]
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:  # truncated anywhere
            out.append(("truncate", data[: int(rng.integers(0, len(data)))]))
        elif kind == 1:  # random bytes in the length field or the header
            b = bytearray(data)
            for _ in range(int(rng.integers(1, 4))):
                b[int(rng.integers(0, 8 + hlen))] = int(rng.integers(0, 256))
            out.append(("header bytes", bytes(b)))
        elif kind == 2:  # wrong JSON types in one entry
            h = json.loads(data[8:8 + hlen])
            field, value = [("dtype", 5), ("dtype", "F128"), ("shape", "x"), ("shape", [1.5]), ("shape", [-1]),
                            ("data_offsets", [-1, 2]), ("data_offsets", [0]), ("data_offsets", None),
                            ("data_offsets", [0, 10 ** 12])][int(rng.integers(0, 9))]
            h[name][field] = value
            raw = json.dumps(h).encode()
            out.append((f"{field}={value!r}", len(raw).to_bytes(8, "little") + raw + data[8 + hlen:]))
        else:  # the header is not an object / not JSON
            raw = [b"[]", b"null", b"{\"a\": 1}", b"\xff\xfe", b"{" * 5000][int(rng.integers(0, 5))]
            out.append(("header type", len(raw).to_bytes(8, "little") + raw + data[8 + hlen:]))
    return out


def test_fuzz_no_traceback_escapes(ck, tmp_path, capfd):
    import numpy as np

    rng = np.random.default_rng(0)
    src = tmp_path / "src"
    shutil.copytree(ck["hf"], src)
    st_file = src / "model.safetensors"
    pristine = st_file.read_bytes()
    cfg_pristine = (src / "config.json").read_text()
    cases = [("safetensors " + what, st_file, blob) for what, blob in _fuzz_variants(rng, str(st_file), 24)]
    wrong_json = [b"", b"[1, 2]", b"{\"text_config\": 3}", b"{\"text_config\": {\"num_hidden_layers\": \"4\"}}",
                  b"{\"text_config\": {\"layer_types\": 7}}", b"\x00\x01", b"{\"quantization_config\": []}"]
    cases += [("config.json " + repr(b[:30]), src / "config.json", b) for b in wrong_json]
    index = src / "model.safetensors.index.json"
    for blob in (b"{\"weight_map\": []}", b"{\"weight_map\": {\"a\": 1}}", b"[]", b"{\"weight_map\": {\"" + LM.encode()
                 + b"norm.weight\": \"model.safetensors\"}}", b"{bad json"):
        cases.append(("index " + repr(blob[:30]), index, blob))
    codes = []
    for what, path, blob in cases:
        path.write_bytes(blob)
        capfd.readouterr()
        code = _convert(src, tmp_path / "out", "--overwrite")
        err = capfd.readouterr().err
        assert "Traceback" not in err and code in (0, 2), (what, code, err[-500:])
        if code == 2:
            lines = [ln for ln in err.splitlines() if ln.strip()]
            assert len(lines) == 1 and lines[0].startswith("convert_hf_to_mcore: error: "), (what, lines)
        codes.append(code)
        st_file.write_bytes(pristine)
        (src / "config.json").write_text(cfg_pristine)
        if index.exists():
            index.unlink()
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
    assert codes.count(2) >= len(cases) - 3, codes  # (a random byte may land in harmless header padding)
    # the torch_dist side: truncated / random .metadata and .distcp, wrong metadata.json types
    mc = tmp_path / "mc"
    for what in ("truncate_metadata", "random_metadata", "truncate_distcp", "metadata_json_list",
                 "metadata_json_type", "tracker"):
        shutil.copytree(ck["mcore"], mc)
        os.remove(mc / "checksums.sha256")  # exercise the parsers behind the checksum
        distcp = mc / sorted(f for f in os.listdir(mc) if f.endswith(".distcp"))[0]
        load = mc
        if what == "truncate_metadata":
            (mc / ".metadata").write_bytes((mc / ".metadata").read_bytes()[:1000])
        elif what == "random_metadata":
            (mc / ".metadata").write_bytes(rng.integers(0, 256, 4000, dtype=np.uint8).tobytes())
        elif what == "truncate_distcp":
            distcp.write_bytes(distcp.read_bytes()[:5000])
        elif what == "metadata_json_list":
            (mc / "metadata.json").write_text("[1]")
        elif what == "metadata_json_type":
            (mc / "metadata.json").write_text('{"sharded_backend": 3}')
        else:
            (mc / "latest_checkpointed_iteration.txt").write_text("not-a-number")
            os.remove(mc / "metadata.json")
        capfd.readouterr()
        code = _export(load, tmp_path / "out")
        err = capfd.readouterr().err
        assert code == 2 and "Traceback" not in err, (what, code, err[-800:])
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("convert_mcore_to_hf: error: "), (what, lines)
        assert not (tmp_path / "out").exists()
        shutil.rmtree(mc)


def _bad_tracker(root, what):
    tracker = root / "latest_checkpointed_iteration.txt"
    if what == "names_missing":
        tracker.write_text("42")
        return "names iter_0000042, which is not in"
    if what == "binary":
        tracker.write_bytes(b"\xff\xfe\x00\x01")
        return "expected an iteration number or 'release'"
    if what == "huge":
        tracker.write_bytes(b"1" * 100_000)
        return "expected an iteration number or 'release'"
    if what == "negative":
        tracker.write_text("-3")
        return "expected an iteration number or 'release', got '-3'"
    if what == "directory":
        tracker.mkdir()
        return "not a regular file"
    assert what == "fifo"
    os.mkfifo(tracker)  # a reader that opened it would wait forever
    return "not a regular file"


@pytest.mark.parametrize("what", ["names_missing", "binary", "huge", "negative", "directory", "fifo"])
def test_bad_tracker_is_one_line(ck, tmp_path, capfd, what):
    """A save root's tracker is untrusted: anything but a small regular file naming a folder that is there is one
    line, exit 2, nothing written (and never a hang)."""
    root = tmp_path / "save"
    root.mkdir()
    shutil.copytree(ck["mcore"], root / "release")
    needle = _bad_tracker(root, what)
    capfd.readouterr()
    assert _export(root, tmp_path / "out") == 2
    line = _one_error(capfd, "convert_mcore_to_hf")
    assert needle in line, line
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------- transformers' export
def test_checkpoint_without_mtp_weights_runs_in_hf_forward(ck, tmp_path, capfd):
    assert _config(ck["no_mtp"])["text_config"]["num_nextn_predict_layers"] == 1
    assert not [k for k in _tensors(ck["no_mtp"]) if k.startswith(LM + "layers.4.")]
    inp = tmp_path / "in.pt"
    torch.save({"input_ids": torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(1)),
                "cu_seqlens": torch.tensor([0, 5, 12], dtype=torch.int32)}, inp)
    capfd.readouterr()
    assert hf_forward_cli.main(["--hf-dir", ck["no_mtp"], "--input", str(inp), "--output", str(tmp_path / "a.pt")]) == 0
    notices = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert len(notices) == 1 and notices[0].startswith("notice: ") and "no MTP weights" in notices[0], notices
    # the same logits as the checkpoint with MTP removed from its config
    plain = tmp_path / "plain"
    shutil.copytree(ck["no_mtp"], plain)
    cfg = _config(plain)
    del cfg["text_config"]["num_nextn_predict_layers"]
    (plain / "config.json").write_text(json.dumps(cfg))
    assert hf_forward_cli.main(["--hf-dir", str(plain), "--input", str(inp), "--output", str(tmp_path / "b.pt")]) == 0
    assert torch.equal(torch.load(tmp_path / "a.pt")["logits"], torch.load(tmp_path / "b.pt")["logits"])


def test_checkpoint_without_mtp_weights_converts(ck, tmp_path, capfd):
    from megatron.core import dist_checkpointing

    capfd.readouterr()
    assert _convert(ck["no_mtp"], tmp_path / "plain") == 0
    notices = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert len(notices) == 1 and "no MTP weights" in notices[0] and "--mtp-init" in notices[0], notices
    keys = dist_checkpointing.load_plain_tensors(str(tmp_path / "plain" / "release")).keys()
    assert not [k for k in keys if k.startswith("mtp.")]
    with open(tmp_path / "plain" / "release" / "hf_config.json") as fh:
        assert "num_nextn_predict_layers" not in json.load(fh)["text_config"]
    # --mtp-init: a fresh MTP layer (megatron's init: norms at 1, projections ~ N(0, initializer_range))
    capfd.readouterr()
    assert _convert(ck["no_mtp"], tmp_path / "fresh", "--mtp-init") == 0
    notices = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert len(notices) == 1 and "writing a freshly initialised MTP layer (--mtp-init)" in notices[0], notices
    t = dist_checkpointing.load_plain_tensors(str(tmp_path / "fresh" / "release"))
    assert torch.equal(t["mtp.layers.0.enorm.weight"].float(), torch.ones(64))
    eh = t["mtp.layers.0.eh_proj.weight"].float()
    assert eh.shape == (64, 128) and 0.015 < eh.std().item() < 0.025
    plain = dist_checkpointing.load_plain_tensors(str(tmp_path / "plain" / "release"))
    assert all(torch.equal(v, t[k]) for k, v in plain.items() if torch.is_tensor(v))  # the rest is the checkpoint's
    # and it exports back to HF with the MTP layer
    assert _export(tmp_path / "fresh", tmp_path / "back") == 0
    assert LM + "layers.4.eh_proj.weight" in _tensors(str(tmp_path / "back"))
    capfd.readouterr()
    assert _convert(ck["hf"], tmp_path / "x", "--mtp-init") == 2  # it already has MTP weights
    assert "already holds MTP weights" in _one_error(capfd, "convert_hf_to_mcore")
