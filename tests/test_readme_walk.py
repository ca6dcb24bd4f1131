"""The README's training walk, its commands taken from README.md and run in order on the tiny model (CPU): convert
-> preprocess -> fine-tune with --save / --load, killed (SIGKILL) after its second checkpoint -> the same command
again resumes there and finishes -> export. Only the sizes change (tiny model, short rows, few steps, one process
instead of torchrun's 8, fp32 instead of bf16 on the CPU)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys

from tests.training_harness import REPO, saved_iteration, scalars

# README value -> the tiny run's
SIZES = {"--seq-length": "64", "--global-batch-size": "4", "--train-iters": "6", "--save-interval": "2",
         "--eval-interval": "3", "--eval-iters": "1", "--expert-model-parallel-size": "1", "--lr": "1e-2",
         "--workers": "1"}


def _readme_commands():
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    block = text.split("From the released HF checkpoint to a fine-tuned HF checkpoint:", 1)[1]
    block = block.split("```bash", 1)[1].split("```", 1)[0]
    joined = re.sub(r"\\\n\s*", " ", block)
    return [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def _tiny(cmd: str, hf: str) -> list:
    words = shlex.split(cmd.replace("GLM-5.3-Flash", hf))
    env_prefix = [w for w in words if re.match(r"^[A-Z_]+=", w)]
    words = words[len(env_prefix):]
    if words[0] == "torchrun":
        words = words[words.index("pretrain_glm5_vlm.py"):]
        words = [w for w in words if w != "--bf16"]
    if words[0] == "python":
        words = words[1:]
    out = [sys.executable]
    i = 0
    while i < len(words):
        out.append(words[i])
        if words[i] in SIZES:
            out.append(SIZES[words[i]])
            i += 1
        i += 1
    return out


def test_readme_walk_resumes_where_it_stopped(tmp_path):
    from megatron_glm5.data.tiny_data import make_text_jsonl

    env = dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    hf = str(tmp_path / "GLM-5.3-Flash-tiny")
    made = subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_tiny_hf_checkpoint.py"), "--out", hf,
                           "--mtp"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr[-2000:]
    make_text_jsonl(str(tmp_path / "corpus.jsonl"), 60)

    commands = _readme_commands()
    assert [c.split()[0] for c in commands][:2] == ["python", "python"] and len(commands) == 4
    convert, preprocess, train, export = (_tiny(c, hf) for c in commands)
    for cmd in (convert, preprocess):
        cmd[1] = os.path.join(REPO, cmd[1])
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, (cmd, proc.stderr[-2000:])
    train[1] = os.path.join(REPO, train[1])

    # the first run, killed right after its checkpoint of iteration 4 is complete
    run = subprocess.Popen(train, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    first = []
    for line in run.stdout:
        first.append(line)
        if saved_iteration(line) == 4:
            os.killpg(run.pid, signal.SIGKILL)
            break
    run.wait(timeout=120)
    assert any("loading release distributed checkpoint from glm5_mcore" in ln for ln in first), "".join(first)[-2000:]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"

    again = subprocess.run(train, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "at iteration 4" in again.stdout and "loading release" not in again.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    losses = dict(scalars(tmp_path / "tb")["lm loss"])
    assert {5, 6} <= set(losses) and all(v == v for v in losses.values())

    export[1] = os.path.join(REPO, export[1])
    proc = subprocess.run(export, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = tmp_path / "glm5_finetuned"
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
