"""pretrain_glm5_vlm.py's answers to user mistakes: numeric flags Megatron-LM accepts and then crashes on or misreads,
--split as megatron-core reads it, bad --hf-config files, the one stderr line (rank 0 only under torchrun), Ctrl-C
at any phase, and steps whose update makes weights NaN/inf (skipped, counted, undone, never saved)."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from megatron_glm5.training.fused_optimizer_step import fused_step
from tests.training_harness import REPO, TINY, error_lines, read_dist_checkpoint, run

BASE = ["--model-preset", "glm5-tiny", "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "2",
        "--lr", "1e-3", "--eval-iters", "0", "--mock-data"]
PROG = "pretrain_glm5_vlm.py"


def _parse_error(capsys, argv) -> str:
    """parse_args(argv) must end with exit 2 and exactly one stderr line: that line."""
    from megatron_glm5.training.arguments import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=1, prog=PROG)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith(f"{PROG}: error: "), err
    return err[0]


# ---------------------------------------------------------------------------- numeric flags
@pytest.mark.parametrize("extra, flag, phrase", [
    (["--seed", "-1"], "--seed", "must lie in [1, 2147483647] (got -1)"),
    (["--seed", "0"], "--seed", "(got 0)"),
    (["--seed", "4294967296"], "--seed", "(got 4294967296)"),
    (["--num-workers", "-1"], "--num-workers", "must be >= 0 (got -1)"),
    (["--tensorboard-log-interval", "0"], "--tensorboard-log-interval", "must be >= 1 (got 0)"),
    (["--log-interval", "0"], "--log-interval", "must be >= 1"),
    (["--eval-interval", "0"], "--eval-interval", "must be >= 1"),
    (["--exit-interval", "0"], "--exit-interval", "must be >= 1"),
    (["--save-interval", "0", "--save", "/nonexistent/ck"], "--save-interval", "must be >= 1"),
    (["--weight-decay", "inf"], "--weight-decay", "inf is not a finite number"),
    (["--weight-decay", "nan"], "--weight-decay", "nan is not a finite number"),
    (["--weight-decay", "-0.1"], "--weight-decay", "must be >= 0"),
    (["--lr", "nan"], "--lr", "nan is not a finite number"),
    (["--lr", "inf"], "--lr", "inf is not a finite number"),
    (["--min-lr", "nan"], "--min-lr", "not a finite number"),
    (["--clip-grad", "-1"], "--clip-grad", "must be >= 0 (got -1.0)"),
    (["--clip-grad", "nan"], "--clip-grad", "nan is not a finite number"),
    (["--micro-batch-size", "0"], "--micro-batch-size", "must be >= 1 (got 0)"),
    (["--global-batch-size", "0"], "--global-batch-size", "must be >= 1"),
    (["--train-iters", "-1"], "--train-iters", "must be >= 1 (got -1)"),
    (["--train-iters", "0"], "--train-iters", "must be >= 1"),
    (["--eval-iters", "-1"], "--eval-iters", "must be >= 0"),
    (["--lr-warmup-iters", "-1"], "--lr-warmup-iters", "must be >= 0"),
    (["--adam-beta1", "nan"], "--adam-beta1", "not a finite number"),
    (["--adam-beta2", "1"], "--adam-beta2", "must lie in [0, 1)"),
    (["--adam-eps", "0"], "--adam-eps", "must be > 0"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout", "must lie in [0, 1]"),
    (["--attention-dropout", "-0.1"], "--attention-dropout", "must lie in [0, 1]"),
    (["--init-method-std", "inf"], "--init-method-std", "not a finite number"),
    (["--moe-aux-loss-coeff", "nan"], "--moe-aux-loss-coeff", "not a finite number"),
    (["--moe-router-bias-update-rate", "inf"], "--moe-router-bias-update-rate", "not a finite number"),
    (["--mtp-loss-scaling-factor", "-1"], "--mtp-loss-scaling-factor", "must be >= 0"),
    (["--lr-warmup-fraction", "2"], "--lr-warmup-fraction", "must lie in [0, 1]"),
    (["--max-consecutive-skipped-iterations", "0"], "--max-consecutive-skipped-iterations", "must be >= 1"),
    (["--inject-nan-at-iteration", "-3"], "--inject-nan-at-iteration", "must be >= 0"),
    (["--seq-length", "0"], "--seq-length", "must be >= 1"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size", "must be >= 1"),
    (["--dist-ckpt-workers", "0"], "--dist-ckpt-workers", "must be >= 1"),
])
def test_numeric_flag_out_of_bounds_is_one_line(capsys, extra, flag, phrase):
    line = _parse_error(capsys, BASE + extra)
    assert line.startswith(f"{PROG}: error: {flag}: ") and phrase in line, line


def _megatron_parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import parse_args as megatron_parse_args

    from megatron_glm5.training import arguments

    provider = arguments._one_line_parser_errors(PROG)
    with arguments._argv([], PROG):
        megatron_parse_args(extra_args_provider=provider)
    return provider.parser


def test_every_numeric_flag_refuses_nan_inf_and_negative_counts():
    """Megatron-LM's whole parser: a float flag never takes NaN / inf, an int flag never takes -1 unless its own
    default is negative (-1 = off), an int ``*_interval`` flag never takes 0 unless 0 is its default (off)."""
    from megatron_glm5.training.arguments import ArgumentError, check_numeric_flags

    actions = [a for a in _megatron_parser()._actions if a.type in (int, float) and a.option_strings]
    assert len(actions) > 250
    checked = 0

    def refused(action, value) -> bool:
        args = argparse.Namespace(**{action.dest: [value] if action.nargs in ("+", "*", 3) else value})
        try:
            check_numeric_flags(args, [action])
        except ArgumentError as e:
            assert str(e).startswith(action.option_strings[0] + ": "), e
            return True
        return False

    for a in actions:
        defaults = a.default if isinstance(a.default, list) else [a.default]
        negative_default = any(isinstance(d, (int, float)) and d < 0 for d in defaults)
        if a.type is float:
            assert refused(a, float("nan")) and refused(a, float("inf")) and refused(a, float("-inf")), a.dest
        elif not negative_default:
            assert refused(a, -1), a.dest
        if a.type is int and a.dest.endswith("_interval") and 0 not in defaults:
            assert refused(a, 0), a.dest
        checked += 1
    assert checked == len(actions)


# ---------------------------------------------------------------------------- --split
@pytest.mark.parametrize("split", ["2e1,80", "inf,1,0", "nan", "-1,2,3", "1,2,3,4", "1.2.3", "90;5;5", "0,0,0", "",
                                   "0,1,0"])
def test_split_megatron_would_misread_is_refused(capsys, tiny_data, split):
    line = _parse_error(capsys, [a for a in BASE if a != "--mock-data"] + [
        "--data-path", str(tiny_data / "text_text_document"), "--tokenizer-model", str(tiny_data), f"--split={split}"])
    assert line.startswith(f"{PROG}: error: --split: {split!r}: "), line


@pytest.mark.parametrize("split, weights", [("90,5,5", [90, 5, 5]), ("969, 30, 1", [969, 30, 1]), ("1", [1]),
                                            (".5,.5", [0.5, 0.5]), ("100,0,0", [100])])
def test_split_accepted_is_read_by_megatron_as_written(split, weights):
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    from megatron_glm5.training.arguments import check_split

    check_split(split, train=True)
    want = [w / sum(weights) for w in weights] + [0.0] * (3 - len(weights))
    assert parse_and_normalize_split(split) == pytest.approx(want, rel=0, abs=1e-15)


@pytest.mark.parametrize("weight", ["inf", "nan", "-1", "0"])
def test_data_path_weight_must_be_finite_and_positive(capsys, tiny_data, weight):
    line = _parse_error(capsys, [a for a in BASE if a != "--mock-data"] + [
        "--data-path", weight, str(tiny_data / "text_text_document"), "--tokenizer-model", str(tiny_data)])
    assert "--data-path: a weight must be a finite number > 0" in line, line


def test_data_path_weights_whose_sum_overflows_are_one_line(capsys, tiny_data):
    prefix = str(tiny_data / "text_text_document")
    line = _parse_error(capsys, [a for a in BASE if a != "--mock-data"] + [
        "--data-path", "1e308", prefix, "1e308", prefix, "--tokenizer-model", str(tiny_data)])
    assert line.endswith("--data-path: the weights sum to more than a float holds (1e308 1e308)"), line


# ---------------------------------------------------------------------------- --hf-config
@pytest.mark.parametrize("content, phrase", [
    (b"[1, 2]", "holds a JSON list, not an object"),
    (b'{"text_config": {"vocab_size": "\xff\xfe"}}', "cannot read the config"),
    (b"[" * 100000 + b"]" * 100000, "JSON nested too deeply"),
    (b"{}", "num_hidden_layers: missing"),
    (b'{"text_config": {"hidden_size": 64}}', "missing"),
    (b'{"text_config": []}', "text_config: must be a JSON object"),
    (b'{"text_config": {"vocab_size": "\\ud800", "num_hidden_layers": 2}}', "--hf-config"),
    (b"", "cannot read the config"),
])
def test_bad_hf_config_is_one_line(capsys, tmp_path, content, phrase):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    line = _parse_error(capsys, [a for a in BASE if a not in ("--model-preset", "glm5-tiny")]
                        + ["--hf-config", str(tmp_path)])
    assert line.startswith(f"{PROG}: error: --hf-config: ") and phrase in line, line
    assert path.read_bytes() == content


def test_config_sizes_no_machine_holds_are_one_line_before_allocating(tmp_path):
    """A vocabulary of 10^12 ids: the trainer's model provider refuses it in one line naming the key, at once."""
    import json
    import time

    from megatron_glm5.config import tiny_hf_config

    hf = tiny_hf_config()
    hf["text_config"]["vocab_size"] = 10 ** 12
    (tmp_path / "config.json").write_text(json.dumps(hf))
    t0 = time.time()
    proc = run([a for a in BASE if a not in ("--model-preset", "glm5-tiny")] + ["--hf-config", str(tmp_path)],
               timeout=300)
    lines = error_lines(proc)
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"{PROG}: error: vocab_size: the model's weights need at least "), lines
    assert "Traceback" not in proc.stderr and time.time() - t0 < 240


# ---------------------------------------------------------------------------- the whole program
@pytest.mark.parametrize("extra, flag", [
    (["--seed", "-1"], "--seed"),
    (["--split", "2e1,80"], "--split"),
    (["--fp16", "--bf16"], "Megatron-LM's check failed"),  # refused by Megatron-LM's validate_args
    (["--hidden-dropout", "0.1"], "--hidden-dropout: 0.1 does not reach this model: its hidden_dropout is 0.0"),
    (["--attention-backend", "flash"], "--attention-backend: 'flash' does not reach this model"),
])
def test_bad_flag_is_all_the_program_prints(extra, flag):
    proc = run(BASE + extra)
    assert proc.returncode == 2 and error_lines(proc) == proc.stderr.splitlines(), proc.stderr
    assert len(error_lines(proc)) == 1 and error_lines(proc)[0].startswith(f"{PROG}: error: {flag}"), proc.stderr
    assert proc.stdout == ""


def test_torchrun_user_error_is_one_line_from_rank_0():
    proc = run(BASE + ["--seed", "-1"], nproc=2)
    ours = [ln for ln in proc.stderr.splitlines() if PROG in ln and "error" in ln and "FAILED" not in ln]
    assert proc.returncode != 0
    assert ours == [f"{PROG}: error: --seed: must lie in [1, 2147483647] (got -1)"], proc.stderr
    # the only traceback is torchrun's own report of a failed worker: no rank prints one
    assert "[rank" not in proc.stderr and "megatron_glm5/" not in proc.stderr and 'pretrain_glm5_vlm.py", line' \
        not in proc.stderr, proc.stderr


def _interrupt(args, marker, tmp_path):
    """Run the program, send Ctrl-C to its process group once ``marker`` is on stdout (None: right after start)."""
    import time

    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, PROG)] + args, cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    if marker is None:
        time.sleep(1.0)
    else:
        for line in proc.stdout:
            if marker in line:
                break
    os.killpg(proc.pid, signal.SIGINT)
    proc.stdout.read()
    err = [ln for ln in proc.stderr.read().splitlines() if ln.strip()]
    return proc.wait(timeout=300), err


def test_torchrun_ctrl_c_is_one_line_from_rank_0():
    """Ctrl-C to the whole process group (torchrun and both ranks) during training: the line once, at once."""
    import time

    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", PROG] + TINY + [
        "--mock-data", "--train-iters", "50"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    for line in proc.stdout:
        if "iteration        3/" in line:
            break
    start = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    proc.stdout.read()
    err = proc.stderr.read()
    proc.wait(timeout=300)
    assert [ln for ln in err.splitlines() if ln.startswith(PROG)] == [f"{PROG}: interrupted"], err
    assert "[rank" not in err and "megatron_glm5/" not in err and "KeyboardInterrupt" not in err, err
    assert time.monotonic() - start < 20  # no rank waits for the launcher's forced kill


_HELPER_REPORT = r"""
import os, signal, sys, threading, time
from megatron_glm5.training import entry
entry._CTRL_C_GRACE_S = 2.0
entry._quiet_threads_after_ctrl_c()

def report(exc_type, via_sys):
    try:
        raise exc_type("peer went away")
    except exc_type:
        if via_sys:  # multiprocessing.resource_sharer's thread calls sys.excepthook itself
            sys.excepthook(*sys.exc_info())
        else:
            raise

def helper(exc_type, via_sys):
    thread = threading.Thread(target=report, args=(exc_type, via_sys), daemon=True)
    thread.start()
    return thread

before = [helper(ValueError, True), helper(ConnectionResetError, False)]  # no SIGINT within the grace: printed
for thread in before:
    thread.join()
sys.stderr.write("--- sigint ---\n")
early = helper(ConnectionResetError, True)  # reported before this process's handler ran: waits for it
time.sleep(0.3)
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
except KeyboardInterrupt:
    pass
late = [helper(BrokenPipeError, False), helper(EOFError, True), helper(KeyError, True)]
for thread in [early] + late:
    thread.join()
"""


def test_helper_threads_broken_connections_after_ctrl_c_are_dropped():
    """A helper thread's broken connection (the data-loader's resource sharer reports it through sys.excepthook,
    other threads through threading.excepthook) prints nothing once SIGINT arrives, also when the report comes first;
    other errors, and broken connections without a SIGINT, print their traceback."""
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    run = subprocess.run([sys.executable, "-c", _HELPER_REPORT], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    before, after = run.stderr.split("--- sigint ---\n")
    assert "ValueError: peer went away" in before and "ConnectionResetError: peer went away" in before, before
    printed = [ln for ln in after.splitlines() if "peer went away" in ln and "raise" not in ln]
    assert printed == ["KeyError: 'peer went away'"], after


_CTRL_C_IN_A_FINALIZER = r"""
import os, signal, sys, time, weakref
from megatron_glm5.training import entry
entry._quiet_threads_after_ctrl_c()

class Held:
    pass

held = Held()
ref = weakref.ref(held, lambda _: os.kill(os.getpid(), signal.SIGINT))  # Ctrl-C while a weakref callback runs
try:
    del held
    for _ in range(200):
        time.sleep(0.01)
    print("trained on")
except KeyboardInterrupt:
    print("interrupted")
"""


def test_ctrl_c_during_a_finalizer_still_interrupts():
    """A SIGINT that lands while the main thread runs a weakref callback (Python drops the KeyboardInterrupt raised
    there as "Exception ignored") still interrupts the main code, and prints nothing."""
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    run = subprocess.run([sys.executable, "-c", _CTRL_C_IN_A_FINALIZER], env=env, capture_output=True, text=True,
                         timeout=120)
    assert (run.returncode, run.stdout, run.stderr) == (0, "interrupted\n", "")


@pytest.mark.parametrize("marker", [
    None,                                                  # start-up: imports
    pytest.param("> initializing torch distributed", marks=pytest.mark.slow),
    pytest.param("Setting up DistributedDataParallel", marks=pytest.mark.slow),  # model build
    "> building train, validation",                        # data
    "saving checkpoint at iteration",                      # saving
])
def test_ctrl_c_at_any_phase_is_one_line(tmp_path, marker):
    code, err = _interrupt(TINY + ["--mock-data", "--train-iters", "50", "--save", str(tmp_path / "ck"),
                                   "--save-interval", "1"], marker, tmp_path)
    assert code == 130 and len(err) == 1 and err[0].startswith(f"{PROG}: interrupted"), err


# ---------------------------------------------------------------------------- non-finite weights
# weight decay 0 at the first step, 1e45 / train_iters from the second on: AdamW's p * (1 - lr * wd) overflows
BLOW_UP = ["--lr-warmup-iters", "0", "--weight-decay-incr-style", "linear", "--start-weight-decay", "0",
           "--end-weight-decay", "1e45", "--max-consecutive-skipped-iterations", "2", "--train-iters", "6",
           "--save-interval", "1", "--log-params-norm", "--mock-data"]


def _same_but_expert_bias(a: dict, b: dict) -> list:
    """Tensors that differ between two checkpoints, leaving out the routers' expert bias, which Megatron-LM moves
    in finalize_model_grads before the optimizer step, skipped or not (as for a NaN loss)."""
    assert a.keys() == b.keys()
    return [k for k in a if not k.endswith("expert_bias") and not torch.equal(a[k], b[k])]


def _assert_skipped_and_stopped(proc, ck):
    lines = error_lines(proc)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "iteration 2: the update makes weights NaN/inf: update skipped (1 in a row)" in proc.stdout
    assert "iteration 3: the update makes weights NaN/inf: update skipped (2 in a row)" in proc.stdout
    # rank 0's memory line and the last rank's log line may share a line of the joined stdout
    logged = {int(m.group(1)): ln for ln in proc.stdout.splitlines()
              if (m := re.search(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:", ln))}
    assert "number of skipped iterations:   1" in logged[2]
    assert logged[1].split("params norm:")[1].split("|")[0] == logged[2].split("params norm:")[1].split("|")[0]
    assert sorted(os.listdir(ck)) == ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    one, two = read_dist_checkpoint(str(ck / "iter_0000001")), read_dist_checkpoint(str(ck / "iter_0000002"))
    assert any(k.startswith("optimizer.") for k in two)
    assert _same_but_expert_bias(one, two) == []  # weights and optimizer state as before the skipped step
    assert all(torch.isfinite(v).all() for v in two.values() if v.is_floating_point())
    return lines


def test_update_making_weights_inf_is_skipped_counted_and_stops_the_run(tmp_path):
    ck = tmp_path / "ck"
    proc = run(TINY + BLOW_UP + ["--save", str(ck)])
    lines = _assert_skipped_and_stopped(proc, ck)
    assert lines == [f"{PROG}: error: stopped at iteration 3: 2 iterations in a row had a NaN/inf loss, gradient norm "
                     "or updated weight (--max-consecutive-skipped-iterations 2); the last checkpoint (iteration 2) "
                     f"in {ck} is intact"], lines


def test_update_making_weights_inf_is_skipped_on_every_rank_with_the_distributed_optimizer(tmp_path):
    """Two ranks, sharded fp32 main weights under bf16: every rank undoes the step; the line comes once."""
    ck = tmp_path / "ck"
    proc = run(TINY + BLOW_UP + ["--save", str(ck), "--use-distributed-optimizer", "--bf16"], nproc=2)
    _assert_skipped_and_stopped(proc, ck)
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"{PROG}: error:")]
    assert len(ours) == 1 and "stopped at iteration 3" in ours[0], proc.stderr
    assert "[rank" not in proc.stderr and "megatron_glm5/" not in proc.stderr, proc.stderr


def test_model_holding_nan_is_not_saved():
    from megatron_glm5.training.megatron_hooks import TrainingStopped, refuse_nonfinite_save

    saved = []
    save = refuse_nonfinite_save(lambda iteration, model, *a, **k: saved.append(iteration))
    model = torch.nn.Linear(4, 4)
    model.register_buffer("expert_bias", torch.zeros(4))
    save(3, [model], None, None, 0)
    assert saved == [3]
    model.expert_bias[1] = float("inf")
    with pytest.raises(TrainingStopped, match=r"iteration 4: the weights hold NaN/inf \(expert_bias\); checkpoint "
                                              r"not saved"):
        save(4, [model], None, None, 0)
    assert saved == [3]


class _Part:
    """What update_keeps_weights_within reads of a megatron optimizer: its torch optimizer."""

    def __init__(self, inner):
        self.optimizer = inner


def _with_clip(opt, scale: float):
    opt.grad_scale = scale
    return opt


@pytest.mark.parametrize("make", [
    lambda ps, wd: torch.optim.AdamW(ps, lr=1e-2, weight_decay=wd),
    lambda ps, wd: torch.optim.AdamW(ps, lr=1e-2, weight_decay=wd, fused=True),
    lambda ps, wd: torch.optim.AdamW(ps, lr=1e-2, weight_decay=wd, foreach=False),
    lambda ps, wd: _with_clip(fused_step(torch.optim.AdamW(ps, lr=1e-2, weight_decay=wd)), 0.5),
    lambda ps, wd: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=wd),
])
def test_trial_update_changes_nothing_and_predicts_the_step(make):
    """The trial leaves parameters, gradients, state and param groups bitwise as they were; it answers False for an
    update that overflows, True otherwise, and the real step after a True trial equals a step without one. The
    fused optimizer step with a deferred clip coefficient (``grad_scale``) tries the update it makes."""
    from megatron_glm5.training.optimizer import update_keeps_weights_within

    def setup(wd):
        torch.manual_seed(0)
        ws = [torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(
            torch.randn(3))]
        opt = make([{"params": ws[:2]}, {"params": ws[2:], "weight_decay": 0.0}], 0.1)
        for _ in range(2):  # state exists; then the decay under test and one more set of gradients
            for w in ws:
                w.grad = torch.randn_like(w)
            opt.step()
        opt.param_groups[0]["weight_decay"] = wd
        for w in ws:
            w.grad = torch.randn_like(w)
        return ws, opt

    def snapshot(ws, opt):
        return ([w.detach().clone() for w in ws], [w.grad.clone() for w in ws],
                {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for p, s in opt.state.items()},
                [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
                [[id(p) for p in g["params"]] for g in opt.param_groups])

    def same(a, b):
        assert all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
        assert a[2].keys() == b[2].keys() and all(
            (torch.equal(v, b[2][p][k]) if torch.is_tensor(v) else v == b[2][p][k]) for p in a[2] for k, v in a[2][p].items())
        assert a[3] == b[3] and a[4] == b[4]

    ws, opt = setup(1e45)  # decay 1e45: the 8x8 and 8 weights overflow, the third group's stays finite
    before = snapshot(ws, opt)
    assert update_keeps_weights_within(_Part(opt), float(torch.finfo(torch.float32).max)) is False
    same(before, snapshot(ws, opt))

    ws, opt = setup(0.1)
    before = snapshot(ws, opt)
    assert update_keeps_weights_within(_Part(opt), float(torch.finfo(torch.float32).max)) is True
    same(before, snapshot(ws, opt))
    opt.step()
    ws2, opt2 = setup(0.1)
    opt2.step()
    assert all(torch.equal(a, b) for a, b in zip(ws, ws2))
    assert update_keeps_weights_within(_Part(opt), 1e-3) is False  # a limit below the weights: out of range


BAD_DATA_SCRIPT = '''
import sys, torch
import pretrain_glm5_vlm as P
from megatron_glm5.data import DataError

class Corrupt(torch.utils.data.Dataset):
    """Row 5 cannot be read (a data loader worker raises)."""
    def __init__(self, n, s): self.n, self.s = n, s
    def __len__(self): return self.n
    def __getitem__(self, i):
        if i == 5:
            raise DataError("shard-0.tar: sample 5: image is truncated")
        t = torch.full((self.s,), 7, dtype=torch.long)
        return {"tokens": t, "labels": t, "loss_mask": torch.ones(self.s)}

def provider(num_samples, vp_stage=None):
    from megatron.training import get_args
    return Corrupt(num_samples[0], get_args().seq_length), None, None

provider.is_distributed = True

if __name__ == "__main__":
    from megatron_glm5.training.entry import run_pretrain
    sys.exit(run_pretrain(provider, P.model_provider, P.forward_step, argv=sys.argv[1:], prog="bad_data"))
'''


def test_data_error_in_a_loader_worker_mid_run_is_one_line(tmp_path):
    script = tmp_path / "bad_data.py"
    script.write_text(BAD_DATA_SCRIPT)
    proc = run(TINY + ["--mock-data", "--train-iters", "4", "--num-workers", "1"], script=str(script))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert error_lines(proc) == ["bad_data: error: shard-0.tar: sample 5: image is truncated"], proc.stderr


@pytest.mark.parametrize("rank", ["0", "1"])
def test_exit_with_line_rank_0_speaks_other_ranks_only_when_left_alive(capsys, monkeypatch, rank):
    """Rank 0 prints at once; another rank waits for the launcher to end it and prints only if it is still alive
    after the grace period (it alone hit the error). Signal handlers are as before afterwards."""
    import time

    from megatron_glm5.training import arguments

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(arguments, "RANK0_GRACE_S", 0.5)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    start = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        arguments.exit_with_line("prog: error: x \udcff", 3)
    waited = time.monotonic() - start
    assert exc.value.code == 3 and capsys.readouterr().err == "prog: error: x \\udcff\n"
    assert (waited >= 0.5) == (rank == "1")
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    with pytest.raises(SystemExit) as exc:  # Ctrl-C reached every rank: only rank 0 speaks, nobody waits
        arguments.exit_with_line("prog: interrupted", 130, every_rank_hit_it=True)
    assert exc.value.code == 130 and capsys.readouterr().err == ("prog: interrupted\n" if rank == "0" else "")


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.1, nesterov=True),
])
def test_weight_range_guard_bounds_hold_and_fall_back_to_the_exact_trial(make):
    """Over 50 ordinary steps the guard proves every step from its bounds alone (one measurement, no trial) and its
    weight bound stays at or above the true largest |weight|; a step the bounds cannot prove (weight decay 1e45) is
    measured, then tried exactly, and refused, as the exact trial refuses it."""
    from megatron_glm5.training.optimizer import WeightRangeGuard, update_keeps_weights_within

    torch.manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(5))]
    opt = make([{"params": ws[:1]}, {"params": ws[1:], "weight_decay": 0.0}])
    guard = WeightRangeGuard(_Part(opt), float(torch.finfo(torch.float32).max))
    for _ in range(50):
        for w in ws:
            w.grad = torch.randn_like(w) * 3
        norm = float(torch.linalg.vector_norm(torch.cat([w.grad.flatten() for w in ws])))
        assert guard.keeps_within(norm) is True
        opt.step()
        assert guard.bounds[0][0] >= max(float(w.detach().abs().max()) for w in ws)
    assert (guard.measured, guard.tried) == (1, 0)
    opt.param_groups[0]["weight_decay"] = 1e45
    expected = update_keeps_weights_within(_Part(opt), float(torch.finfo(torch.float32).max))
    assert expected is False
    assert guard.keeps_within(norm) is expected
    assert (guard.measured, guard.tried) == (2, 1)


# ---------------------------------------------------------------------------- the launcher's environment
@pytest.mark.parametrize("env, phrase", [
    ({"RANK": "abc"}, "$RANK='abc' is not an integer"),
    ({"RANK": "1", "WORLD_SIZE": "1"}, "$RANK=1 is not below $WORLD_SIZE=1"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "$WORLD_SIZE='0' is out of range"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "$MASTER_PORT is not set but $RANK is"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, "$MASTER_PORT='70000' is out of range"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "29500"}, "$MASTER_ADDR is not set but $RANK is"),
    ({"RANK": "-1", "WORLD_SIZE": "1", "MASTER_PORT": "29500"}, "$RANK='-1' is out of range"),
])
def test_launcher_environment_that_cannot_start_a_run_is_one_line_at_once(capsys, monkeypatch, env, phrase):
    """$RANK / $WORLD_SIZE / $MASTER_* set by hand (not by torchrun) and unusable: one line from the process itself
    (its rank is unknown: no wait for a rank 0), exit 2, before torch or megatron is touched."""
    import time

    from megatron_glm5.training import entry

    for var in entry._LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    start = time.monotonic()
    code = entry.run_pretrain(None, None, None, argv=BASE, prog=PROG)
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"{PROG}: error: {phrase}"), err
    assert "unset RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT" in err[0]
    assert time.monotonic() - start < 5


def test_launcher_environment_of_torchrun_passes():
    from megatron_glm5.training.entry import launcher_env_error

    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    saved = {k: os.environ.get(k) for k in env}
    try:
        os.environ.update(env)
        assert launcher_env_error() is None
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.parametrize("flag", ["--tensorboard-dir", "--data-cache-path", "--wandb-save-dir"])
@pytest.mark.parametrize("under", [False, True])
def test_output_folder_that_is_a_file_is_one_line(capsys, tmp_path, flag, under):
    """A folder Megatron-LM creates (TensorBoard events, dataset index caches, W&B files) given as an existing file,
    or below one: refused before any work (TensorBoard's makedirs raised FileExistsError with a traceback), the
    file unchanged."""
    f = tmp_path / "notes.txt"
    f.write_bytes(b"mine")
    path = str(f / "sub") if under else str(f)
    line = _parse_error(capsys, BASE + [flag, path])
    assert line == f"{PROG}: error: {flag}: {path}: {f} exists and is not a folder", line
    assert f.read_bytes() == b"mine"


@pytest.mark.parametrize("layout", [["1", "P", "2"], ["P", "1"], ["1", "P", "P"], ["P", "1", "P", "2"]])
def test_data_path_weights_not_in_weight_prefix_pairs_are_one_line(capsys, tiny_data, layout):
    """Weights that are not WEIGHT PREFIX pairs: megatron-core reads every item as a prefix and fails on '1.bin'
    after start-up; refused with the expected form before any work."""
    prefix = str(tiny_data / "text_text_document")
    given = [prefix if x == "P" else x for x in layout]
    line = _parse_error(capsys, [a for a in BASE if a != "--mock-data"] + ["--data-path", *given,
                                                                           "--tokenizer-model", str(tiny_data)])
    assert line == (f"{PROG}: error: --data-path: expected PREFIX [PREFIX ...] or WEIGHT PREFIX [WEIGHT PREFIX ...], "
                    f"got {' '.join(given)}"), line


@pytest.mark.parametrize("content", [b"", b"{\"not\": \"a tokenizer\"}", b"\xff\xfe"])
def test_tokenizer_model_that_is_no_tokenizer_names_the_flag(capsys, tiny_data, tmp_path, content):
    """--tokenizer-model naming a file that is not a tokenizer.json: one line naming the flag and the file (it was
    Megatron-LM's 'Unable to instantiate HuggingFace AutoTokenizer' without the flag), the file unchanged."""
    tok = tmp_path / "tokenizer.json"
    tok.write_bytes(content)
    line = _parse_error(capsys, [a for a in BASE if a != "--mock-data"] + [
        "--data-path", str(tiny_data / "text_text_document"), "--tokenizer-model", str(tok)])
    assert line.startswith(f"{PROG}: error: --tokenizer-model: ") and str(tok) in line, line
    assert tok.read_bytes() == content


@pytest.mark.parametrize("fmt", ["torch", "torch_dcp", "fsdp_dtensor"])
@pytest.mark.parametrize("flag", ["--save", "--load"])
def test_checkpoint_format_other_than_torch_dist_is_refused_before_any_work(capsys, tmp_path, fmt, flag):
    """--ckpt-format torch wrote legacy pickled checkpoints (exit 0) that no later run of this trainer loads; every
    format but torch_dist is refused up front, nothing written."""
    extra = [flag, str(tmp_path / "ck")] + (["--save-interval", "2"] if flag == "--save" else [])
    line = _parse_error(capsys, BASE + extra + ["--ckpt-format", fmt])
    assert line.startswith(f"{PROG}: error: --ckpt-format: {fmt}: this trainer writes and reads torch_dist "
                           f"checkpoints only"), line
    assert os.listdir(tmp_path) == []


def test_train_iters_and_train_samples_together_name_both_flags(capsys):
    """Megatron-LM refused the pair with 'expected iteration-based training', naming neither flag."""
    line = _parse_error(capsys, BASE + ["--train-samples", "8"])
    assert line == f"{PROG}: error: --train-samples: give either --train-iters or --train-samples, not both", line


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_stdout_on_a_full_disk_is_one_line():
    """stdout redirected to a full disk: megatron's log lines raised a '--- Logging error ---' traceback each; now
    the first failed write of stdout ends the run with one line, exit 1."""
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore", MEGATRON_GLM5_CHECK_ARGS="1",
               OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_glm5_vlm.py")] + BASE, cwd=REPO, env=env,
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stderr.splitlines() == [f"{PROG}: error: No space left on device"], \
        proc.stderr[-3000:]


def test_data_path_folder_instead_of_a_prefix_names_the_prefix_to_give(capsys, tiny_data, tmp_path):
    """--data-path DIR for indexed text said 'missing data file DIR.bin'; now it names the prefix inside DIR."""
    line = _parse_error(capsys, [a for a in BASE if a != "--mock-data"] + [
        "--data-path", str(tiny_data), "--tokenizer-model", str(tiny_data)])
    assert line == (f"{PROG}: error: --data-path: {tiny_data} is a folder; give the prefix of its PREFIX.bin / "
                    f"PREFIX.idx, e.g. {tiny_data / 'text_text_document'}"), line
    line = _parse_error(capsys, [a for a in BASE if a != "--mock-data"] + [
        "--data-path", str(tmp_path), "--tokenizer-model", str(tiny_data)])
    assert line.endswith("(it holds no .idx; write them with tools/preprocess_data.py)"), line


def test_fp16_is_refused_before_any_work(capsys):
    """--fp16 alone passed the checks and ended in megatron-core's 'Either config.fp16 or config.bf16 should be
    True' traceback when the model was wrapped: this model's config carries bf16 or fp32 only."""
    line = _parse_error(capsys, BASE + ["--fp16"])
    assert line == f"{PROG}: error: --fp16: this model trains in bf16 (--bf16) or fp32, not fp16", line


def test_pretrained_checkpoint_that_is_an_hf_checkpoint_says_to_convert_it(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    line = _parse_error(capsys, BASE + ["--pretrained-checkpoint", str(tmp_path)])
    assert line == (f"{PROG}: error: --pretrained-checkpoint: no checkpoint in {tmp_path} (no "
                    f"latest_checkpointed_iteration.txt); it holds an HF checkpoint: convert it with "
                    f"tools/convert_hf_to_mcore.py and give the converter's --out"), line
