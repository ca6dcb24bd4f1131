"""Megatron-Energon as a ``--dataset-type chat`` source: datasets prepared by the test with ``energon prepare``
(``VQASample`` with a field map, and ``CrudeWebdataset`` multi-turn conversations with images and videos), a
metadataset blend; the same documents as the map-style source; the loader state saved in the checkpoint (JSON,
nothing unpickled) so that a killed and resumed run trains on exactly the rows of a straight run."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_glm5.config import Glm5Config, tiny_hf_config
from megatron_glm5.data import DataError
from megatron_glm5.data.chat_template import build_processor, build_video_processor, load_chat_template
from megatron_glm5.data.conversations import ChatDocuments, read_conversations
from megatron_glm5.data.energon import build_energon_loader, decode_state, encode_state, energon_class
from megatron_glm5.data.tiny_data import make_chat_webdataset, make_vqa_webdataset, write_tiny_hf_assets
from megatron_glm5.data.vqa import build_image_processor
from training_harness import TINY, error_lines, run, scalars

ENERGON = os.path.join(os.path.dirname(sys.executable), "energon")


def _prepare(folder, *extra):
    proc = subprocess.run([ENERGON, "prepare", str(folder), "--non-interactive", "--split-ratio", "1,0,0",
                           "--num-workers", "1", "--no-progress", *extra], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (folder / ".nv-meta" / "dataset.yaml").is_file()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("energon")
    hf = tiny_hf_config()
    write_tiny_hf_assets(str(root / "hf"), hf)
    (root / "vqa").mkdir()
    make_vqa_webdataset(str(root / "vqa" / "a.tar"), 6, key_prefix="a")
    make_vqa_webdataset(str(root / "vqa" / "b.tar"), 6, seed=1, key_prefix="b")
    _prepare(root / "vqa", "--sample-type", "VQASample", "--field-map",
             json.dumps({"image": "png", "context": "json[question]", "answers": "json[answer]"}))
    (root / "chat").mkdir()
    make_chat_webdataset(str(root / "chat" / "a.tar"), 8, key_prefix="a")
    make_chat_webdataset(str(root / "chat" / "b.tar"), 8, seed=1, key_prefix="b")
    _prepare(root / "chat", "--sample-type", "CrudeWebdataset")
    (root / "blend.yaml").write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n"
                                     "    blend:\n      - weight: 1\n        path: vqa\n"
                                     "      - weight: 3\n        path: chat\n")
    cfg = Glm5Config.from_hf(hf)
    proc = build_processor(str(root / "hf"), load_chat_template(str(root / "hf")),
                           build_image_processor(cfg.vision), build_video_processor(cfg.vision))
    return root, cfg, proc


def _loader(env, path, micro=1):
    root, cfg, proc = env
    return build_energon_loader(str(path), ChatDocuments([], proc, cfg, eod=0), 256, 0, micro, 0, 1, 0, 1234, 16, 0)


def test_vqa_samples_are_the_map_style_documents(env):
    root, cfg, proc = env
    enc = energon_class("ChatTaskEncoder")(ChatDocuments([], proc, cfg, eod=0), 256, 0)
    ref = ChatDocuments(read_conversations([str(root / "vqa" / "a.tar")]), proc, cfg, eod=0)
    it = _loader(env, root / "vqa")
    rows = [next(it) for _ in range(4)]
    seen = set()
    for r in rows:
        cu = r["cu_seqlens"].tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            seen.add(tuple(r["tokens"][0, a:b].tolist()))
    assert any(tuple(t.tolist()) in seen for t in ref.tokens)  # the same token ids as the JSONL / tar reader
    assert all("pixel_values" in r for r in rows) and enc.seq_length == 256


def test_chat_samples_blend_and_exact_restore(env):
    root, cfg, proc = env
    for path in (root / "chat", root / "blend.yaml"):
        it = _loader(env, path)
        first = [next(it) for _ in range(3)]
        state = it.save_state()
        assert isinstance(state, str) and json.loads(state)
        after = [next(it) for _ in range(4)]
        again = _loader(env, path)
        again.restore(decode_state(state, "state"))
        for x, y in zip(after, [next(again) for _ in range(4)]):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        keys = set().union(*(r.keys() for r in first + after))
        if path.name == "chat":
            assert {"pixel_values", "pixel_values_videos", "video_grid_thw"} <= keys


def test_state_json_round_trip_and_refusals():
    from megatron.energon.state import FlexState

    state = {"a": (1, b"\x00\xff", [FlexState(x=np.arange(3, dtype=np.int64))]), "t": torch.tensor([1.5])}
    back = decode_state(encode_state(state), "s")
    assert back["a"][:2] == (1, b"\x00\xff") and isinstance(back["a"][2][0], FlexState)
    assert np.array_equal(back["a"][2][0]["x"], np.arange(3)) and torch.equal(back["t"], torch.tensor([1.5]))
    for bad in ('{"__dataclass__": "os:system", "fields": {}}', '{"__ndarray__": {"dtype": "|O", "shape": [1], '
                '"data": "AA=="}}', "not json"):
        with pytest.raises(DataError) as e:
            decode_state(bad, "ck/train_dataloader_dprank000.pt")
        assert "ck/train_dataloader_dprank000.pt: not an Energon loader state" in str(e.value)


def test_killed_and_resumed_run_equals_a_straight_run(env, tmp_path):
    """6 steps straight == 3 steps, a save killed at step 6, resume from 3 with the loader state of the checkpoint,
    3 more steps: the same losses (the rows of steps 4-6 are the same)."""
    root, cfg, proc = env
    args = list(TINY)
    args[args.index("--seq-length") + 1] = "256"
    common = args + ["--dataset-type", "chat", "--tokenizer-model", str(root / "hf"), "--data-path",
                     str(root / "chat"), "--train-iters", "6", "--moe-aux-loss-coeff", "1e-3"]
    a = run(common + ["--tensorboard-dir", str(tmp_path / "tba")])
    assert a.returncode == 0, a.stderr[-3000:]
    b = run(common + ["--save", str(tmp_path / "b"), "--save-interval", "3", "--test-kill-during-save", "6"])
    assert b.returncode == -9, (b.returncode, b.stderr[-2000:])
    ck = tmp_path / "b" / "iter_0000003"
    assert "train_dataloader_dprank000.pt" in json.loads((ck / "integrity.json").read_text())["files"]
    c = run(common + ["--save", str(tmp_path / "b"), "--load", str(tmp_path / "b"), "--save-interval", "100",
                      "--tensorboard-dir", str(tmp_path / "tbc")])
    assert c.returncode == 0, c.stderr[-3000:]
    la, lc = dict(scalars(tmp_path / "tba")["lm loss"]), dict(scalars(tmp_path / "tbc")["lm loss"])
    assert sorted(lc) == [4, 5, 6] and all(la[i] == lc[i] for i in (4, 5, 6)), (la, lc)
    assert scalars(tmp_path / "tbc")["data/video-tokens"][-1][1] > 0
    assert 0.3 < scalars(tmp_path / "tbc")["packing-efficiency"][-1][1] <= 1.0  # of the streamed rows


def test_bad_energon_samples_are_skipped_with_a_notice(env, tmp_path, capfd):
    import io
    import tarfile

    root, cfg, proc = env
    d = tmp_path / "bad"
    d.mkdir()
    make_chat_webdataset(str(d / "a.tar"), 4, key_prefix="a")
    with tarfile.open(d / "b.tar", "w") as tf:
        for name, data in (("b0.json", b"{not json"),
                           ("b1.json", json.dumps({"messages": [
                               {"role": "user", "content": [{"type": "image", "image": "0.png"}]},
                               {"role": "assistant", "content": "x"}]}).encode()),
                           ("b2.json", json.dumps({"messages": [{"role": "user", "content": "hi <|image|>"},
                                                                {"role": "assistant", "content": "x"}]}).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    _prepare(d, "--sample-type", "CrudeWebdataset")
    it = _loader(env, d)
    rows = [next(it) for _ in range(6)]
    out = capfd.readouterr()
    assert sum(int(r["skipped_documents"].sum()) for r in rows) >= 2
    assert "has no part '0.png'" in out.out and "holds the special token '<|image|>'" in out.out
    assert "notice: an Energon sample: b.tar:b0.json: bad JSON" in out.out
    assert "Traceback" not in out.out + out.err


# ------------------------------------------------------------------------------- configs that would run code
EVIL_PY = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n\n\ndef part_filter(part):\n    return True\n"
CRUDE = "__module__: megatron.energon\n__class__: CrudeWebdataset\n"
VQA = ("sample_type:\n  __module__: megatron.energon\n  __class__: VQASample\nfield_map:\n  image: png\n"
       "  context: json[question]\n  answers: json[answer]\n")
RUN = "{pad}__module__: subprocess\n{pad}__function__: run\n{pad}args: [touch, {marker}]\n"


def _evil_copy(root, tmp_path, name, dataset_yaml):
    """A copy of the prepared dataset ``name`` whose ``dataset.yaml`` is ``dataset_yaml``, with ``.nv-meta/evil.py``
    (it writes the marker file when evaluated); the copy's folder and the marker path."""
    import shutil

    marker = tmp_path / "marker"
    d = tmp_path / name
    shutil.copytree(root / name, d)
    (d / ".nv-meta" / "evil.py").write_text(EVIL_PY.format(marker=str(marker)))
    (d / ".nv-meta" / "dataset.yaml").write_text(dataset_yaml.format(marker=marker, run=RUN.format(
        pad="    ", marker=marker)))
    return d, marker


PAYLOADS = {
    # name: (dataset, dataset.yaml, metadataset yaml or None, the file the refusal names, the key it names)
    "part_filter": ("chat", CRUDE + "part_filter: evil.py:part_filter\n", None, "dataset.yaml", "part_filter"),
    "sample_loader": ("chat", CRUDE + "sample_loader: evil.py:part_filter\npart_filter: [json]\n", None,
                      "dataset.yaml", "sample_loader"),
    "subflavors": ("chat", CRUDE + "subflavors:\n  x:\n{run}", None, "dataset.yaml", "subflavors.x.__module__"),
    "class": ("chat", "__module__: subprocess\n__function__: run\nargs: [touch, {marker}]\n", None, "dataset.yaml",
              "__function__"),
    "sample_type": ("vqa", VQA.replace("__class__: VQASample", "__class__: Popen").replace(
        "megatron.energon", "subprocess"), None, "dataset.yaml", "sample_type.__class__"),
    "blend_entry": ("chat", CRUDE, "splits:\n  train:\n    blend:\n      - weight: 1\n        path: chat\n"
                    "      - weight: 1\n        path: chat\n{run}", "blend.yaml", "splits.train.blend[1].__module__"),
    "blend_subflavors": ("chat", CRUDE, "splits:\n  train:\n    blend:\n      - weight: 1\n        path: chat\n"
                         "        subflavors:\n          x:\n{run}", "blend.yaml",
                         "splits.train.blend[0].subflavors.x.__module__"),
    "join": ("chat", CRUDE, "splits:\n  train:\n    join:\n      - path: chat\n      - path: chat\n    joiner:\n{run}",
             "blend.yaml", "splits.train.join"),
}


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_configs_naming_code_are_refused_and_nothing_runs(env, tmp_path, name):
    """Each payload is refused by ``build_energon_loader`` in one line naming the file and the key; the marker file
    the payload would write never appears."""
    root = env[0]
    ds, yaml_text, mds, file, key = PAYLOADS[name]
    d, marker = _evil_copy(root, tmp_path, ds, yaml_text)
    path = d
    if mds is not None:
        path = tmp_path / "blend.yaml"
        path.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\n" + mds.format(
            run=RUN.format(pad=" " * (12 if "subflavors" in name else 8 if name == "blend_entry" else 6),
                           marker=marker)))
    with pytest.raises(DataError) as e:
        _loader(env, path)
    msg = str(e.value)
    where = str(path if mds is not None else d / ".nv-meta" / file)
    assert msg.startswith(f"{where}: {key}: ") and "\n" not in msg, msg
    assert not marker.exists()


@pytest.mark.parametrize("name", ["part_filter", "subflavors", "blend_subflavors"])
def test_the_payloads_run_under_energons_own_loader(env, tmp_path, name):
    """The payloads of the refusal test are live: Energon's own ``get_train_dataset`` on the same files writes the
    marker (what the check keeps from happening)."""
    from megatron.energon import WorkerConfig, get_train_dataset

    root = env[0]
    ds, yaml_text, mds, _, _ = PAYLOADS[name]
    d, marker = _evil_copy(root, tmp_path, ds, yaml_text)
    path = d
    if mds is not None:
        path = tmp_path / "blend.yaml"
        path.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\n" + mds.format(
            run=RUN.format(pad=" " * 12, marker=marker)))
    try:
        get_train_dataset(str(path), batch_size=1, shuffle_buffer_size=None, max_samples_per_sequence=None,
                          worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    except Exception:  # noqa: BLE001 - the payload's return value need not make a valid config; it has run by then
        pass
    assert marker.read_text() == "ran" if name == "part_filter" else marker.exists()


def test_plain_configs_still_load(env, tmp_path):
    """The whitelist keeps plain Energon features: a list ``part_filter``, plain ``subflavors``, a nested
    metadataset with ``blend_epochized`` and a ``subset``."""
    root = env[0]
    d, _ = _evil_copy(root, tmp_path, "chat", CRUDE + "part_filter: [json, png, mp4, '0.png', '0.mp4', '1.png']\n"
                      "subflavors:\n  source: chat\n  weight: [1, 2]\n")
    inner = tmp_path / "inner.yaml"
    inner.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n"
                     "    blend_epochized:\n      - repetitions: 2\n        path: chat\n"
                     "        subset: {range: [0%, 50%]}\n")
    outer = tmp_path / "outer.yaml"
    outer.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    path: inner.yaml\n")
    for path in (d, outer):
        rows = [next(_loader(env, path)) for _ in range(2)]
        assert all(r["tokens"].shape == (1, 256) and int(r["cu_seqlens"][-1]) == 256 for r in rows)


def test_unparseable_yaml_is_one_line(env, tmp_path, capfd):
    root = env[0]
    d, _ = _evil_copy(root, tmp_path, "chat", CRUDE + "subflavors: {{a: 1\n")
    with pytest.raises(DataError) as e:
        _loader(env, d)
    msg = str(e.value)
    assert msg.startswith(f"{d / '.nv-meta' / 'dataset.yaml'}: not parseable YAML (line=") and "\n" not in msg, msg
    assert "parse_engine" not in capfd.readouterr().err  # rapidyaml's own error text does not reach stderr
    (d / ".nv-meta" / "dataset.yaml").write_text(CRUDE)
    (d / ".nv-meta" / "split.yaml").write_text("split_parts:\n  train: [a.tar\n")
    with pytest.raises(DataError, match=r"split\.yaml: not parseable YAML \(line="):
        _loader(env, d)
    (d / ".nv-meta" / "split.yaml").write_text("split_parts:\n  train: [../chat/a.tar]\n")
    with pytest.raises(DataError, match=r"split\.yaml: shard '\.\./chat/a\.tar' is not a path inside"):
        _loader(env, d)


def test_damaged_shard_is_one_data_error(env, tmp_path):
    """A shard truncated after ``energon prepare``: the read that reaches the damage raises one DataError line."""
    root = env[0]
    d, _ = _evil_copy(root, tmp_path, "chat", CRUDE)
    for shard in ("a.tar", "b.tar"):
        size = (d / shard).stat().st_size
        with open(d / shard, "r+b") as f:
            f.truncate(size // 2)
    it = _loader(env, d)
    with pytest.raises(DataError) as e:
        for _ in range(20):
            next(it)
    msg = str(e.value)
    assert msg == f"--data-path {d}: reading the Energon dataset failed (unexpected end of data)", msg


@pytest.mark.parametrize("what", ["too_long", "no_messages"])
def test_no_usable_sample_stops_the_loader(env, tmp_path, monkeypatch, capfd, what):
    """Every sample longer than the row, or every sample without ``messages``: the loader stops after
    MAX_UNUSABLE_IN_A_ROW tries with one line (no endless loop of notices)."""
    import io
    import tarfile

    from megatron_glm5.data import energon

    root, cfg, proc = env
    monkeypatch.setattr(energon, "MAX_UNUSABLE_IN_A_ROW", 40)
    d = tmp_path / what
    d.mkdir()
    if what == "too_long":
        make_chat_webdataset(str(d / "a.tar"), 4, key_prefix="a")
    else:
        with tarfile.open(d / "a.tar", "w") as tf:
            for k in range(4):
                data = json.dumps({"conversation": [{"role": "user", "content": "hi"}]}).encode()
                info = tarfile.TarInfo(f"a{k}.json")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    _prepare(d, "--sample-type", "CrudeWebdataset")
    it = build_energon_loader(str(d), ChatDocuments([], proc, cfg, eod=0), 16 if what == "too_long" else 256, 0, 1,
                              0, 1, 0, 1234, 16, 0)
    with pytest.raises(DataError) as e:
        next(it)
    msg = str(e.value)
    why = "tokens, longer than --seq-length 16" if what == "too_long" else "holds no 'messages' list"
    assert msg.startswith(f"--data-path {d}: reading the Energon dataset failed (no usable sample in 40 tries in a "
                          f"row (the last: ") and why in msg and "\n" not in msg, msg
    assert capfd.readouterr().out.count("document skipped") == 40


@pytest.mark.parametrize("case", ["part_filter", "no_usable_sample"])
def test_training_run_ends_with_one_line(env, tmp_path, case):
    """``pretrain_glm5_vlm.py`` on a dataset whose ``dataset.yaml`` names ``evil.py:part_filter`` (refused before
    anything runs: no marker), and on one whose samples are all longer than ``--seq-length 16`` (the loader stops
    after MAX_UNUSABLE_IN_A_ROW tries): exit status 1, one error line, no traceback."""
    root = env[0]
    d, marker = _evil_copy(root, tmp_path, "chat", CRUDE + ("part_filter: evil.py:part_filter\n"
                                                            if case == "part_filter" else ""))
    args = list(TINY)
    args[args.index("--seq-length") + 1] = "16"
    proc = run(args + ["--dataset-type", "chat", "--tokenizer-model", str(root / "hf"), "--data-path", str(d),
                       "--train-iters", "3"], timeout=600)
    errors = [ln for ln in error_lines(proc) if "error:" in ln or "Traceback" in ln]
    assert proc.returncode == 1 and len(errors) == 1, (proc.returncode, proc.stderr[-3000:])
    if case == "part_filter":
        assert errors[0] == (f"pretrain_glm5_vlm.py: error: {d / '.nv-meta' / 'dataset.yaml'}: part_filter: only a "
                             f"list of part names is read (a 'module.py:function' string names code to run) (Energon "
                             f"configs are read without running code: only plain keys and the classes this program "
                             f"reads are accepted)")
        assert not marker.exists()
    else:
        from megatron_glm5.data.energon import MAX_UNUSABLE_IN_A_ROW

        assert errors[0].startswith(f"pretrain_glm5_vlm.py: error: --data-path {d}: reading the Energon dataset "
                                    f"failed (no usable sample in {MAX_UNUSABLE_IN_A_ROW} tries in a row (the last: ")
        assert "tokens, longer than --seq-length 16" in errors[0]
