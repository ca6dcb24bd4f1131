"""What a tiny training start prints and logs (pretrain_glm5_vlm.py in a fresh process, Python warnings shown):
Megatron-LM's lines and ours, none of the stack's messages a user cannot act on (training/quiet.py), Megatron-LM's
arguments dump and TensorBoard args text equal to the model config that is built (training/model_args.py), the
TensorBoard tags the docs name."""

import re

import pytest

from training_harness import TINY, run, scalars

NOISE = ("Transformer Engine and Apex are not installed", "Apex is not installed", "one_logger package",
         "confluence.nvidia.com", "async save is deprecated", "Params for bucket", "param.main_grad.dtype",
         "TP size not found", "Job sharding has changed", "allocated: 0.00", "RerunStateMachine",
         "It is recommended to use a ModelConfig", "Warning:", "warnings.warn")


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    tb = tmp_path_factory.mktemp("quiet") / "tb"
    proc = run(TINY + ["--mock-data", "--train-iters", "3", "--tensorboard-dir", str(tb)],
               env={"PYTHONWARNINGS": ""})  # Python's default filters, as a user runs it
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, tb


def _dump(stdout: str) -> dict:
    """Megatron-LM's arguments dump: {name: printed value}."""
    block = stdout.split("------------------------ arguments ------------------------\n", 1)[1]
    block = block.split("\n-------------------- end of arguments", 1)[0]
    out = {}
    for line in block.splitlines():
        m = re.match(r"  (\S+) \.*\s?(.*)$", line)
        out[m.group(1)] = m.group(2)
    return out


def test_start_prints_no_noise_and_few_lines(start):
    proc, _ = start
    text = proc.stdout + proc.stderr
    for noise in NOISE:
        assert noise not in text, noise
    assert text.count("Theoretical memory footprints") == 1
    before = proc.stdout.split("iteration        1/", 1)[0]
    dump = before.split("------------------------ arguments", 1)[1].split("end of arguments", 1)[0]
    lines = [ln for ln in (before.replace(dump, "") + proc.stderr).splitlines() if ln.strip()]
    assert len(lines) < 70, "\n".join(lines)  # 62 on megatron-core 0.19.2, CPU
    assert len(dump.splitlines()) > 500  # Megatron-LM's dump is printed, once
    hooks = [ln for ln in lines if ln.startswith("megatron_glm5 hooks into megatron.training: ")]
    assert len(hooks) == 1 and len(hooks[0]) < 200 and "checkpoints" in hooks[0], hooks
    assert "INFO:megatron.core.distributed.param_and_grad_buffer:Number of buckets for gradient all-reduce / " \
           "reduce-scatter: 1" in lines


def test_arguments_dump_and_tensorboard_text_are_the_built_model(start):
    from megatron_glm5.config import Glm5Config
    from megatron_glm5.training.arguments import hf_config_dict
    from megatron_glm5.training.model_args import MODEL_ARGS

    proc, tb = start
    config = Glm5Config.from_hf(hf_config_dict(None, "glm5-tiny"))
    dump = _dump(proc.stdout)
    assert (dump["normalization"], dump["hidden_dropout"], dump["attention_dropout"], dump["add_bias_linear"],
            dump["multi_latent_attention"], dump["moe_router_score_function"], dump["qk_head_dim"]) == \
           ("RMSNorm", "0.0", "0.0", "False", "True", "sigmoid", str(config.qk_head_dim))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb), size_guidance={"tensors": 0})
    acc.Reload()
    compared = 0
    for name in MODEL_ARGS:
        want = getattr(config, name, None)
        if name not in dump or want is None:
            continue
        assert dump[name] == str(want), (name, dump[name], want)
        text = acc.Tensors(f"{name}/text_summary")[-1].tensor_proto.string_val[0].decode()
        assert text == str(want), (name, text, want)
        compared += 1
    assert compared >= 20


def test_tensorboard_tags_are_the_documented_ones(start):
    _, tb = start
    tags = scalars(tb)
    assert [step for step, _ in tags["mtp_1_acceptance_rate"]] == [1, 2, 3]
    assert all(0.0 <= v <= 100.0 for _, v in tags["mtp_1_acceptance_rate"])  # percent
    assert not [t for t in tags if "cumulative_acceptance_rate" in t]
    assert "lm loss" in tags and not [t for t in tags if t.startswith("data/")]  # mock rows carry no counts


def test_a_run_that_fails_before_its_first_iteration_leaves_no_event_file(tmp_path):
    """A resume refused after start-up (a learning-rate schedule unlike the checkpoint's) ends with one line and
    leaves no TensorBoard event file (it held the arguments text only); a run that logged iterations keeps its."""
    import os

    ckpt = str(tmp_path / "ckpt")
    common = TINY + ["--mock-data", "--save", ckpt, "--load", ckpt, "--save-interval", "2"]
    first = run(common + ["--train-iters", "3", "--tensorboard-dir", str(tmp_path / "tb1")])
    assert first.returncode == 0, first.stderr[-3000:]
    assert [f for f in os.listdir(tmp_path / "tb1") if f.startswith("events.")]
    second = run(common + ["--train-iters", "5", "--tensorboard-dir", str(tmp_path / "tb2")])
    lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
    assert second.returncode == 1 and "learning-rate schedule" in lines[-1], second.stderr[-3000:]
    assert not os.path.exists(tmp_path / "tb2") or not [f for f in os.listdir(tmp_path / "tb2")
                                                      if f.startswith("events.")]


def test_make_tiny_data_names_its_output_not_its_temporary_folder(tmp_path):
    """make_tiny_data writes into a temporary folder renamed at the end: its one line names the output folder, and
    preprocess_data (run inside it) prints no line naming the temporary folder."""
    import os
    import subprocess
    import sys

    from training_harness import REPO

    out = tmp_path / "tiny"
    proc = subprocess.run([sys.executable, "tools/make_tiny_data.py", "--out", str(out), "--text-docs", "4",
                           "--vqa-docs", "2"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"make_tiny_data: wrote {out / 'tokenizer.json'}, 4 text "
                                                   f"documents ({out / 'text_text_document'})"), lines
    assert (out / "text_text_document.idx").is_file()


RELEASE_NOISE = ("TP size not found in checkpoint args", "PP size not found in checkpoint args",
                 "Job sharding has changed", "could not find arguments in the checkpoint")


def test_a_run_from_a_release_checkpoint_and_its_resume_print_no_layout_noise(tmp_path, mcore):
    """A run from a release checkpoint (the converter's layout: weights and checkpoint_version, no run arguments,
    RNG or rerun state) and the resume of its save: Megatron-LM's lines about the arguments, TP / PP size and job
    sharding the release checkpoint lacks are not printed (quiet.QUIET_PRINTS), its load lines are."""
    from tests.test_parallel_training import _initial_checkpoint

    hf, init = _initial_checkpoint(tmp_path, "moe")
    ck = str(tmp_path / "ck")
    common = ["--hf-config", str(hf), "--mock-data", "--seq-length", "32", "--micro-batch-size", "2",
              "--global-batch-size", "4", "--lr", "1e-2", "--lr-warmup-iters", "2", "--lr-decay-iters", "4",
              "--min-lr", "1e-3", "--log-interval", "1", "--eval-iters", "0", "--save", ck, "--save-interval", "100"]
    first = run(common + ["--train-iters", "2", "--pretrained-checkpoint", str(init), "--trust-unverified-checkpoint"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"loading release distributed checkpoint from {init}" in first.stdout
    second = run(common + ["--train-iters", "4", "--load", ck, "--use-checkpoint-opt_param-scheduler"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"loading distributed checkpoint from {ck} at iteration 2" in second.stdout
    for proc in (first, second):
        text = proc.stdout + proc.stderr
        assert [n for n in RELEASE_NOISE if n in text] == [], text[-3000:]


@pytest.mark.parametrize("release", [True, False])
def test_release_checkpoint_lines_are_filtered_only_for_a_release_checkpoint(tmp_path, monkeypatch, capsys, release):
    """megatron.training.checkpointing's print_rank_0 after quiet.install_prints: the QUIET_PRINTS lines are dropped
    while --load names a release checkpoint, printed for an iteration checkpoint; other lines always print."""
    import argparse

    from megatron.training import checkpointing, global_vars

    from megatron_glm5.training import quiet

    (tmp_path / ("release" if release else "iter_0000002")).mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release" if release else "2")
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", argparse.Namespace(load=str(tmp_path), pretrained_checkpoint=None))
    monkeypatch.setattr(checkpointing, "print_rank_0", checkpointing.print_rank_0)  # restored after the test
    assert quiet.install_prints() and quiet.install_prints()  # idempotent: one filter over upstream's
    lines = ["WARNING: TP size not found in checkpoint args, using 1 as default.",
             "WARNING: PP size not found in checkpoint args, using 1 as default.",
             "Job sharding has changed: Rerun state will be ignored", "could not find arguments in the checkpoint ...",
             " checkpoint version 3.0"]
    for line in lines:
        checkpointing.print_rank_0(line)
    out = capsys.readouterr().out.splitlines()
    assert out == (lines[-1:] if release else lines), out
