"""The training entry (pretrain_glm5_vlm.py) end to end on CPU: flags, memorisation on the three data sources,
exact resume, an interrupted save, NaN skipping, the expert-bias update, logging and bf16 fp32 islands."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.training_harness import REPO, TINY, error_lines, read_dist_checkpoint, run, scalars

ISSUE_FLAGS = """--tensor-model-parallel-size --pipeline-model-parallel-size --num-layers-per-virtual-pipeline-stage
  --expert-model-parallel-size --expert-tensor-parallel-size --context-parallel-size --sequence-parallel
  --use-distributed-optimizer --micro-batch-size --global-batch-size --seq-length --train-iters --lr --min-lr
  --lr-decay-style --lr-warmup-iters --weight-decay --clip-grad --adam-beta1 --adam-beta2 --bf16 --seed
  --recompute-granularity --recompute-method --recompute-num-layers --moe-aux-loss-coeff
  --moe-router-bias-update-rate --mtp-num-layers --mtp-loss-scaling-factor --data-path --split --mock-data
  --tokenizer-model --save --load --pretrained-checkpoint --finetune --save-interval --eval-interval
  --eval-iters --tensorboard-dir --log-interval --exit-interval --freeze-vision --hf-config --model-preset""".split()



def test_help_lists_the_megatron_flags():
    proc = run(["--help"])
    assert proc.returncode == 0
    missing = [f for f in ISSUE_FLAGS if f not in proc.stdout]
    assert not missing, missing


BASE = ["--model-preset", "glm5-tiny", "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "2",
        "--lr", "1e-3", "--eval-iters", "0"]


@pytest.mark.parametrize("extra, flag", [
    (["--mock-data", "--global-batch-size", "3"], "--global-batch-size"),
    (["--data-path", "/nonexistent/corpus_text_document", "--tokenizer-model", "/nonexistent"], "--data-path"),
    (["--mock-data", "--seq-length", "0"], "--seq-length"),
    (["--mock-data", "--min-lr", "1"], "--min-lr"),
    (["--mock-data", "--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size"),
    (["--mock-data", "--recompute-method", "uniform"], "--recompute-method"),
    (["--mock-data", "--save-interval", "2"], "--save-interval"),
    (["--mock-data", "--lr-decay-style", "sideways"], "--lr-decay-style"),
    (["--mock-data", "--hf-config", "/nonexistent"], "--hf-config"),
    (["--mock-data", "--finetune"], "--finetune"),
    (["--mock-data", "--tensor-model-parallel-size", "2"], "--sequence-parallel"),  # MoE + TP needs SP
    (["--mock-data", "--save", "/tmp/x"], "--save-interval"),
    (["--mock-data", "--eval-iters", "5"], "--eval-interval"),
    (["--mock-data", "--hidden-size", "72"], "--hidden-size"),  # contradicts the architecture
    (["--mock-data", "--lr-warmup-iters", "2"], "--lr-warmup-iters"),  # not below the 2 decay iterations
    (["--mock-data", "--no-such-flag"], "--no-such-flag"),
    (["--mock-data", "--pretrained-checkpoint", "/nonexistent"], "--pretrained-checkpoint"),
    (["--mock-data", "--cuda-graph-impl", "local"], "--cuda-graph-impl"),  # features the layers do not carry
    (["--mock-data", "--enable-cuda-graph"], "--cuda-graph-impl"),
    (["--mock-data", "--fine-grained-activation-offloading"], "--fine-grained-activation-offloading"),
    (["--mock-data", "--distribute-saved-activations"], "--distribute-saved-activations"),
])
def test_bad_combination_is_one_line_and_exit_2(capsys, extra, flag):
    from megatron_glm5.training.arguments import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + extra, world_size=2, prog="pretrain_glm5_vlm.py")
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert exc.value.code == 2
    assert len(err) == 1 and err[0].startswith("pretrain_glm5_vlm.py: error:") and flag in err[0], err


@pytest.mark.parametrize("device, extra, expect", [
    ("cpu", [], False),                                       # the torch KDA backend has nothing to keep
    ("cpu", ["--kda-save-intermediates"], True),
    ("cuda", [], None),                                       # on with fla_fused where FLA is installed
    ("cuda", ["--no-kda-save-intermediates"], False),
])
def test_kda_save_intermediates_flag_reaches_the_config(device, extra, expect):
    from megatron_glm5.execution_plan import resolve_execution_plan
    from megatron_glm5.training.arguments import model_config_from_args, parse_args

    cfg = model_config_from_args(parse_args(BASE + ["--mock-data"] + extra, world_size=1), device)
    plan = resolve_execution_plan(cfg, device)
    if expect is None:
        expect = plan.kda_backend == "fla_fused"
    assert plan.kda_save_intermediates is expect
    assert cfg.kda_save_intermediates is (None if not extra else expect)   # the flag as given; None: the plan's


def test_bad_combination_stops_the_script_before_any_work(tmp_path):
    proc = run(BASE + ["--mock-data", "--global-batch-size", "3", "--tensorboard-dir", str(tmp_path / "tb")])
    lines = error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1 and "--global-batch-size" in lines[0], proc.stderr
    assert "not divisible by micro batch 2 x data parallel 1" in lines[0]
    assert not (tmp_path / "tb").exists() and proc.stdout == ""


def test_checkpoint_of_another_architecture_is_refused(tmp_path):
    from megatron_glm5.config import tiny_hf_config

    other = tiny_hf_config(mtp=True)
    other["text_config"]["hidden_size"] = 96
    ckpt = tmp_path / "other"
    (ckpt / "iter_0000004").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    (ckpt / "iter_0000004" / "metadata.json").write_text("{}")
    (ckpt / "iter_0000004" / "hf_config.json").write_text(json.dumps(other))
    proc = run(TINY + ["--mock-data", "--train-iters", "4", "--load", str(ckpt)])
    lines = error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "--load" in lines[0] and "hidden_size" in lines[0] and "another architecture" in lines[0]


def _halves(tb, tag="lm loss"):
    values = [v for _, v in sorted(scalars(tb)[tag])]
    assert len(values) == 30
    return values[0], min(values[-3:])


def test_memorise_mock_data(tmp_path):
    tb = tmp_path / "tb"
    proc = run(TINY + ["--mock-data", "--train-iters", "30", "--tensorboard-dir", str(tb),
                       "--moe-aux-loss-coeff", "1e-3", "--moe-z-loss-coeff", "1e-3", "--log-params-norm",
                       "--log-num-zeros-in-grad",
                       "--log-throughput", "--log-timers-to-tensorboard", "--log-memory-to-tensorboard"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, last = _halves(tb)
    assert last <= first / 2, (first, last)
    tags = scalars(tb)
    for tag in ("lm loss", "mtp_1 loss", "load_balancing_loss", "z_loss", "learning-rate", "grad-norm", "params-norm",
                "num-zeros", "iteration-time", "throughput",
                "mem-allocated-bytes", "mem-max-allocated-bytes", "moe/expert-load-imbalance",
                "moe/expert-load-imbalance/layer_0"):
        assert tag in tags, (tag, sorted(tags))
    assert all(v > 0 for _, v in tags["load_balancing_loss"]) and all(v > 0 for _, v in tags["mtp_1 loss"])
    assert all(v > 0 for _, v in tags["z_loss"])  # Megatron-LM's --moe-z-loss-coeff reaches the routers
    assert "iteration       30/      30" in proc.stdout and "lm loss:" in proc.stdout
    # Megatron-LM's theoretical memory report counts this rank's own parameters, not its GPT formula's
    assert "Number of parameters in transformer block" not in proc.stdout
    weights_mb = re.findall(r"Theoretical memory footprints: weight and optimizer=[0-9.]+ MB \(weights ([0-9.]+),",
                            proc.stdout)
    assert weights_mb and abs(float(weights_mb[0]) - 4 * _tiny_parameter_count() / 2 ** 20) <= 0.006, weights_mb


def _tiny_parameter_count() -> int:
    """Parameters of the glm5-tiny preset's model (each tensor once), built in a subprocess."""
    code = ("from megatron_glm5.initialize import initialize_megatron; initialize_megatron(tp=1, pp=1, ep=1, cp=1, "
            "seed=1); from megatron_glm5.config import Glm5Config, tiny_hf_config; "
            "from megatron_glm5.models.builder import build_model; "
            "m = build_model(Glm5Config.from_hf(tiny_hf_config(mtp=True), use_cpu_initialization=True)); "
            "print(sum(p.numel() for p in m.parameters()))")
    env = {k: v for k, v in os.environ.items()  # not the process group an in-process test set up
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env=dict(env, PYTHONPATH=REPO, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.strip().splitlines()[-1])


def test_memorise_indexed_text(tmp_path, tiny_data):
    tb = tmp_path / "tb"
    proc = run(TINY + ["--data-path", str(tiny_data / "text_text_document"), "--tokenizer-model", str(tiny_data),
                       "--split", "1,0,0", "--train-iters", "30", "--tensorboard-dir", str(tb)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, last = _halves(tb)
    assert last <= first / 2, (first, last)


def test_memorise_packed_image_text(tmp_path, tiny_data):
    tb = tmp_path / "tb"
    args = [a for a in TINY]
    args[args.index("--seq-length") + 1] = "96"
    args[args.index("--micro-batch-size") + 1] = "1"
    args[args.index("--global-batch-size") + 1] = "2"
    proc = run(args + ["--dataset-type", "vqa", "--data-path", str(tiny_data / "vqa" / "vqa.jsonl"),
                       "--tokenizer-model", str(tiny_data), "--split", "1,0,0", "--train-iters", "30",
                       "--tensorboard-dir", str(tb)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, last = _halves(tb)
    assert last <= first / 2, (first, last)
    eff = scalars(tb)["packing-efficiency"]
    assert 0.5 < eff[0][1] <= 1.0


def test_exact_resume_and_a_save_killed_midway(tmp_path):
    """6 steps straight == 3 steps, a save killed with SIGKILL at step 6 (its files written, the tracker not yet
    moved), resume from 3, 3 more steps: the same losses and bitwise the same weights and optimizer state."""
    common = TINY + ["--mock-data", "--train-iters", "6", "--moe-aux-loss-coeff", "1e-3"]
    a = run(common + ["--save", str(tmp_path / "a"), "--save-interval", "100", "--tensorboard-dir", str(tmp_path / "tba")])
    assert a.returncode == 0, a.stderr[-3000:]
    b = run(common + ["--save", str(tmp_path / "b"), "--save-interval", "3", "--test-kill-during-save", "6",
                      "--tensorboard-dir", str(tmp_path / "tbb")])
    assert b.returncode == -9, (b.returncode, b.stderr[-2000:])
    assert (tmp_path / "b" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    c = run(common + ["--save", str(tmp_path / "b"), "--save-interval", "100", "--load", str(tmp_path / "b"),
                      "--tensorboard-dir", str(tmp_path / "tbc")])
    assert c.returncode == 0, c.stderr[-3000:]
    assert "loading distributed checkpoint from" in c.stdout and "at iteration 3" in c.stdout
    la = dict(scalars(tmp_path / "tba")["lm loss"])
    lc = dict(scalars(tmp_path / "tbc")["lm loss"])
    assert sorted(lc) == [4, 5, 6] and all(la[i] == lc[i] for i in (4, 5, 6)), (la, lc)
    sa = read_dist_checkpoint(str(tmp_path / "a" / "iter_0000006"))
    sc = read_dist_checkpoint(str(tmp_path / "b" / "iter_0000006"))
    assert sa.keys() == sc.keys() and any(k.startswith("optimizer.") for k in sa)
    assert [k for k in sa if not torch.equal(sa[k], sc[k])] == []


def test_fused_adams_train_like_foreach_and_the_fused_step_resumes_exactly(tmp_path):
    """--torch-fused-adam (torch's fused Adam kernel for megatron-core's torch fallback; CPU here) and
    --fused-optimizer-step (clip, Adam and the model-weight write in one pass; on CPU its PyTorch reference): the
    losses of 4 clipped steps (gradient norms above --clip-grad 1) match the default foreach Adam's to fp32 rounding
    (the same update, another order of operations), and with the fused step 2 steps + save + resume + 2 steps equal
    4 straight steps bitwise (weights, moments and the step count)."""
    common = TINY + ["--mock-data", "--train-iters", "4", "--use-distributed-optimizer"]
    ref = run(common + ["--tensorboard-dir", str(tmp_path / "tbr")])
    assert ref.returncode == 0, ref.stderr[-3000:]
    torch_fused = run(common + ["--torch-fused-adam", "--tensorboard-dir", str(tmp_path / "tbt")])
    assert torch_fused.returncode == 0, torch_fused.stderr[-3000:]
    assert "param groups run torch's fused Adam" in torch_fused.stdout and " 0 param groups" not in torch_fused.stdout
    fused = common + ["--fused-optimizer-step"]
    a = run(fused + ["--save", str(tmp_path / "a"), "--save-interval", "100", "--tensorboard-dir", str(tmp_path / "tba")])
    assert a.returncode == 0, a.stderr[-3000:]
    assert "--fused-optimizer-step: 2 param groups take the clip coefficient" in a.stdout, a.stdout[-3000:]
    b = run(fused + ["--save", str(tmp_path / "b"), "--save-interval", "100", "--exit-interval", "2",
                     "--tensorboard-dir", str(tmp_path / "tbb")])
    assert b.returncode == 0, b.stderr[-3000:]
    c = run(fused + ["--save", str(tmp_path / "b"), "--save-interval", "100", "--load", str(tmp_path / "b"),
                     "--tensorboard-dir", str(tmp_path / "tbc")])
    assert c.returncode == 0 and "at iteration 2" in c.stdout, c.stderr[-3000:]
    tags = scalars(tmp_path / "tbr")
    lr, norms = dict(tags["lm loss"]), dict(tags["grad-norm"])
    assert sorted(norms) == [1, 2, 3, 4] and min(norms.values()) > 1.0, norms  # every step clipped
    for tb in ("tbt", "tba"):
        got = dict(scalars(tmp_path / tb)["lm loss"])
        assert sorted(got) == [1, 2, 3, 4] and all(abs(got[i] - lr[i]) <= 1e-5 * abs(lr[i]) for i in got), (tb, got, lr)
    la, lc = dict(scalars(tmp_path / "tba")["lm loss"]), dict(scalars(tmp_path / "tbc")["lm loss"])
    assert sorted(lc) == [3, 4] and all(la[i] == lc[i] for i in (3, 4)), (la, lc)
    sa = read_dist_checkpoint(str(tmp_path / "a" / "iter_0000004"))
    sc = read_dist_checkpoint(str(tmp_path / "b" / "iter_0000004"))
    assert sa.keys() == sc.keys() and any(k.startswith("optimizer.") for k in sa)
    assert [k for k in sa if not torch.equal(sa[k], sc[k])] == []


def test_nan_step_is_skipped_and_counted(tmp_path):
    tb = tmp_path / "tb"
    proc = run(TINY + ["--mock-data", "--train-iters", "4", "--inject-nan-at-iteration", "2",
                       "--tensorboard-dir", str(tb), "--log-params-norm"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "iteration 2: gradient norm nan: update skipped (1 in a row)" in proc.stdout
    assert "number of skipped iterations:   1" in proc.stdout.split("iteration        2/")[1].splitlines()[0]
    tags = scalars(tb)
    losses = dict(tags["lm loss"])
    assert all(torch.isfinite(torch.tensor(losses[i])) for i in (1, 3, 4))
    # parameters did not move at the skipped step: its params-norm equals the previous one
    pn = dict(tags["params-norm"])
    assert pn[2] == pn[1] and pn[3] != pn[2]


def test_too_many_nan_steps_stop_the_run_with_the_checkpoint_intact(tmp_path):
    proc = run(TINY + ["--mock-data", "--train-iters", "6", "--inject-nan-at-iteration", "3", "4",
                       "--max-consecutive-skipped-iterations", "2", "--save", str(tmp_path / "ck"),
                       "--save-interval", "2"])
    lines = error_lines(proc)
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
    assert "stopped at iteration 4" in lines[0] and "iteration 2" in lines[0]
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert sorted(os.listdir(tmp_path / "ck")) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


SKEWED_SCRIPT = '''
import sys, torch
import pretrain_glm5_vlm as P

class Skewed(torch.utils.data.Dataset):
    """Every row is one token repeated: every token routes to the same experts."""
    def __init__(self, n, s): self.n, self.s = n, s
    def __len__(self): return self.n
    def __getitem__(self, i):
        t = torch.full((self.s,), 7, dtype=torch.long)
        return {"tokens": t, "labels": t, "loss_mask": torch.ones(self.s)}

def provider(num_samples, vp_stage=None):
    from megatron.training import get_args
    args = get_args()
    return Skewed(num_samples[0], args.seq_length), None, None

provider.is_distributed = True

if __name__ == "__main__":
    from megatron_glm5.training.entry import run_pretrain
    sys.exit(run_pretrain(provider, P.model_provider, P.forward_step, argv=sys.argv[1:], prog="skewed"))
'''


def test_expert_bias_moves_toward_balance(tmp_path):
    """One optimizer step on a skewed batch (every row one repeated token): each MoE layer's expert bias moves by
    the update rate, down for the experts that got more than the mean load and up for the others."""
    script = tmp_path / "skewed.py"
    script.write_text(SKEWED_SCRIPT)
    rate = 0.01
    proc = run(TINY + ["--train-iters", "1", "--lr", "0", "--min-lr", "0", "--lr-warmup-iters", "0",
                       "--moe-router-bias-update-rate", str(rate),
                       "--save", str(tmp_path / "ck"), "--save-interval", "100", "--mock-data",
                       "--tensorboard-dir", str(tmp_path / "tb")],
               script=str(script))
    assert proc.returncode == 0, proc.stderr[-3000:]
    sd = read_dist_checkpoint(str(tmp_path / "ck" / "iter_0000001"))
    biases = {k: v for k, v in sd.items() if k.endswith("router.expert_bias") and not k.startswith("optimizer")}
    assert len(biases) == 4  # three MoE decoder layers + the MTP layer
    for k, bias in biases.items():
        steps = torch.round(bias / rate)
        assert torch.allclose(bias, steps * rate, atol=1e-7) and bool(((steps >= -1) & (steps <= 1)).all()), (k, bias)
        down, up = int((steps < 0).sum()), int((steps > 0).sum())
        assert down >= 1 and up >= down, (k, bias)  # a few experts took most tokens
    imbalance = dict(scalars(tmp_path / "tb")["moe/expert-load-imbalance"])[1]
    assert imbalance > 1.5  # the batch was skewed


def test_fp32_islands_stay_fp32_under_bf16(tmp_path, mcore):
    from megatron.core.transformer.module import Float16Module

    from megatron_glm5.config import tiny_config
    from megatron_glm5.models.builder import build_model

    cfg = tiny_config(mtp_num_layers=1, bf16=True, use_cpu_initialization=True)
    model = build_model(cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if getattr(p, "keep_fp32", False)}
    wrapped = Float16Module(cfg, model)
    islands = {n: p for n, p in wrapped.module.named_parameters() if getattr(p, "keep_fp32", False)}
    assert len(islands) >= 20
    assert all(p.dtype == torch.float32 and torch.equal(p, before[n]) for n, p in islands.items())
    names = {n.split(".")[-1] for n in islands}
    assert {"base", "scale", "A_log", "dt_bias", "index_kpool_compress_ape", "weight"} <= names
    others = [p for n, p in wrapped.module.named_parameters() if n not in islands]
    assert all(p.dtype == torch.bfloat16 for p in others)
    assert all(b.dtype == torch.float32 for n, b in wrapped.module.named_buffers() if "expert_bias" in n)

    proc = run(TINY + ["--mock-data", "--bf16", "--use-distributed-optimizer", "--train-iters", "3",
                       "--save", str(tmp_path / "ck"), "--save-interval", "100"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    sd = read_dist_checkpoint(str(tmp_path / "ck" / "iter_0000003"))
    for name in islands:  # megatron-core keeps the MTP layer's checkpoint keys under 'transformer_layer'
        assert sd[name.replace(".mtp_model_layer.", ".transformer_layer.")].dtype == torch.float32, name
    assert sd["decoder.layers.0.self_attention.linear_proj.weight"].dtype == torch.bfloat16 if (
        "decoder.layers.0.self_attention.linear_proj.weight" in sd) else True
    assert sd["embedding.word_embeddings.weight"].dtype == torch.bfloat16
    assert sd["optimizer.state.fp32_param.embedding.word_embeddings.weight"].dtype == torch.float32 if (
        "optimizer.state.fp32_param.embedding.word_embeddings.weight" in sd) else True


def test_converted_hf_checkpoint_first_step_loss_equals_hf_forward(tmp_path):
    """HF checkpoint -> tools/convert_hf_to_mcore.py -> --pretrained-checkpoint: the first step's lm loss equals
    the loss of tools/hf_forward.py's logits on the same batch (fp32, CPU)."""
    import argparse

    tools = os.path.join(REPO, "tools")
    hf, mc = tmp_path / "hf", tmp_path / "mcore"
    for cmd in ([os.path.join(tools, "make_tiny_hf_checkpoint.py"), "--out", str(hf), "--format", "fp32", "--mtp"],
                [os.path.join(tools, "convert_hf_to_mcore.py"), "--hf-dir", str(hf), "--out", str(mc), "--dtype",
                 "fp32", "--no-progress"]):
        proc = run(cmd[1:], script=cmd[0])
        assert proc.returncode == 0, proc.stderr[-2000:]
    args = ["--hf-config", str(hf), "--mock-data", "--seq-length", "32", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--seed", "7", "--eval-iters", "0"]
    proc = run(args + ["--pretrained-checkpoint", str(mc), "--tensorboard-dir", str(tmp_path / "tb")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"loading release distributed checkpoint from {mc}" in proc.stdout
    train_loss = dict(scalars(tmp_path / "tb")["lm loss"])[1]

    # the same first micro batch, through the data builder the run used
    from megatron_glm5.config import Glm5Config
    from megatron_glm5.data.builder import build_train_valid_test_datasets
    from megatron_glm5.training.arguments import parse_args

    ns: argparse.Namespace = parse_args(args, world_size=1)
    train_ds, _, _ = build_train_valid_test_datasets(ns, Glm5Config.from_hf(str(hf)), None)
    row = train_ds[0]
    torch.save({"input_ids": torch.as_tensor(row["tokens"]).long()[None]}, tmp_path / "in.pt")
    proc = run(["--hf-dir", str(hf), "--input", str(tmp_path / "in.pt"), "--output", str(tmp_path / "out.pt")],
               script=os.path.join(tools, "hf_forward.py"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    logits = torch.load(tmp_path / "out.pt")["logits"][0]
    labels = torch.as_tensor(row["labels"]).long()
    mask = torch.as_tensor(row["loss_mask"]).float()
    ce = torch.nn.functional.cross_entropy(logits.double(), labels, reduction="none")
    ref = float((ce * mask).sum() / mask.sum())
    assert abs(train_loss - ref) <= 1e-5 * abs(ref), (train_loss, ref)


def _final_state(path):
    return {k: v for k, v in read_dist_checkpoint(str(path)).items()}


PREEMPT_STEPS = 12
PREEMPT_RUN = TINY + ["--mock-data", "--train-iters", str(PREEMPT_STEPS), "--save-interval", "100"]


@pytest.fixture(scope="module")
def straight_run_state(tmp_path_factory):
    """The final checkpoint (weights and optimizer state) of ``PREEMPT_RUN`` never stopped."""
    path = tmp_path_factory.mktemp("straight")
    straight = run(PREEMPT_RUN + ["--save", str(path)])
    assert straight.returncode == 0, straight.stderr[-3000:]
    return _final_state(path / f"iter_{PREEMPT_STEPS:07d}")


@pytest.mark.parametrize("how", ["sigterm", "duration"])
def test_preempted_run_saves_exits_0_and_resumes_bitwise(tmp_path, how, straight_run_state):
    """A Slurm-style preemption: SIGTERM under --exit-signal-handler (or --exit-duration-in-mins running out) saves a
    checkpoint and exits 0, leaving no process behind; the same command with --load continues from it to the same
    weights and optimizer state, bit for bit, as a run that was never stopped."""
    import signal
    import time

    steps, common = PREEMPT_STEPS, PREEMPT_RUN

    if how == "sigterm":
        cmd = [sys.executable, os.path.join(REPO, "pretrain_glm5_vlm.py"), "--exit-signal-handler"]
    else:  # the program "started" 61 minutes ago: --exit-duration-in-mins 60 ends it after its first iteration
        script = tmp_path / "started_an_hour_ago.py"
        script.write_text("import sys\nimport pretrain_glm5_vlm as P\n\nif __name__ == '__main__':\n"
                          "    P._PROGRAM_START -= 61 * 60\n    sys.exit(P.main())\n")
        cmd = [sys.executable, str(script), "--exit-duration-in-mins", "60"]
    cmd += common + ["--save", str(tmp_path / "b")]
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    out = []
    for line in proc.stdout:
        out.append(line)
        if how == "sigterm" and "iteration        2/" in line:
            proc.send_signal(signal.SIGTERM)
    err = proc.stderr.read()
    assert proc.wait(timeout=600) == 0, err[-3000:]
    stopped_at = int((tmp_path / "b" / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= stopped_at < steps, "".join(out)[-2000:]
    time.sleep(0.5)
    ps = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-s", str(proc.pid)], capture_output=True, text=True).stdout
    left = [ln for ln in ps.splitlines() if ln.split()[1][0] != "Z"]  # exited, not yet reaped by init: gone
    assert left == [], left  # nothing of the run's session is still alive

    resumed = run(common + ["--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = straight_run_state, _final_state(tmp_path / "b" / f"iter_{steps:07d}")
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_pipeline_stages_start_from_different_weights(tmp_path):
    """PP 2 from scratch: Megatron-LM seeds each pipeline rank differently, so the first KDA layer of stage 1
    (layer 2) does not start as a copy of the first KDA layer of stage 0 (layer 0)."""
    proc = run(TINY + ["--mock-data", "--train-iters", "1", "--lr", "0", "--min-lr", "0", "--lr-warmup-iters", "0",
                       "--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--save", str(tmp_path / "ck"),
                       "--save-interval", "100"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sd = read_dist_checkpoint(str(tmp_path / "ck" / "iter_0000001"))
    first = {k.split("layers.0.", 1)[1]: v for k, v in sd.items()
             if k.startswith("decoder.layers.0.self_attention.") and v.dim() == 2}
    assert first
    for name, w in first.items():
        assert not torch.equal(w, sd["decoder.layers.2." + name]), name


def test_async_save_writes_the_synchronous_checkpoint_and_a_kill_keeps_the_previous(tmp_path):
    """--async-save: the checkpoints equal the synchronous ones tensor for tensor; a run killed while its async save
    of iteration 4 is under way leaves the tracker on iteration 2, from which the same command resumes to the same
    final state."""
    common = TINY + ["--mock-data", "--train-iters", "4", "--save-interval", "2"]
    sync = run(common + ["--save", str(tmp_path / "sync")])
    assert sync.returncode == 0, sync.stderr[-3000:]
    asyn = run(common + ["--save", str(tmp_path / "async"), "--async-save"])
    assert asyn.returncode == 0, asyn.stderr[-3000:]
    for it in ("iter_0000002", "iter_0000004"):
        a, b = _final_state(tmp_path / "sync" / it), _final_state(tmp_path / "async" / it)
        assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == [], it

    killed = run(common + ["--save", str(tmp_path / "k"), "--async-save", "--test-kill-during-save", "4"])
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-2000:])
    assert (tmp_path / "k" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    resumed = run(common + ["--save", str(tmp_path / "k"), "--load", str(tmp_path / "k"), "--async-save"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = _final_state(tmp_path / "sync" / "iter_0000004"), _final_state(tmp_path / "k" / "iter_0000004")
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []


def test_checkpoint_is_megatron_lms_own(tmp_path, mcore):
    """A checkpoint of the trainer is Megatron-LM's: its tracker and iter folder, the common state megatron-core's
    dist_checkpointing reads (args, iteration, scheduler, optimizer and rerun-machine state), and model weights that
    dist_checkpointing.load puts into a freshly built model of the same architecture."""
    from megatron.core import dist_checkpointing

    from megatron_glm5.config import Glm5Config, tiny_hf_config
    from megatron_glm5.models.builder import build_model

    proc = run(TINY + ["--mock-data", "--train-iters", "3", "--save", str(tmp_path / "ck"), "--save-interval", "2",
                       "--exit-interval", "2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    ckpt = str(tmp_path / "ck" / "iter_0000002")
    common = dist_checkpointing.load_common_state_dict(ckpt)
    assert common["iteration"] == 2 and common["checkpoint_version"] >= 3.0
    assert common["args"].tensor_model_parallel_size == 1 and common["args"].micro_batch_size == 2
    assert {"opt_param_scheduler", "optimizer", "rerun_state_machine"} <= set(common)
    assert json.loads((tmp_path / "ck" / "iter_0000002" / "hf_config.json").read_text()) == tiny_hf_config(mtp=True)

    model = build_model(Glm5Config.from_hf(tiny_hf_config(mtp=True), use_cpu_initialization=True))
    loaded = dist_checkpointing.load(model.sharded_state_dict(), ckpt)
    model.load_state_dict(loaded, strict=False)
    saved = read_dist_checkpoint(ckpt)
    checked = 0
    for key, value in model.sharded_state_dict().items():
        tensor = getattr(value, "data", None)
        if not (isinstance(tensor, torch.Tensor) and hasattr(value, "global_offset") and value.key in saved
                and value.key.startswith("decoder.")):
            continue
        want = saved[value.key]
        if want.dim() == tensor.dim() + 1:  # one expert of the [experts, ...] global tensor
            want = want[value.global_offset[0]]
        assert torch.equal(tensor, want), key
        checked += 1
    assert checked >= 20


def test_ctrl_c_is_one_line(tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) during training: one line naming the intact
    checkpoint, exit 130, no traceback from the trainer or its helper processes."""
    import signal

    cmd = [sys.executable, os.path.join(REPO, "pretrain_glm5_vlm.py")] + TINY + [
        "--mock-data", "--train-iters", "50", "--save", str(tmp_path / "ck"), "--save-interval", "2"]
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    for line in proc.stdout:
        if "iteration        3/" in line:
            os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole process group
            break
    proc.stdout.read()
    err = [ln for ln in proc.stderr.read().splitlines() if ln.strip()]
    assert proc.wait(timeout=300) == 130, err
    assert len(err) == 1 and "interrupted; the last checkpoint (iteration 2)" in err[0], err
