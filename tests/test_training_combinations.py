"""Training and checkpoint combinations through ``pretrain_glm5_vlm.py`` (issue 51): bf16 without the distributed
optimizer saves and resumes bitwise (with and without the indexer warm-up), an HF checkpoint given to ``--load`` is
refused, a config whose heads do not divide the width trains, a resume of another model function is refused (a
field one config leaves out at transformers' default), a warm-up whose every step was skipped fails (in process
and through the script), and a checkpoint without its manifest needs the flag that trusts it."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.training_harness import TINY, error_lines, read_dist_checkpoint, run

PROG = "pretrain_glm5_vlm.py: error: "


def _ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc


def _final(root, iteration):
    return read_dist_checkpoint(str(root / f"iter_{iteration:07d}"))


def _bitwise_equal(a, b):
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


# ---------------------------------------------------------------------------- bf16 without the distributed optimizer
BF16 = TINY + ["--mock-data", "--bf16", "--train-iters", "4"]
WARMUP = ["--dsa-indexer-loss-coeff", "1.0", "--dsa-indexer-warmup", "4"]


@pytest.mark.parametrize("extra", [[], WARMUP], ids=["plain", "indexer_warmup"])
def test_bf16_without_distributed_optimizer_saves_and_resumes_bitwise(tmp_path, extra):
    """--bf16 with megatron-core's (non-distributed) bf16 optimizer, whose fp32 islands sit in param groups of their
    own: the save at iteration 2 is written (fp32 main weights and Adam state of every trained parameter, the fp32
    islands' included) and the resume to iteration 4 ends bitwise where a straight run does. Under
    --dsa-indexer-warmup only the indexers train (an fp32 island among them)."""
    import shutil

    args = BF16 + extra
    straight = tmp_path / "straight"
    _ok(run(args + ["--save", str(straight), "--save-interval", "2"]))
    root = tmp_path / "cut"  # the straight run as if stopped after its save of iteration 2
    shutil.copytree(straight, root)
    shutil.rmtree(root / "iter_0000004")
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    two = _final(root, 2)
    assert any(k.startswith("optimizer.state.fp32_param.") for k in two)
    moments = [k for k in two if k.startswith("optimizer.state.exp_avg.")]
    assert any("attn_hc" in k or "compress_ape" in k for k in moments)  # an fp32 island's state is saved
    for key in moments:  # each state tensor has its own weight's shape
        assert two[key].shape == two[key.split("optimizer.state.exp_avg.", 1)[1]].shape, key
    _ok(run(args + ["--save", str(root), "--save-interval", "100", "--load", str(root)]))
    _bitwise_equal(_final(straight, 4), _final(root, 4))


# ---------------------------------------------------------------------------- what --load may name
def _parse_error(capsys, argv):
    from megatron_glm5.training.arguments import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=1, prog="pretrain_glm5_vlm.py")
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith(PROG), err
    return err[0]


def _digest(path):
    return {n: (path / n).read_bytes() for n in sorted(os.listdir(path))}


def test_load_of_an_hf_checkpoint_is_refused(tmp_path, capsys):
    """An HF checkpoint folder (config.json + safetensors, no tracker) given to --load would train from random
    weights (Megatron-LM starts from scratch without a tracker): one line naming --pretrained-checkpoint and the
    converter, exit 2, the folder untouched. A folder with config.json but no weights is a fresh --load still."""
    from megatron_glm5.config import tiny_hf_config

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(tiny_hf_config(mtp=True)))
    (hf / "model.safetensors").write_bytes(b"\x08\0\0\0\0\0\0\0{}      ")
    before = _digest(hf)
    line = _parse_error(capsys, TINY + ["--mock-data", "--train-iters", "3", "--load", str(hf)])
    assert "--load" in line and "HF checkpoint" in line and "--pretrained-checkpoint" in line \
        and "convert_hf_to_mcore.py" in line, line
    assert _digest(hf) == before


# ---------------------------------------------------------------------------- an architecture of the config's sizes
def test_heads_that_do_not_divide_the_width_train(tmp_path):
    """A valid MLA config of 5 heads on a width of 64 (transformers and the converters take it): --kv-channels
    comes from the config (Megatron-LM's own default asserts hidden % heads == 0), and the run trains with the
    config's head sizes (5 heads x 16 = 80 wide attention projections) to a finite loss."""
    from megatron_glm5.config import tiny_hf_config

    cfg = tiny_hf_config(mtp=True)
    cfg["text_config"].update(num_attention_heads=5, num_key_value_heads=5)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(cfg))
    args = [a for a in TINY if a not in ("--model-preset", "glm5-tiny")]
    _ok(run(args + ["--hf-config", str(hf), "--mock-data", "--train-iters", "3", "--save", str(tmp_path / "ck"),
                    "--save-interval", "100"]))
    sd = _final(tmp_path / "ck", 3)
    mla = [k[:-len("q_b_proj.weight")] for k in sd if k.endswith("self_attention.q_b_proj.weight")
           and not k.startswith("optimizer.")]  # the MLA (DSA) layers
    assert mla and all(tuple(sd[p + "q_b_proj.weight"].shape) == (80, 48) and tuple(sd[p + "o_proj.weight"].shape)
                       == (64, 80) for p in mla), mla
    assert all(torch.isfinite(v).all() for k, v in sd.items() if v.is_floating_point())


# ---------------------------------------------------------------------------- a resume of another model
def _fake_checkpoint(root, hf_config):
    (root / "iter_0000004").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    (root / "iter_0000004" / "metadata.json").write_text("{}")
    (root / "iter_0000004" / "hf_config.json").write_text(json.dumps(hf_config))


@pytest.mark.parametrize("key, value", [("num_experts_per_tok", 1), ("routed_scaling_factor", 1.0),
                                        ("swiglu_limit", 7.0)])
def test_resume_of_another_model_function_is_refused(tmp_path, key, value):
    """A checkpoint whose hf_config.json differs from the run's in a field that changes what the model computes
    but not its tensors: one line naming the field and both values; a difference in a field that does not
    (transformers_version, initializer_range) is no refusal."""
    from megatron_glm5.config import tiny_hf_config
    from megatron_glm5.training.checkpoint_checks import CheckpointDirError, check_architecture

    run_cfg = tiny_hf_config(mtp=True)
    saved = tiny_hf_config(mtp=True)
    saved["text_config"].update({key: value, "initializer_range": 0.5})
    saved["transformers_version"] = "0.0.1"
    _fake_checkpoint(tmp_path / "ck", saved)
    ckpt = str(tmp_path / "ck" / "iter_0000004")
    was = run_cfg["text_config"][key]
    with pytest.raises(CheckpointDirError, match=f"{key} is {value!r} there, {was!r} in this run's model config"):
        check_architecture(ckpt, run_cfg)
    saved["text_config"][key] = was
    (tmp_path / "ck" / "iter_0000004" / "hf_config.json").write_text(json.dumps(saved))
    check_architecture(ckpt, run_cfg)
    run_cfg["vision_config"]["rms_norm_eps"] = 1e-3  # the vision tower's fields count too
    with pytest.raises(CheckpointDirError, match="vision_config.rms_norm_eps is 1e-05 there"):
        check_architecture(ckpt, run_cfg)


@pytest.mark.parametrize("key, value", [("num_experts_per_tok", 1), ("routed_scaling_factor", 1.0),
                                        ("swiglu_limit", 7.0)])
@pytest.mark.parametrize("left_out", ["run", "checkpoint"])
def test_a_field_one_config_leaves_out_compares_as_transformers_default(tmp_path, key, value, left_out):
    """One config leaves the field out (transformers' default applies: Glm5NextTextConfig's), the other sets it to
    another value: refused, naming the field with the default as the value of the side that leaves it out; the
    other side set to the default itself: no refusal."""
    from megatron_glm5.config import tiny_hf_config
    from megatron_glm5.config.hf_defaults import HF_TEXT_DEFAULTS
    from megatron_glm5.training.checkpoint_checks import CheckpointDirError, check_architecture

    default = HF_TEXT_DEFAULTS[key]
    assert value != default
    run_cfg, saved = tiny_hf_config(mtp=True), tiny_hf_config(mtp=True)
    without, with_it = (run_cfg, saved) if left_out == "run" else (saved, run_cfg)
    without["text_config"].pop(key, None)
    with_it["text_config"][key] = value
    _fake_checkpoint(tmp_path / "ck", saved)
    ckpt = str(tmp_path / "ck" / "iter_0000004")
    there, here = (value, default) if left_out == "run" else (default, value)
    with pytest.raises(CheckpointDirError, match=f"{key} is {there!r} there, {here!r} in this run's model config"):
        check_architecture(ckpt, run_cfg)
    with_it["text_config"][key] = default
    (tmp_path / "ck" / "iter_0000004" / "hf_config.json").write_text(json.dumps(saved))
    check_architecture(ckpt, run_cfg)


def test_resume_of_another_model_function_is_one_line(tmp_path):
    """Through pretrain_glm5_vlm.py: the same refusal before any work, exit 2, naming --load."""
    from megatron_glm5.config import tiny_hf_config

    saved = tiny_hf_config(mtp=True)
    saved["text_config"]["routed_scaling_factor"] = 1.0
    _fake_checkpoint(tmp_path / "ck", saved)
    proc = run(TINY + ["--mock-data", "--train-iters", "4", "--load", str(tmp_path / "ck")])
    lines = error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(PROG + "--load") and "routed_scaling_factor is 1.0 there, 2.5" in lines[0], lines


# ---------------------------------------------------------------------------- a warm-up that never trained
@pytest.mark.parametrize("updated, skipped, iteration, refused", [
    (0, 2, 2, True),     # every step of the warm-up skipped: its last checkpoint is not written
    (1, 1, 2, False),    # one step trained
    (0, 2, 1, False),    # a periodic save inside the warm-up, not its last checkpoint
])
def test_warmup_whose_every_step_was_skipped_is_not_saved(monkeypatch, updated, skipped, iteration, refused):
    """The save of the indexer warm-up's last iteration (--dsa-indexer-warmup 2) when none of the run's steps
    updated the weights (the step counts the non-finite-step guard keeps on the optimizer): TrainingStopped (one
    line, exit 1 in the entry), naming the iteration, and Megatron-LM's save never runs; otherwise it runs."""
    import argparse

    from megatron.training import global_vars

    from megatron_glm5.training.megatron_hooks import TrainingStopped, refuse_nonfinite_save

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", argparse.Namespace(dsa_indexer_warmup=2,
                                                                         dsa_indexer_warmup_stage=True))
    saves = []
    save = refuse_nonfinite_save(lambda it, model, *a, **kw: saves.append(it))
    model = torch.nn.Linear(2, 2)
    optimizer = argparse.Namespace(glm5_steps={"updated": updated, "skipped": skipped, "in_a_row": skipped})
    if refused:
        with pytest.raises(TrainingStopped, match="iteration 2: every iteration of this run's indexer warm-up "
                                                  r"\(2\) was skipped.*not saved"):
            save(iteration, model, optimizer, None)
        assert saves == []
    else:
        save(iteration, model, optimizer, None)
        assert saves == [iteration]


@pytest.mark.parametrize("nan_at", [[1, 2], [1]], ids=["every_step", "one_step"])
def test_warmup_whose_every_step_is_nan_exits_1_without_its_checkpoint(tmp_path, nan_at):
    """Through pretrain_glm5_vlm.py: --dsa-indexer-warmup 2 with --inject-nan-at-iteration (in the warm-up the NaN
    reaches the indexer loss's gradient, the one loss it trains): each such step is skipped; when every step was,
    the run exits 1 with one line naming the iteration and --save holds no tracked checkpoint; with one trained
    step the warm-up's checkpoint of iteration 2 is written and the run exits 0."""
    ck = tmp_path / "ck"
    proc = run(TINY + ["--mock-data", "--train-iters", "4", "--dsa-indexer-loss-coeff", "1.0",
                       "--dsa-indexer-warmup", "2", "--inject-nan-at-iteration", *map(str, nan_at), "--save", str(ck),
                       "--save-interval", "100"])
    skipped = [i for i in (1, 2) if f"iteration {i}: gradient norm nan: update skipped" in proc.stdout]
    assert skipped == nan_at, proc.stdout[-3000:]
    if nan_at == [1, 2]:
        lines = error_lines(proc)
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
        assert lines[0].startswith(PROG) and "iteration 2: every iteration of this run's indexer warm-up (2) was " \
                                              "skipped" in lines[0], lines
        assert not (ck / "latest_checkpointed_iteration.txt").exists()
    else:
        _ok(proc)
        assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
        assert all(torch.isfinite(v).all() for v in _final(ck, 2).values() if v.is_floating_point())
