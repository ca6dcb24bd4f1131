"""``--save`` never loses anything (megatron_glm5/training/save_guard.py): a folder holding anything but this model's
training checkpoints, another run's checkpoints, an input, a read-only folder, a second run on the same folder: one
line before any work, every file there byte-identical after; a full disk mid-save and SIGKILL at random points of a
save leave the tracker on the last complete checkpoint, from which the next run resumes bit for bit."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_glm5.checkpoint.atomic import output_lock
from tests.training_harness import PRETRAIN, REPO, TINY, error_lines, read_dist_checkpoint, run, scalars, user_pythonpath

FAULT_RUN = os.path.join(REPO, "tests", "save_fault_run.py")
TRACKER = "latest_checkpointed_iteration.txt"
# 4 steps, a checkpoint at 2 and at 4
COMMON = TINY + ["--mock-data", "--train-iters", "4", "--save-interval", "2"]


def tree_hashes(root) -> dict:
    """{relative path: sha256 (files) / 'link:TARGET' / 'dir'} of everything under ``root``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = "link:" + os.readlink(p)
            elif os.path.isdir(p):
                out[rel] = "dir"
            else:
                with open(p, "rb") as fh:
                    out[rel] = hashlib.sha256(fh.read()).hexdigest()
    return out


def one_error_line(proc, code: int) -> str:
    lines = error_lines(proc)
    assert proc.returncode == code and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert lines[0].startswith("pretrain_glm5_vlm.py: error:") and "Traceback" not in proc.stderr
    return lines[0]


def final_state(path) -> dict:
    return read_dist_checkpoint(str(path))


def assert_same_state(a, b) -> None:
    sa, sb = final_state(a), final_state(b)
    assert sa.keys() == sb.keys() and any(k.startswith("optimizer.") for k in sa)
    assert [k for k in sa if not torch.equal(sa[k], sb[k])] == []


def copy_first_checkpoint(base, dst) -> str:
    """``dst`` = ``base`` as it was after its save of iteration 2 (iter_0000002 + a tracker naming it)."""
    os.makedirs(dst)
    shutil.copytree(os.path.join(base, "iter_0000002"), os.path.join(dst, "iter_0000002"))
    with open(os.path.join(dst, TRACKER), "w") as fh:
        fh.write("2")
    return str(dst)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """An uninterrupted run (checkpoints 2 and 4, losses in TensorBoard) through the fault script in counting mode:
    also the number of write / rename events of its save of iteration 4."""
    d = tmp_path_factory.mktemp("save_guard")
    proc = run(COMMON + ["--save", str(d / "ckpt"), "--tensorboard-dir", str(d / "tb")], script=FAULT_RUN,
               env={"GLM5_TEST_KILL_SAVE": "4:0", "GLM5_TEST_KILL_SAVE_COUNT": str(d / "events")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = int((d / "events").read_text())
    assert events > 10
    return {"dir": d, "ckpt": str(d / "ckpt"), "tb": str(d / "tb"), "events": events,
            "loss": dict(scalars(str(d / "tb"))["lm loss"])}


def _parse(argv, capsys, data=("--mock-data",)):
    from megatron_glm5.training.arguments import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(TINY + list(data) + ["--train-iters", "4", "--save-interval", "2"] + argv, world_size=1)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("pretrain_glm5_vlm.py: error:"), err
    return err[0]


# ---------------------------------------------------------------------------- another run's checkpoints
@pytest.mark.parametrize("case, phrase", [
    ("fresh", "holds the checkpoints of another run (iteration 4)"),
    ("load_elsewhere", "holds the checkpoints of another run (iteration 4)"),
    ("finetune", "--finetune restarts at iteration 0 and would replace them"),
    ("ckpt_step_behind", "--ckpt-step: 2: --save"),
])
def test_another_runs_checkpoints_are_not_replaced(base, tmp_path, capsys, case, phrase):
    """A run that does not resume --save's checkpoints (no --load of it, --load of another folder, --finetune, or
    --ckpt-step behind its tracker) would restart at iteration 0 / N over them and move the tracker back: refused
    with one line suggesting --load, nothing written."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(base["ckpt"], ckpt)
    other = tmp_path / "empty_load"
    other.mkdir()
    before = tree_hashes(tmp_path)
    argv = {"fresh": ["--save", ckpt],
            "load_elsewhere": ["--save", ckpt, "--load", str(other)],
            "finetune": ["--save", ckpt, "--load", ckpt, "--finetune"],
            "ckpt_step_behind": ["--save", ckpt, "--load", ckpt, "--ckpt-step", "2"]}[case]
    line = _parse(argv, capsys)
    assert phrase in line, line
    if case in ("fresh", "load_elsewhere"):
        assert f"give --load {ckpt} to resume it, or another --save folder" in line
    assert tree_hashes(tmp_path) == before


def test_fresh_run_into_checkpoints_stops_before_any_work(base, tmp_path):
    """The same refusal from the script: one line, exit 2, no traceback, nothing on stdout (no model built)."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(base["ckpt"], ckpt)
    before = tree_hashes(ckpt)
    proc = run(COMMON + ["--save", ckpt])
    assert "another run" in one_error_line(proc, 2) and proc.stdout == ""
    assert tree_hashes(ckpt) == before


def test_a_save_folder_with_the_runs_own_files_is_accepted(base, tmp_path):
    """A save root also holds what the run itself writes there: its TensorBoard folder, Megatron-LM's progress.txt,
    a tracker temporary of a killed save; resuming it passes the checks."""
    from megatron_glm5.training.arguments import parse_args

    ckpt = tmp_path / "ckpt"
    shutil.copytree(base["ckpt"], ckpt)
    (ckpt / "tb").mkdir()
    (ckpt / "cache" / "GPTDataset_indices").mkdir(parents=True)  # --data-cache-path inside --save: the first run
    (ckpt / "progress.txt").write_text("")                       # passed and wrote it, so must its resume
    (ckpt / (TRACKER + ".tmp-123")).write_text("4")
    args = parse_args(COMMON + ["--save", str(ckpt), "--load", str(ckpt), "--tensorboard-dir", str(ckpt / "tb"),
                                "--data-cache-path", str(ckpt / "cache")], world_size=1)
    assert args.save == str(ckpt)


# ---------------------------------------------------------------------------- folders that are not save roots
def _foreign(kind: str, d) -> str:
    """Make ``d`` a folder of ``kind`` that is not this model's training checkpoints; returns the phrase expected."""
    d.mkdir()
    if kind == "data_set":
        (d / "corpus_text_document.bin").write_bytes(b"\0" * 64)
        (d / "corpus_text_document.idx").write_bytes(b"MMIDIDX\0\0")
        return "a data set"
    if kind == "hf_checkpoint":
        (d / "config.json").write_text(json.dumps({"model_type": "glm5_next"}))
        (d / "model.safetensors").write_bytes(b"\x08\0\0\0\0\0\0\0{}      ")
        return "an HF checkpoint"
    if kind == "converter_output":
        (d / TRACKER).write_text("release")
        (d / "release").mkdir()
        (d / "release" / "metadata.json").write_text("{}")
        (d / "release" / "checksums.sha256").write_text("")
        return "converter output"
    if kind == "foreign_file":
        (d / TRACKER).write_text("4")
        (d / "iter_0000004").mkdir()
        (d / "notes.txt").write_text("mine")
        return "notes.txt"
    if kind == "iter_named_user_folder":  # a user's folder of a checkpoint's name, with a sub-folder
        (d / "iter_0000004" / "photos").mkdir(parents=True)
        return "no checkpoint folder of this model"
    if kind == "tmp_named_user_folder":  # the name the old trainer's clean-up deleted
        (d / "iter_0000004.tmp-keep").mkdir()
        (d / "iter_0000004.tmp-keep" / "a.txt").write_text("mine")
        return "iter_0000004.tmp-keep"
    if kind == "link":
        (d / "iter_0000002").symlink_to(d.parent)
        return "iter_0000002"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["data_set", "hf_checkpoint", "converter_output", "foreign_file",
                                  "iter_named_user_folder", "tmp_named_user_folder", "link"])
def test_save_into_a_folder_of_other_files_is_refused(tmp_path, capsys, kind):
    """--save never writes into a folder holding anything but this model's training checkpoints: one line naming
    what is there, every file byte-identical after (a fresh run and a --load of the same folder alike)."""
    d = tmp_path / "target"
    phrase = _foreign(kind, d)
    before = tree_hashes(tmp_path)
    for extra in ([], ["--load", str(d)]):
        line = _parse(["--save", str(d)] + extra, capsys)
        assert "--save" in line and phrase in line, line
        assert tree_hashes(tmp_path) == before


@pytest.mark.parametrize("where", ["same", "inside"])
def test_save_into_the_pretrained_checkpoint_is_refused(tmp_path, capsys, where):
    """--save equal to (or inside) --pretrained-checkpoint would change the weights later runs start from."""
    pre = tmp_path / "converted"
    _foreign("converter_output", pre)
    before = tree_hashes(tmp_path)
    save = pre if where == "same" else pre / "finetuned"
    line = _parse(["--pretrained-checkpoint", str(pre), "--save", str(save)], capsys)
    assert "--save" in line and ("--pretrained-checkpoint" in line if where == "same" else "inside the input" in line)
    assert tree_hashes(tmp_path) == before and not os.path.exists(pre / "finetuned")


@pytest.mark.parametrize("where", ["data_folder", "above_it"])
def test_save_at_or_above_the_data_is_refused(tiny_data, tmp_path, capsys, where):
    """--save in the folder of the data it trains on, or above it, is refused; the data byte-identical after."""
    data = tmp_path / "run" / "data"
    shutil.copytree(tiny_data, data)
    before = tree_hashes(tmp_path)
    save = data if where == "data_folder" else data.parent
    line = _parse(["--data-path", str(data / "text_text_document"), "--tokenizer-model", str(data),
                   "--save", str(save)], capsys, data=())
    assert f"--save: {save} " in line and ("is the input" in line or "contains the input" in line), line
    assert tree_hashes(tmp_path) == before


# ---------------------------------------------------------------------------- --load DIR/iter_N
def test_load_of_a_checkpoint_folder_is_refused_and_ckpt_step_resumes_it(base, tmp_path, capsys):
    """--load DIR/iter_N --save DIR is one line (never a restart at 0 over DIR); --load DIR --ckpt-step N resumes
    iteration N into another --save: its losses and final state equal the uninterrupted run's, bit for bit."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(base["ckpt"], ckpt)
    before = tree_hashes(ckpt)
    line = _parse(["--load", os.path.join(ckpt, "iter_0000002"), "--save", ckpt], capsys)
    assert f"--save: {ckpt} contains the input" in line and "iter_0000002" in line, line  # --save is checked first
    assert tree_hashes(ckpt) == before
    proc = run(COMMON + ["--load", ckpt, "--ckpt-step", "2", "--save", str(tmp_path / "from2"),
                         "--tensorboard-dir", str(tmp_path / "tb")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loading distributed checkpoint from" in proc.stdout and "at iteration 2" in proc.stdout
    loss = dict(scalars(str(tmp_path / "tb"))["lm loss"])
    assert sorted(loss) == [3, 4] and all(loss[i] == base["loss"][i] for i in (3, 4)), (loss, base["loss"])
    assert_same_state(os.path.join(base["ckpt"], "iter_0000004"), tmp_path / "from2" / "iter_0000004")
    assert tree_hashes(ckpt) == before


# ---------------------------------------------------------------------------- a second run
@pytest.mark.parametrize("nproc", [1, 2])
def test_second_run_on_the_same_save_is_refused(tmp_path, nproc):
    """While a run holds --save (its lock, the converters' output_lock) a second run is refused with one line (from
    rank 0 only under torchrun) before building a model; nothing in --save changes."""
    save = tmp_path / "ckpt"
    save.mkdir()
    with output_lock(str(save), flag="--save"):
        before = tree_hashes(tmp_path)
        proc = run(COMMON + ["--save", str(save)], nproc=nproc)
        assert tree_hashes(tmp_path) == before
    ours = [ln for ln in error_lines(proc) if ln.startswith("pretrain_glm5_vlm.py")]
    assert ours == [f"pretrain_glm5_vlm.py: error: --save {save} is being written by another process "
                    f"(pid {os.getpid()}); refusing to write it at the same time"], proc.stderr[-3000:]
    assert proc.returncode == 1
    assert "[rank" not in proc.stderr  # no worker traceback (torchrun's own report of the exit status aside)
    if nproc == 1:
        assert "Traceback" not in proc.stderr and "building" not in proc.stdout.lower()
    assert not os.listdir(save)


# ---------------------------------------------------------------------------- read-only and full disks
def _namespaces_work() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


needs_mounts = pytest.mark.skipif(not _namespaces_work(), reason="needs unshare -rm (user + mount namespaces)")


def _run_in_namespace(setup: str, args, after: str = "") -> subprocess.CompletedProcess:
    """``pretrain_glm5_vlm.py args`` in a private mount namespace after the shell commands ``setup`` (mounts that
    only this process sees); ``after`` runs when it ended; the run's exit status is returned."""
    env = dict(os.environ, PYTHONPATH=user_pythonpath(), PYTHONUNBUFFERED="1",
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = " ".join(shlex.quote(a) for a in [sys.executable, PRETRAIN] + list(args))
    script = f"set -e; {setup}; set +e; {cmd}; rc=$?; {after or 'true'}; exit $rc"
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900, start_new_session=True)


@needs_mounts
def test_read_only_save_is_refused_up_front(base, tmp_path):
    """--save on a read-only file system (a read-only bind mount of a folder with a checkpoint): one line before
    training (not after it), exit 2, the checkpoint untouched; a new folder on it likewise."""
    ro_dir = tmp_path / "ro"
    ro_dir.mkdir()
    ckpt = copy_first_checkpoint(base["ckpt"], ro_dir / "ckpt")
    before = tree_hashes(ro_dir)
    q = shlex.quote(str(ro_dir))
    for argv in (["--save", ckpt, "--load", ckpt], ["--save", str(ro_dir / "new")]):
        proc = _run_in_namespace(f"mount --bind {q} {q} && mount -o remount,bind,ro {q}", COMMON + argv)
        line = one_error_line(proc, 2)
        assert "--save" in line and "cannot be written (Read-only file system)" in line and proc.stdout == "", line
    assert tree_hashes(ro_dir) == before


@needs_mounts
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_full_disk_mid_save_keeps_the_last_checkpoint(base, tmp_path, mode):
    """A disk that fills up during the (--async-save too) save of iteration 4 (a 12 MiB tmpfs holding the 7.7 MiB
    checkpoint of iteration 2): one line naming the disk and the intact checkpoint, exit 1; the tracker stays on 2 and iteration 2
    byte-identical; resumed from there, the run ends bit for bit where the uninterrupted one did."""
    src = copy_first_checkpoint(base["ckpt"], tmp_path / "src")
    out, mnt = tmp_path / "after", tmp_path / "mnt"
    out.mkdir()
    mnt.mkdir()
    before = tree_hashes(src)
    q = shlex.quote
    proc = _run_in_namespace(f"mount -t tmpfs -o size=12m tmpfs {q(str(mnt))} && cp -a {q(src)}/. {q(str(mnt))}/",
                             COMMON + ["--save", str(mnt), "--load", str(mnt)]
                             + (["--async-save"] if mode == "async" else []),
                             after=f"cp -a {q(str(mnt))}/. {q(str(out))}/")
    line = one_error_line(proc, 1)
    assert "the checkpoint of iteration 4 could not be written (No space left on device" in line, line
    assert line.endswith(f"the last checkpoint (iteration 2) in {mnt} is intact"), line
    after = tree_hashes(out)
    assert {k: after[k] for k in before} == before  # the tracker and iteration 2, byte for byte
    if mode == "async":
        return
    resumed = run(COMMON + ["--save", str(out), "--load", str(out)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_state(os.path.join(base["ckpt"], "iter_0000004"), out / "iter_0000004")


# ---------------------------------------------------------------------------- SIGKILL inside a save
@pytest.mark.parametrize("point", ["seed0", "seed1", pytest.param("seed2", marks=pytest.mark.slow), "last"])
def test_kill_at_a_random_point_of_a_save_resumes_bitwise(base, tmp_path, point):
    """SIGKILL at a random write / rename of the save of iteration 4 (seeded; 'last': just before the tracker's
    rename): the tracker stays on 2 and iteration 2 byte-identical; the same command resumes from 2 and ends bit
    for bit where the uninterrupted run did."""
    total = base["events"]
    kill_at = total if point == "last" else random.Random(int(point[4:])).randint(1, total - 1)
    ckpt = copy_first_checkpoint(base["ckpt"], tmp_path / "ckpt")
    before = tree_hashes(ckpt)
    argv = COMMON + ["--save", ckpt, "--load", ckpt]
    killed = run(argv, script=FAULT_RUN, env={"GLM5_TEST_KILL_SAVE": f"4:{kill_at}"})
    assert killed.returncode == -9, (kill_at, killed.returncode, killed.stderr[-2000:])
    after = tree_hashes(ckpt)
    assert {k: after[k] for k in before} == before, kill_at
    resumed = run(argv + ["--tensorboard-dir", str(tmp_path / "tb")])
    assert resumed.returncode == 0, (kill_at, resumed.stderr[-3000:])
    assert "at iteration 2" in resumed.stdout
    loss = dict(scalars(str(tmp_path / "tb"))["lm loss"])
    assert sorted(loss) == [3, 4] and all(loss[i] == base["loss"][i] for i in (3, 4)), (kill_at, loss)
    assert_same_state(os.path.join(base["ckpt"], "iter_0000004"), os.path.join(ckpt, "iter_0000004"))
    assert open(os.path.join(ckpt, TRACKER)).read().strip() == "4"


# ---------------------------------------------------------------------------- Megatron-LM's deletions
def test_retain_interval_and_non_persistent_clean_up_delete_only_this_runs_checkpoints(base, tmp_path):
    """--save-retain-interval deletes the previous checkpoint at each save unless it is on the interval, and the
    non-persistent clean-up every non-persistent checkpoint but the newest: a resumed run keeps what an earlier run
    wrote (checkpoints 2 and 4, a non-persistent 1, byte-identical) and deletes only its own (6; non-persistent 5
    is kept as the newest before 7)."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(base["ckpt"], ckpt)
    os.makedirs(os.path.join(ckpt, "non_persistent", "iter_0000001"))
    with open(os.path.join(ckpt, "non_persistent", "iter_0000001", "__0_0.distcp"), "wb") as fh:
        fh.write(b"earlier run")
    before = tree_hashes(ckpt)
    proc = run(TINY + ["--mock-data", "--train-iters", "8", "--lr-decay-iters", "4", "--save-interval", "2",
                       "--save-retain-interval", "8", "--override-opt_param-scheduler", "--non-persistent-save-interval",
                       "1", "--non-persistent-ckpt-type", "global", "--save", ckpt, "--load", ckpt])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "keeping the checkpoint of iteration 4" in proc.stdout
    after = tree_hashes(ckpt)
    assert {k: after.get(k) for k in before if k != TRACKER} == {k: v for k, v in before.items() if k != TRACKER}
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("iter_")) == ["iter_0000002", "iter_0000004",
                                                                            "iter_0000008"]
    assert sorted(n for n in os.listdir(os.path.join(ckpt, "non_persistent")) if n.startswith("iter_")) == [
        "iter_0000001", "iter_0000005", "iter_0000007"]
