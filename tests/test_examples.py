"""examples/*.sh as a user runs them: the CPU one for real (and again, resuming), the GPU launchers through their
DRY_RUN argument check (Megatron-LM's checks and ours for the world they would have); the Slurm launcher's layout is
the one scripts/plan_layout.py --search ranks first."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from tests.training_harness import REPO, scalars

EXAMPLES = os.path.join(REPO, "examples")


def _bash(args, env=None, timeout=900):
    full = dict(os.environ, PYTHON=sys.executable, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **(env or {}))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full.pop(var, None)
    full.update(env or {})
    return subprocess.run(["bash"] + args, cwd=REPO, env=full, capture_output=True, text=True, timeout=timeout)



def test_tiny_cpu_example_trains_and_resumes(tmp_path):
    out = tmp_path / "tiny"
    first = _bash([os.path.join(EXAMPLES, "train_tiny_cpu.sh"), str(out)])
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    losses = dict(scalars(out / "tensorboard")["lm loss"])
    assert sorted(losses)[-1] == 20 and losses[20] < losses[1]
    again = _bash([os.path.join(EXAMPLES, "train_tiny_cpu.sh"), str(out), "--train-iters", "22",
                   "--use-checkpoint-opt_param-scheduler"])  # Megatron-LM: keep the saved schedule
    assert again.returncode == 0, again.stderr[-3000:]
    assert "at iteration 20" in again.stdout  # Megatron-LM: loading distributed checkpoint ... at iteration 20
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "22"


@pytest.mark.parametrize("script, world", [("pretrain_glm5_flash_1node.sh", 8), ("pretrain_glm5_flash_slurm.sh", 64)])
def test_gpu_launchers_pass_the_argument_checks(tmp_path, tiny_data, script, world):
    proc = _bash([os.path.join(EXAMPLES, script), str(tiny_data / "text_text_document"), str(tiny_data),
                  str(tmp_path / "out")], env={"DRY_RUN": "1", "NNODES": "8"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"for a world of {world}" in proc.stdout, proc.stdout[-2000:]
    assert not (tmp_path / "out").exists()  # nothing written


def test_vqa_launcher_passes_the_argument_checks(tmp_path, tiny_data):
    hf = tmp_path / "hf"
    made = subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_tiny_hf_checkpoint.py"), "--out", str(hf),
                           "--format", "bf16"], capture_output=True, text=True, cwd=REPO)
    assert made.returncode == 0, made.stderr[-2000:]
    for name in ("tokenizer.json",):  # the model's tokenizer, as a released checkpoint has it
        (hf / name).write_bytes((tiny_data / name).read_bytes())
    proc = _bash([os.path.join(EXAMPLES, "finetune_vqa.sh"), str(hf), str(tiny_data / "vqa" / "vqa.jsonl"),
                  str(tmp_path / "out"), "2"], env={"DRY_RUN": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "for a world of 2" in proc.stdout, proc.stdout[-2000:]


def _launcher_flags(script: str) -> list:
    text = open(os.path.join(EXAMPLES, script)).read()
    body = text[text.index("ARGS=(") + len("ARGS=("):text.index("\n)\n")]
    return shlex.split(body, comments=True)


def test_slurm_layout_is_the_planners_first_choice():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "plan_layout.py"), "--gpus", "64",
                           "--gpu", "h100", "--seq-length", "4096", "--global-batch-size", "1024", "--search", "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    best = json.loads(proc.stdout)[0]["flags"]
    flags = _launcher_flags("pretrain_glm5_flash_slurm.sh")
    pairs = {}
    for i, f in enumerate(best):
        if f.startswith("--"):
            value = best[i + 1] if i + 1 < len(best) and not best[i + 1].startswith("--") else None
            pairs[f] = value
    for flag, value in pairs.items():
        assert flag in flags, (flag, flags)
        if value is not None:
            assert flags[flags.index(flag) + 1] == value, (flag, value)
