"""What a training run reads from ``--load`` / ``--pretrained-checkpoint``, as a hostile or careless user meets it:
no code runs from a checkpoint (crafted ``.metadata``, crafted byte items inside a ``.distcp``, in a training save and
in a converter output whose manifest was regenerated), a flipped, truncated or symlinked file is one line, a
checkpoint of another size (with or without ``hf_config.json``) or optimizer state this run cannot resume is one line
naming the flag to use, and tracker files of any bytes are one line. Every refusal: its exit status, a single stderr
line, no traceback, and the checkpoint byte-identical afterwards."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import pickle
import random
import shutil

import pytest
import torch

from tests.training_harness import TINY, error_lines, run

TRAIN = TINY + ["--mock-data", "--train-iters", "3"]
PROG = "pretrain_glm5_vlm.py: error: "


# --------------------------------------------------------------------------------------------- helpers
def _tree_digest(path) -> dict:
    """{relative path: sha256 (or link target)} of everything under ``path``."""
    out = {}
    for dp, dirs, fs in os.walk(path):
        for f in fs + [d for d in dirs if os.path.islink(os.path.join(dp, d))]:
            p = os.path.join(dp, f)
            if os.path.islink(p):
                out[os.path.relpath(p, path)] = "-> " + os.readlink(p)
            else:
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _refused(args, ckpt_root, status: int, *needles: str) -> str:
    """Run the trainer, expect exit ``status`` with one ``pretrain_glm5_vlm.py: error:`` line holding ``needles``,
    no traceback, and ``ckpt_root`` unchanged; returns the line."""
    before = _tree_digest(ckpt_root)
    proc = run(args)
    lines = error_lines(proc)
    assert proc.returncode == status, (proc.returncode, proc.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith(PROG), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert _tree_digest(ckpt_root) == before
    return lines[0]


class _RunsCode:
    """Unpickled, it writes ``marker`` (what a crafted checkpoint would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _metadata(ckpt):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(ckpt)).read_metadata()


def _write_metadata(ckpt, md) -> None:
    md.__dict__.pop("_glm5_dir", None)
    with open(os.path.join(ckpt, ".metadata"), "wb") as fh:
        pickle.dump(md, fh)


def _regenerate_manifests(ckpt) -> None:
    """What an attacker (or a careless tool) does after editing a checkpoint: the manifests describe the new files."""
    from megatron.core.dist_checkpointing.validation import save_integrity_manifest

    from megatron_glm5.checkpoint.checksums import INTEGRITY_FILE, MANIFEST_FILE, write_manifest

    if os.path.exists(os.path.join(ckpt, MANIFEST_FILE)):
        write_manifest(str(ckpt))
    if os.path.exists(os.path.join(ckpt, INTEGRITY_FILE)):
        save_integrity_manifest(str(ckpt))


def _craft_metadata(ckpt, marker) -> None:
    with open(os.path.join(ckpt, ".metadata"), "wb") as fh:
        pickle.dump(_RunsCode(marker), fh)
    _regenerate_manifests(ckpt)


def _craft_byte_item(ckpt, prefix: str, marker) -> str:
    """Replace the byte item whose key starts with ``prefix`` by ``torch.save`` bytes of a pickle that runs code
    (appended to its ``.distcp``; ``.metadata`` points at them); returns '<.distcp path> (item <key>'."""
    md = _metadata(ckpt)
    index = next(i for i in md.storage_data if i.fqn.startswith(prefix))
    info = md.storage_data[index]
    buf = io.BytesIO()
    torch.save({"state": _RunsCode(marker)}, buf)
    path = os.path.join(ckpt, info.relative_path)
    info.offset, info.length = os.path.getsize(path), len(buf.getvalue())
    with open(path, "ab") as fh:
        fh.write(buf.getvalue())
    _write_metadata(ckpt, md)
    _regenerate_manifests(ckpt)
    return f"{path} (item {index.fqn}"


# --------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A save root of the trainer: its tracker names iter_0000002 (hf_config.json, parallel_layout.json,
    megatron-core's integrity.json)."""
    root = tmp_path_factory.mktemp("saved") / "ck"
    proc = run(TRAIN + ["--save", str(root), "--save-interval", "2", "--exit-interval", "2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (root / "iter_0000002" / "integrity.json").is_file()
    return root


@pytest.fixture(scope="module")
def converted(tmp_path_factory, mcore):
    """The converter's output (tracker 'release' + release/ with checksums.sha256) of the tiny preset's model."""
    from megatron_glm5.cli import convert_hf_to_mcore as to_mcore_cli
    from megatron_glm5.cli.make_tiny_hf_checkpoint import write_checkpoint
    from megatron_glm5.config import tiny_hf_config

    root = tmp_path_factory.mktemp("converted")
    hf = write_checkpoint(str(root / "hf"), tiny_hf_config(mtp=True), fmt="fp32", mtp=True, seed=3)
    assert to_mcore_cli.main(["--hf-dir", hf, "--out", str(root / "mcore"), "--dtype", "fp32", "--no-progress"]) == 0
    return root / "mcore"


@pytest.fixture
def copy_of(tmp_path):
    def copy(src):
        dst = tmp_path / "ck"
        shutil.copytree(src, dst, symlinks=True)
        return dst
    return copy


# --------------------------------------------------------------------------------------------- no code runs
@pytest.mark.parametrize("flag, what", [("--load", "metadata"), ("--load", "rng_state"),
                                        ("--pretrained-checkpoint", "metadata"),
                                        ("--pretrained-checkpoint", "decoder.layers.0.self_attention")])
def test_crafted_checkpoint_runs_no_code(saved, converted, copy_of, tmp_path, flag, what):
    """A crafted ``.metadata`` or byte item (the RNG state, a layer's ``_extra_state``), its manifest regenerated:
    refused with one line naming the file, exit 1, the payload never runs."""
    root = copy_of(saved if flag == "--load" else converted)
    ckpt = root / ("iter_0000002" if flag == "--load" else "release")
    marker = tmp_path / "attacker_ran"
    if what == "metadata":
        _craft_metadata(ckpt, marker)
        needle = str(ckpt / ".metadata")
    else:
        needle = _craft_byte_item(ckpt, what, marker)
    line = _refused(TRAIN + [flag, str(root)], root, 1, needle, "refused to load", "exec")
    assert "crafted to run code" in line
    assert not marker.exists()


def test_byte_items_load_weights_only(saved):
    """Every byte item of a training checkpoint (common state with args / optimizer / scheduler / rerun state, RNG
    state, _extra_state) loads through the weights-only path the guards use."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from megatron_glm5.checkpoint.safe_load import load_byte_item

    ckpt = saved / "iter_0000002"
    md = _metadata(ckpt)
    items = {i: info for i, info in md.storage_data.items()
             if isinstance(md.state_dict_metadata[i.fqn], BytesStorageMetadata)}
    assert any(i.fqn.startswith("common_state") for i in items) and any(i.fqn.startswith("rng_state") for i in items)
    for index, info in items.items():
        with open(ckpt / info.relative_path, "rb") as fh:
            fh.seek(info.offset)
            data = io.BytesIO(fh.read(info.length))
        obj = load_byte_item(data, index.fqn)
        if index.fqn.startswith("common_state"):
            state = obj[0]  # megatron-core saves the common state as a one-item list
            assert isinstance(state["args"], argparse.Namespace) and state["iteration"] == 2 and "optimizer" in state


# --------------------------------------------------------------------------------------------- integrity
def _flip(path, at):
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("damage", ["flip", "truncate", "truncate_no_manifest", "symlink", "storage_path_out"])
def test_damaged_checkpoint_is_one_line(saved, copy_of, damage):
    root = copy_of(saved)
    ckpt = root / "iter_0000002"
    distcp = ckpt / "__0_0.distcp"
    status = 1
    if damage == "flip":
        _flip(distcp, os.path.getsize(distcp) // 2)
        needles = (str(distcp), "checksum mismatch")
    elif damage.startswith("truncate"):
        os.truncate(distcp, os.path.getsize(distcp) // 2)
        if damage == "truncate_no_manifest":
            os.remove(ckpt / "integrity.json")
            needles = (str(distcp), "truncated")
        else:
            needles = (str(distcp), "checksum mismatch")
    elif damage == "symlink":
        os.symlink("/etc/hostname", ckpt / "notes.txt")
        status, needles = 2, ("--load", str(ckpt / "notes.txt"), "symbolic link")
    else:  # .metadata names a storage file outside the checkpoint
        md = _metadata(ckpt)
        for info in md.storage_data.values():
            info.relative_path = "../../outside.distcp"
        _write_metadata(ckpt, md)
        _regenerate_manifests(ckpt)
        needles = (str(ckpt / ".metadata"), "outside")
    _refused(TRAIN + ["--load", str(root)], root, status, *needles)


def test_manifest_written_before_the_tracker_moves_and_lists_every_file(saved):
    """megatron-core's integrity.json lists every file of the checkpoint, hf_config.json and parallel_layout.json
    included (written before the save), and verifies."""
    from megatron_glm5.checkpoint.checksums import read_integrity_manifest, verify_manifest

    ckpt = str(saved / "iter_0000002")
    listed = read_integrity_manifest(ckpt)
    assert set(listed) == set(os.listdir(ckpt)) - {"integrity.json"}
    assert {"hf_config.json", "parallel_layout.json", ".metadata", "metadata.json"} <= set(listed)
    assert verify_manifest(ckpt) is True


# --------------------------------------------------------------------------------------------- another model
def _hf_config_dir(tmp_path, change) -> str:
    from megatron_glm5.config import tiny_hf_config

    cfg = tiny_hf_config(mtp=True)
    change(cfg["text_config"])
    d = tmp_path / "hf_config"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _fewer_layers(t):
    t.update(num_hidden_layers=2, layer_types=t["layer_types"][:2], mlp_layer_types=t["mlp_layer_types"][:2])


CHANGES = {
    "hc_mult": (lambda t: t.update(hc_mult=2), "attn_hc"),
    "num_hidden_layers": (_fewer_layers, "decoder.layers.2."),
    "num_nextn_predict_layers": (lambda t: t.update(num_nextn_predict_layers=0), "mtp.layers.0."),
    "n_routed_experts": (lambda t: t.update(n_routed_experts=4), "router.weight"),
}


@pytest.mark.parametrize("key", sorted(CHANGES))
def test_architecture_check_names_the_field(saved, key):
    from megatron_glm5.config import tiny_hf_config
    from megatron_glm5.training.checkpoint_checks import CheckpointDirError, check_architecture

    cfg = tiny_hf_config(mtp=True)
    CHANGES[key][0](cfg["text_config"])
    with pytest.raises(CheckpointDirError, match=f"another architecture: {key} is"):
        check_architecture(str(saved / "iter_0000002"), cfg)


@pytest.mark.parametrize("key", ["hc_mult", "num_hidden_layers"])
def test_checkpoint_of_another_size_without_hf_config_is_refused(saved, copy_of, tmp_path, key):
    """No hf_config.json to compare: the checkpoint's tensors (keys, global shapes) against this model's."""
    root = copy_of(saved)
    ckpt = root / "iter_0000002"
    os.remove(ckpt / "hf_config.json")
    _regenerate_manifests(ckpt)
    change, needle = CHANGES[key]
    base = [a for a in TRAIN if a not in ("--model-preset", "glm5-tiny")]
    _refused(base + ["--hf-config", _hf_config_dir(tmp_path, change), "--load", str(root)], root, 1, str(ckpt),
             needle, "another architecture")


@pytest.mark.parametrize("key", sorted(CHANGES))
def test_tensor_check_refuses_every_size_change(saved, mcore, key):
    """In process: a model of another hc_mult / layer count / MTP layers / experts against the saved checkpoint's
    tensors; the model of the run itself passes."""
    from megatron_glm5.config import Glm5Config, tiny_hf_config
    from megatron_glm5.models.builder import build_model
    from megatron_glm5.training.checkpoint_checks import CheckpointDirError, check_tensors_match

    ckpt = str(saved / "iter_0000002")
    same = tiny_hf_config(mtp=True)
    with torch.device("meta"):
        check_tensors_match(build_model(Glm5Config.from_hf(same)).sharded_state_dict(), ckpt)
        other = tiny_hf_config(mtp=True)
        CHANGES[key][0](other["text_config"])
        model = build_model(Glm5Config.from_hf(other))
    with pytest.raises(CheckpointDirError, match=CHANGES[key][1]):
        check_tensors_match(model.sharded_state_dict(), ckpt)


# --------------------------------------------------------------------------------------------- optimizer state
def test_distributed_optimizer_switched_is_one_line(saved, copy_of):
    """Saved without --use-distributed-optimizer, resumed with it: refused up front (parallel_layout.json, exit 2)
    and, for a checkpoint without that file, from the saved run's args while loading (exit 1)."""
    root = copy_of(saved)
    ckpt = root / "iter_0000002"
    args = TRAIN + ["--load", str(root), "--use-distributed-optimizer"]
    _refused(args, root, 2, "--load", "saved without --use-distributed-optimizer", "--no-load-optim")
    os.remove(ckpt / "parallel_layout.json")
    _regenerate_manifests(ckpt)
    _refused(args, root, 1, str(ckpt), "saved without --use-distributed-optimizer", "--no-load-optim")


def _run_args(**kw):
    base = dict(finetune=False, no_load_optim=False, use_distributed_optimizer=False, expert_model_parallel_size=1,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("saved_args, run, needle", [
    (dict(no_save_optim=True), {}, "--no-load-optim"),
    (dict(use_distributed_optimizer=True), {}, "saved with --use-distributed-optimizer"),
    (dict(use_distributed_optimizer=False), dict(use_distributed_optimizer=True), "saved without"),
    (dict(use_distributed_optimizer=True, expert_model_parallel_size=2), dict(use_distributed_optimizer=True),
     "EP 2"),
])
def test_resume_refusals(saved_args, run, needle):
    """The optimizer state a checkpoint's common state / parallel_layout.json describe against this run's flags;
    nothing to say with --no-load-optim or --finetune."""
    from megatron_glm5.training.checkpoint_checks import CheckpointDirError, check_resume_state, resume_refusal

    common = {"iteration": 2, "args": argparse.Namespace(**{k: v for k, v in saved_args.items()
                                                            if k != "no_save_optim"})}
    if not saved_args.get("no_save_optim"):
        common["optimizer"] = {}
    with pytest.raises(CheckpointDirError, match=needle):
        check_resume_state("/ck/iter_0000002", common, _run_args(**run))
    for ok in (dict(no_load_optim=True), dict(finetune=True)):
        assert resume_refusal("/ck/iter_0000002", dict(saved_args), _run_args(**{**run, **ok})) is None


def test_dp_reshardable_state_in_another_buffer_order_is_refused():
    """parallel_layout.json records the order of the distributed optimizer's buffer (the DP-reshardable format
    stores the optimizer state in it): another order, or none recorded (megatron-core's own), is refused unless
    the optimizer state is left out or was saved fully reshardable (per parameter)."""
    from megatron_glm5.models.grouped_experts import BUFFER_LAYOUT
    from megatron_glm5.training.checkpoint_checks import layout_record, resume_refusal

    run = _run_args(use_distributed_optimizer=True, context_parallel_size=1, expert_tensor_parallel_size=1,
                    data_parallel_size=1, dist_ckpt_optim_fully_reshardable=False, no_save_optim=False)
    saved = layout_record(run)
    assert saved["buffer_layout"] == BUFFER_LAYOUT
    assert resume_refusal("/ck/iter_0000002", saved, run, layout_file=True) is None
    for other in (None, "expert-order-0"):
        old = dict(saved, buffer_layout=other)
        assert "--no-load-optim" in resume_refusal("/ck/iter_0000002", old, run, layout_file=True)
        assert resume_refusal("/ck/iter_0000002", dict(old, dist_ckpt_optim_fully_reshardable=True), run,
                              layout_file=True) is None
        assert resume_refusal("/ck/iter_0000002", old, _run_args(**{**vars(run), "no_load_optim": True}),
                              layout_file=True) is None


# --------------------------------------------------------------------------------------------- trackers
def test_tracker_fuzz_in_process(tmp_path):
    """Random tracker bytes: read_tracker names a folder exactly as Megatron-LM's reader (int(text.strip())) would,
    or raises one CheckpointDirError line; nothing else escapes."""
    from megatron_glm5.checkpoint.tracker import TRACKER_FILE, CheckpointDirError, read_tracker

    rng = random.Random(34)
    pieces = [b"", b" ", b"\n", b"\t", b"0", b"7", b"12", b"release", b"-", b"+", b"_", b"\xb2", "²".encode(),
              b"\x00", b"\xff\xfe", b"\x0b", "\u00a0".encode(), "٣".encode(), b"e3", b"1" * 70, b"\r\n"]
    tracker = tmp_path / TRACKER_FILE
    accepted = 0
    for i in range(3000):
        if i % 3 == 0:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 80)))
        else:
            data = b"".join(rng.choice(pieces) for _ in range(rng.randrange(0, 5)))
        tracker.write_bytes(data)
        try:
            name = read_tracker(str(tmp_path))
        except CheckpointDirError as e:
            assert "\n" not in str(e) and str(e).startswith(str(tracker)), (data, str(e))
            continue
        text = data.decode("ascii").strip()
        assert name == ("release" if text == "release" else f"iter_{int(text):07d}"), (data, name)
        accepted += 1
    assert accepted > 100


@pytest.mark.parametrize("what", ["superscript", "directory"])
def test_bad_tracker_end_to_end(saved, copy_of, what):
    root = copy_of(saved)
    tracker = root / "latest_checkpointed_iteration.txt"
    tracker.unlink()
    if what == "superscript":
        tracker.write_text("²", encoding="utf-8")
    else:
        tracker.mkdir()
    _refused(TRAIN + ["--load", str(root)], root, 2, "--load", str(tracker))


def test_resume_with_another_schedule_is_one_line(saved):
    """--train-iters changed since the save: megatron-core's scheduler assertion becomes one line naming the flags."""
    args = [a if a != "3" else "5" for a in TRAIN] + ["--load", str(saved)]
    assert "--train-iters" in args and args[args.index("--train-iters") + 1] == "5"
    _refused(args, saved, 1, f"--load {saved}", "--train-iters", "--override-opt_param-scheduler",
             "--use-checkpoint-opt_param-scheduler")


@pytest.mark.parametrize("name, content", [
    ("hf_config.json", "[" * 100_000), ("metadata.json", "[1, 2]"), ("parallel_layout.json", "\"x\""),
    ("integrity.json", "{\"files\": {\"../x\": \"00\"}}"), ("integrity.json", "\xff"),
    ("metadata.json", "{\"sharded_backend\": \"zarr\"}"),
])
def test_checkpoint_json_files_of_any_content_are_one_line(saved, copy_of, name, content):
    """The JSON files the checks read (hf_config.json, metadata.json, parallel_layout.json, integrity.json), of
    any content: one CheckpointError line naming the file."""
    from megatron_glm5.checkpoint.checksums import verify_manifest
    from megatron_glm5.checkpoint.errors import CheckpointError
    from megatron_glm5.config import tiny_hf_config
    from megatron_glm5.training.checkpoint_checks import (
        check_architecture,
        check_checkpoint_folder,
        check_resume_layout,
    )

    root = copy_of(saved)
    ckpt = root / "iter_0000002"
    (ckpt / name).write_bytes(b"\xff" if content == "\xff" else content.encode())

    with pytest.raises(CheckpointError) as info:
        check_architecture(str(ckpt), tiny_hf_config(mtp=True))
        check_checkpoint_folder(str(ckpt))
        check_resume_layout(str(ckpt), _run_args())
        verify_manifest(str(ckpt))
    assert str(ckpt / name) in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_torch_dcp_reads_run_code_upstream_and_not_guarded(tmp_path):
    """torch DCP's own FileSystemReader.read_metadata (pickle.load) and DefaultLoadPlanner.load_bytes
    (torch.load(weights_only=False)), which megatron-core's torch_dist load uses, run a crafted pickle; the guards
    installed by install_patches refuse it."""
    from types import SimpleNamespace

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from megatron_glm5.checkpoint.safe_load import UnsafeCheckpointError

    marker = tmp_path / "ran"
    _craft_metadata(tmp_path, marker)
    reader = FileSystemReader(str(tmp_path))
    with pytest.raises(UnsafeCheckpointError, match="builtins.exec"):
        reader.read_metadata()
    assert not marker.exists()
    with pytest.raises(Exception):  # noqa: B017 - the payload returns None, not Metadata: torch fails after running it
        FileSystemReader.read_metadata.upstream(reader)
    assert marker.exists()
    marker.unlink()

    buf = io.BytesIO()
    torch.save({"state": _RunsCode(marker)}, buf)
    planner = DefaultLoadPlanner(flatten_state_dict=False)
    planner.state_dict, planner.metadata = {}, SimpleNamespace(storage_data={})
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="rng_state"), storage_index=None)
    with pytest.raises(UnsafeCheckpointError, match="item rng_state"):
        planner.load_bytes(item, io.BytesIO(buf.getvalue()))
    assert not marker.exists() and planner.state_dict == {}
    DefaultLoadPlanner.load_bytes.upstream(planner, item, io.BytesIO(buf.getvalue()))
    assert marker.exists()


def test_manifest_shares_split_the_files_and_together_catch_a_flip(tmp_path):
    """verify_manifest's shares (one per rank) re-hash disjoint files that together cover the manifest: a flipped
    file is refused by the one share that holds it and passes the others."""
    from megatron_glm5.checkpoint.checksums import ChecksumError, verify_manifest, write_integrity_manifest

    for i in range(5):
        (tmp_path / f"__{i}_0.distcp").write_bytes(bytes([i]) * (100 + i))
    write_integrity_manifest(str(tmp_path))
    assert all(verify_manifest(str(tmp_path), share=(r, 3)) for r in range(3))
    names = sorted(n for n in os.listdir(tmp_path) if n.endswith(".distcp"))
    target = tmp_path / names[4]  # the fifth file in name order: share 4 % 3 = 1
    data = bytearray(target.read_bytes())
    data[7] ^= 1
    target.write_bytes(bytes(data))
    caught = []
    for r in range(3):
        try:
            verify_manifest(str(tmp_path), share=(r, 3))
        except ChecksumError as e:
            caught.append((r, str(e)))
    assert [r for r, _ in caught] == [1] and caught[0][1].startswith(f"{target}: checksum mismatch"), caught
