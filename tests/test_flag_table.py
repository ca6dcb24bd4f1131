"""The flag table's snapshot (megatron_glm5/training/flag_table.json) against the live parser, and the front parser
built from it: ``--help`` and the flag errors that need no torch, before torch is imported."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from megatron_glm5.training import flag_table
from tests.training_harness import REPO

HEAVY = ("torch", "megatron", "transformers", "numpy")
# what each command may take at most on CI's 2 busy cores (measured: about 1 s; the slow path took 15-60 s)
WALL_S = 10.0

_WRAPPER = """
import json, runpy, sys
script, argv = sys.argv[1], sys.argv[2:]
sys.argv = [script] + argv
code = 0
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as e:
    code = e.code
sys.stderr.write("\\nRESULT " + json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules]}) + "\\n")
""" % (HEAVY,)


def run_script(script: str, argv: list) -> tuple:
    """(exit code, modules of HEAVY imported, stdout, stderr lines without the result, wall seconds) of ``script``
    run with ``argv`` in a fresh interpreter."""
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _WRAPPER, os.path.join(REPO, script)] + argv, cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - start
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    result = json.loads(lines[-1][len("RESULT "):])
    return result["code"], result["heavy"], proc.stdout, lines[:-1], wall


def test_snapshot_matches_the_live_parser():
    """The committed snapshot is what Megatron-LM's parser with the GLM flags gives now (regenerate it with
    ``python -m megatron_glm5.training.flag_table --write``)."""
    with open(flag_table.SNAPSHOT, encoding="utf-8") as fh:
        snapshot = json.load(fh)
    live = json.loads(json.dumps(flag_table.live_table()))
    assert snapshot["megatron_core"] == live["megatron_core"] == flag_table.installed_megatron_core()
    by_flag = {r["option_strings"][0]: r for r in live["actions"]}
    stale = [r["option_strings"][0] for r in snapshot["actions"] if by_flag.get(r["option_strings"][0]) != r]
    assert not stale, f"stale snapshot rows: {stale[:10]}"
    assert snapshot == live


def test_refused_flags_are_the_ones_the_checks_refuse():
    """The rows marked refused are refused by the full parse, an unmarked one is not."""
    table = flag_table.load_table()
    refused = {r["option_strings"][0]: r["refused"] for r in table["actions"]}
    for flag in ("--hidden-dropout", "--attention-backend", "--hidden-size", "--fp16", "--cuda-graph-impl",
                 "--enable-cuda-graph", "--distribute-saved-activations", "--fine-grained-activation-offloading"):
        assert refused[flag], flag
    for flag in ("--lr", "--log-interval", "--save-interval", "--moe-aux-loss-coeff", "--num-layers",
                 "--pipeline-model-parallel-layout", "--num-layers-per-virtual-pipeline-stage", "--kda-backend"):
        assert refused[flag] is None, flag


BASE = ["--model-preset", "glm5-tiny", "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "2",
        "--lr", "1e-3", "--eval-iters", "0", "--mock-data"]


@pytest.mark.parametrize("extra", [
    ["--lr-decay-stlye", "cosine"],                              # unknown, with a close match
    ["--no-such-flag"],                                          # unknown, none close
    ["--lr", "abc"],                                             # type
    ["--lr-decay-style", "sideways"],                            # choice
    ["--attention-backend", "bogus"],                            # choice of an enum flag, by member name
    ["--log-interval", "0"],                                     # bound (an *_interval is >= 1)
    ["--seed", "-3"],
    ["--adam-beta2", "1"],
    ["--lr", "nan"],
    ["--num-layers", "0"],                                       # the architecture's flags, before the rest
    ["--hf-config", "/nonexistent"],
    ["--loss-on-all-turns", "--loss-on-last-turn-only"],         # mutually exclusive
    ["--lr"],                                                    # value missing
    ["--lr-warmup-iters", "2"],                                  # the schedule (check_layout_and_schedule)
    ["--min-lr", "1"],
    ["--tensor-model-parallel-size", "2"],                       # the layout against the world of one process
    ["--global-batch-size", "3"],
    ["--save-interval", "5"],                                    # needs --save
    ["--cuda-graph-impl", "local"],                              # refused (check_unsupported_features)
    ["--eval-iters", "5"],                                       # the data and output flags (no --eval-interval)
    ["--data-path", "/nonexistent/prefix"],                      # --mock-data and --data-path
    ["--dataset-type", "vqa"],                                   # mock data is text
    ["--loss-on-all-turns"],                                     # chat only
    ["--ckpt-format", "torch", "--save", "/nonexistent/ck", "--save-interval", "1"],
])
def test_front_parser_says_what_the_full_parse_says(capsys, monkeypatch, extra):
    """Each error line of the front parser is the full parse's line for the same command line."""
    from megatron_glm5.training.arguments import parse_args

    monkeypatch.delenv("WORLD_SIZE", raising=False)  # a world of one process, as the full parse is told

    with pytest.raises(SystemExit) as front:
        flag_table.check_flags_fast(BASE + extra, prog="pretrain_glm5_vlm.py")
    front_err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    with pytest.raises(SystemExit) as full:
        parse_args(BASE + extra, world_size=1, prog="pretrain_glm5_vlm.py")
    full_err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert front.value.code == full.value.code == 2
    assert len(front_err) == 1 and front_err == full_err, (front_err, full_err)


def test_front_parser_passes_a_good_command_line(capsys):
    assert flag_table.check_flags_fast(BASE + ["--attention-backend", "unfused", "--exit-signal", "SIGUSR1",
                                               "--no-torch-fused-adam"], prog="pretrain_glm5_vlm.py") is True
    assert capsys.readouterr().err == ""


def test_another_megatron_core_leaves_the_flags_to_the_full_parse(monkeypatch, capsys):
    monkeypatch.setattr(flag_table, "installed_megatron_core", lambda: "0.0.0")
    assert flag_table.load_table() is None
    assert flag_table.check_flags_fast(["--help"]) is False
    assert flag_table.check_flags_fast(["--no-such-flag"]) is False
    assert capsys.readouterr() == ("", "")


def _entry(text: str, flag: str) -> str:
    """The help entry of ``flag`` (its lines up to the next flag), whitespace collapsed."""
    m = re.search(rf"^  {re.escape(flag)}(?=[\s,]).*?(?=^  -|\Z)", text, re.M | re.S)
    assert m, flag
    return " ".join(m.group(0).split())


def test_help_without_torch():
    """``--help``: exit 0 before torch or megatron is imported; the GLM groups first, every default shown, the
    refused flags marked."""
    code, heavy, out, err, wall = run_script("pretrain_glm5_vlm.py", ["--help"])
    assert code == 0 and heavy == [] and err == [], (code, heavy, err)
    assert wall < WALL_S, wall
    groups = re.findall(r"^(\S[^\n]*):$", out, re.M)
    assert groups[:3] == ["GLM-5.3 model", "GLM-5.3 data", "GLM-5.3 training"], groups[:5]
    assert "(default: 100)" in _entry(out, "--log-interval")
    assert "(default: None)" in _entry(out, "--save-interval")
    assert "(default: None)" in _entry(out, "--lr")
    assert "(default: gpt)" in _entry(out, "--dataset-type")
    assert "(default: nccl with CUDA, gloo without)" in _entry(out, "--distributed-backend")
    assert "(default: True with CUDA, False without)" in _entry(out, "--torch-fused-adam")
    assert "[refused:" in _entry(out, "--hidden-dropout")
    assert "--kda-backend pick the attention kernels]" in _entry(out, "--attention-backend")
    assert "[refused:" not in _entry(out, "--lr")
    table = flag_table.load_table()
    shown = [r for r in table["actions"] if r["help"] != "==SUPPRESS==" and r["action"] != "_HelpAction"]
    no_default = [r["option_strings"][0] for r in shown if "(default:" not in _entry(out, r["option_strings"][0])
                  and "%(default)" not in (r["help"] or "")]
    assert not no_default, no_default[:10]


def test_typo_without_torch():
    code, heavy, out, err, wall = run_script("pretrain_glm5_vlm.py", ["--model-preset", "glm5-tiny",
                                                                       "--lr-decay-stlye", "cosine"])
    assert (code, heavy, out) == (2, [], "")
    assert err == ["pretrain_glm5_vlm.py: error: unrecognized arguments: --lr-decay-stlye cosine (did you mean "
                   "--lr-decay-style?)"]
    assert wall < WALL_S, wall


TOOLS = ["tools/convert_hf_to_mcore.py", "tools/convert_mcore_to_hf.py", "tools/hf_forward.py",
         "tools/preprocess_data.py", "tools/make_tiny_data.py", "tools/make_tiny_hf_checkpoint.py",
         "scripts/plan_layout.py"]


@pytest.mark.parametrize("script", TOOLS)
def test_tool_help_and_argument_errors_without_torch(script):
    code, heavy, out, err, wall = run_script(script, ["--help"])
    assert (code, heavy, err) == (0, [], []) and out.startswith("usage:")
    assert wall < WALL_S, wall
    code, heavy, out, err, wall = run_script(script, ["--no-such-flag"])
    prog = os.path.basename(script)[:-len(".py")]
    assert (code, heavy, out) == (2, [], "")
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    assert wall < WALL_S, wall


def test_schedule_error_without_torch():
    """A learning-rate schedule that cannot run: the full parse's line, before torch is imported."""
    code, heavy, out, err, wall = run_script("pretrain_glm5_vlm.py", BASE + ["--lr-warmup-iters", "2"])
    assert (code, heavy, out) == (2, [], "")
    assert err == ["pretrain_glm5_vlm.py: error: --lr-warmup-iters: 2 must be below the decay iterations (2; "
                   "--lr-decay-iters defaults to --train-iters)"], err
    assert wall < WALL_S, wall


@pytest.mark.parametrize("script, argv, line", [
    ("tools/convert_mcore_to_hf.py", ["--load", "/nonexistent", "--out", "/nonexistent/out"],
     "convert_mcore_to_hf: error: --load /nonexistent: no such directory"),
    ("tools/make_tiny_hf_checkpoint.py", ["--out", "/nonexistent/out", "--layers", "1"],
     "make_tiny_hf_checkpoint: error: --layers must be >= 2 (one KDA and one DSA layer)"),
])
def test_tool_input_errors_without_torch(script, argv, line):
    code, heavy, out, err, wall = run_script(script, argv)
    assert (code, heavy, out, err) == (2, [], "", [line])
    assert wall < WALL_S, wall
