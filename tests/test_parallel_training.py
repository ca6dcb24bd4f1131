"""Every parallel layout trains like one rank, through pretrain_glm5_vlm.py (torchrun, gloo, CPU, fp32).

All runs start from the same initial weights (a layout-free dist checkpoint written here, loaded with
--pretrained-checkpoint) and train 3 steps on the same packed image+text rows: plain SGD, or Adam for the layouts with
megatron-core's distributed optimizer (it implements Adam only), against a one-rank run with the same optimizer.
Per step, 'lm loss' (TensorBoard) must equal the one-rank run's to a relative 1e-5, and so must every weight of the
final checkpoint (layout-free global tensors), measured against the largest weight of its module
(tests/parallel_harness.compare).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.parallel_harness import compare
from tests.training_harness import error_lines, read_dist_checkpoint, run, scalars

RTOL = 1e-5
STEPS = 3

# name: (ranks, extra flags, model variant)
LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"], "dense"),
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], "moe"),
    "pp2": (2, ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2"], "moe"),
    "pp2_vpp2": (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                     "--num-layers", "4"], "moe4"),
    "pp2_mtp": (2, ["--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "2"], "moe"),
    "ep2": (2, ["--expert-model-parallel-size", "2"], "moe"),
    "ep4": (4, ["--expert-model-parallel-size", "4"], "moe"),
    "ep2_etp2": (4, ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"], "moe"),
    "cp2": (2, ["--context-parallel-size", "2"], "moe"),
    "cp4": (4, ["--context-parallel-size", "4"], "moe"),
    "dp2": (2, ["--use-distributed-optimizer"], "moe"),
    "tp2_cp2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2"],
                "moe"),
    "tp2_pp2_ep2_dp2": (8, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                            "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                            "--expert-tensor-parallel-size", "1", "--use-distributed-optimizer",
                            "--fused-optimizer-step"], "moe4"),  # the GPU's optimizer step on sharded, chained parts
}


def _hf_config(variant: str) -> dict:
    """5 layers (KDA / DSA alternating, dense then MoE), vision tower, one MTP layer; 'dense': every MLP dense
    (megatron-core refuses MoE under TP without sequence parallelism); 'moe4': 4 layers (even stages)."""
    from megatron_glm5.config import tiny_hf_config

    cfg = tiny_hf_config(num_layers=4 if variant == "moe4" else 5, mtp=True)
    if variant == "dense":
        cfg["text_config"]["mlp_layer_types"] = ["dense"] * 5
        cfg["text_config"]["mtp_layer_types"] = ["indexed_attention", "dense"]
    return cfg


def _initial_checkpoint(workdir, variant: str, name: str = "init", edit=None):
    """(HF config dir, a dist checkpoint of random initial weights) for a model variant; written once into
    ``workdir / f"{name}_{variant}"``. ``edit(model)``, when given, changes the weights before the save."""
    root = workdir / f"{name}_{variant}"
    if (root / "ckpt" / "latest_checkpointed_iteration.txt").exists():
        return root, root / "ckpt"
    from megatron.core import dist_checkpointing

    from megatron_glm5.checkpoint.checksums import write_manifest
    from megatron_glm5.checkpoint.tracker import CHECKPOINT_VERSION

    from megatron_glm5.config import Glm5Config
    from megatron_glm5.models.builder import build_model

    root.mkdir(exist_ok=True)
    hf = _hf_config(variant)
    (root / "config.json").write_text(json.dumps(hf))
    # the same weights whatever was built before in this process (megatron's model-parallel RNG included)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    model = build_model(Glm5Config.from_hf(hf, use_cpu_initialization=True))
    if edit is not None:
        with torch.no_grad():
            edit(model)
    # Megatron-LM's layout of converted weights: a 'release' checkpoint named by the tracker
    (root / "ckpt" / "release").mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save({**model.sharded_state_dict(), "checkpoint_version": CHECKPOINT_VERSION},
                            str(root / "ckpt" / "release"))
    (root / "ckpt" / "release" / "hf_config.json").write_text(json.dumps(hf))
    write_manifest(str(root / "ckpt" / "release"))  # as the converter writes it: the trainer verifies it
    (root / "ckpt" / "latest_checkpointed_iteration.txt").write_text("release")
    return root, root / "ckpt"


# Adam's eps is large next to the gradients' fp32 rounding so that the update stays a smooth function of the gradient
# (with eps 1e-8 a near-zero gradient's sign, flipped by rounding, would move a weight by a whole learning rate)
OPTIMIZERS = {
    "sgd": ["--optimizer", "sgd", "--sgd-momentum", "0", "--lr", "0.05"],
    "adam": ["--optimizer", "adam", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-3", "--lr",
             "0.01"],
}


def _optimizer(flags) -> str:
    return "adam" if "--use-distributed-optimizer" in flags else "sgd"


def _common(hf, data, optimizer: str):
    """The flags every run shares: data, batch, schedule, MoE losses, optimizer."""
    return ["--hf-config", str(hf), "--dataset-type", "vqa", "--data-path", str(data / "vqa" / "vqa.jsonl"),
            "--tokenizer-model", str(data), "--split", "1,0,0", "--seq-length", "48", "--micro-batch-size", "1",
            "--global-batch-size", "4", "--train-iters", str(STEPS), "--lr-decay-style", "constant",
            "--clip-grad", "0", "--weight-decay", "0", "--moe-aux-loss-coeff", "1e-2",
            "--moe-router-bias-update-rate", "1e-2", "--eval-iters", "0"] + OPTIMIZERS[optimizer]


def _train(workdir, data, name: str, variant: str, flags, nproc: int, optimizer: str = "sgd"):
    hf, init = _initial_checkpoint(workdir, variant)
    out = workdir / name
    args = _common(hf, data, optimizer) + ["--pretrained-checkpoint", str(init), "--save", str(out / "ckpt"),
                                           "--save-interval", "100",
                                           "--no-save-optim", "--tensorboard-dir", str(out / "tb")] + list(flags)
    proc = run(args, nproc=nproc, timeout=1500)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    losses = dict(scalars(out / "tb")["lm loss"])
    weights = {k: v for k, v in read_dist_checkpoint(str(out / "ckpt" / f"iter_{STEPS:07d}")).items()
               if not k.startswith("optimizer.")}
    return losses, weights


_REFERENCE = {}


def _reference(workdir, data, variant: str, flags, optimizer: str = "sgd"):
    """One rank's run of the same model (the layout flags that change the model, --num-layers, are kept) with the
    same optimizer (Adam: megatron's plain, not distributed, optimizer)."""
    model_flags = []
    if "--num-layers" in flags:
        i = flags.index("--num-layers")
        model_flags = flags[i:i + 2]
    key = (variant, tuple(model_flags), optimizer)
    if key not in _REFERENCE:
        _REFERENCE[key] = _train(workdir, data, f"ref_{variant}_{optimizer}", variant, model_flags, 1, optimizer)
    return _REFERENCE[key]


def _check_layout(name, workdir, data):
    nproc, flags, variant = LAYOUTS[name]
    optimizer = _optimizer(flags)
    ref_losses, ref_weights = _reference(workdir, data, variant, flags, optimizer)
    losses, weights = _train(workdir, data, name, variant, flags, nproc, optimizer)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in losses:
        assert abs(losses[step] - ref_losses[step]) <= RTOL * abs(ref_losses[step]), (step, losses, ref_losses)
    assert weights.keys() == ref_weights.keys()
    # tests/parallel_harness.compare: differences scaled by the largest weight of the owning module (mHC base /
    # scale start at zero and their gradients are cancelling sums: two one-rank runs differing only in BLAS threads
    # already move them by ~4e-5 of themselves), and per tensor within 1e-3
    worst, key, per_tensor = compare(ref_weights, weights)
    assert worst <= RTOL, (key, per_tensor[key])
    assert max(v[0] for v in per_tensor.values()) <= 1e-3


def _layout_test(name: str):
    def test(parallel_workdir, parallel_data, mcore):
        _check_layout(name, parallel_workdir, parallel_data)

    test.__name__ = test.__qualname__ = f"test_parallel_{name}"
    test.__doc__ = f"{name}: {LAYOUTS[name][0]} ranks, {' '.join(LAYOUTS[name][1])}: the one-rank losses and weights."
    return test


for _name in LAYOUTS:  # test_parallel_tp2, test_parallel_tp2_sp, ... one named test per layout
    globals()[f"test_parallel_{_name}"] = _layout_test(_name)


def test_checkpoint_saved_at_tp2_pp2_resumes_at_dp4(parallel_workdir, parallel_data, mcore):
    """Adam with the distributed optimizer: 2 steps at TP2 x PP2 (saved fully reshardable), then the third step at
    DP4 from that checkpoint (weights, Adam moments, scheduler and data position resharded). The third step's loss equals the
    one-rank run's, and so do the weights after it (which need the loaded Adam moments)."""
    workdir, data = parallel_workdir, parallel_data
    hf, init = _initial_checkpoint(workdir, "moe4")
    ref_losses, ref_weights = _reference(workdir, data, "moe4", [], "adam")
    common = _common(hf, data, "adam") + ["--use-distributed-optimizer"]
    ck = workdir / "reshard" / "ckpt"
    # Megatron-LM: a distributed-optimizer checkpoint that must load at another TP / PP is saved fully reshardable
    first = run(common + ["--pretrained-checkpoint", str(init), "--save", str(ck), "--save-interval", "100",
                          "--exit-interval", "2", "--dist-ckpt-optim-fully-reshardable",
                          "--tensor-model-parallel-size", "2", "--sequence-parallel",
                          "--pipeline-model-parallel-size", "2"], nproc=4, timeout=1500)
    assert first.returncode == 0, first.stderr[-4000:]
    second = run(common + ["--load", str(ck), "--save", str(ck), "--save-interval", "100",
                           "--expert-model-parallel-size", "1",
                           "--tensorboard-dir", str(workdir / "reshard" / "tb")], nproc=4, timeout=1500)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "iteration 2" in second.stdout, second.stdout[-2000:]
    losses = dict(scalars(workdir / "reshard" / "tb")["lm loss"])
    assert sorted(losses) == [3]
    assert abs(losses[3] - ref_losses[3]) <= RTOL * abs(ref_losses[3]), (losses, ref_losses)
    weights = {k: v for k, v in read_dist_checkpoint(str(ck / f"iter_{STEPS:07d}")).items()
               if not k.startswith("optimizer.")}
    worst, key, per_tensor = compare(ref_weights, weights)
    assert worst <= RTOL, (key, per_tensor[key])


# rank 0's environment as torchrun sets it (WORLD_SIZE added per test): the argument checks run before any process
# group, so these runs stop there
RANK0_OF_TORCHRUN = {"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("flags, world, needle", [
    (["--tensor-model-parallel-size", "3", "--sequence-parallel"], 3, "tensor_model_parallel_size"),
    (["--expert-model-parallel-size", "3"], 3, "expert_model_parallel_size"),
    (["--pipeline-model-parallel-size", "3"], 3, "decoder layers"),
])
def test_layout_that_does_not_divide_is_refused(flags, world, needle, tmp_path):
    """Heads / experts / layers that do not divide by the layout: one 'error: model config: ...' line, exit 2,
    before the process group or the model exist (WORLD_SIZE as torchrun would set it)."""
    proc = run(["--model-preset", "glm5-tiny", "--mock-data", "--seq-length", "32", "--train-iters", "2", "--lr",
                "1e-3", "--num-layers", "4", "--eval-iters", "0", "--micro-batch-size", "1",
                "--tensorboard-dir", str(tmp_path / "tb")] + flags,
               env=dict(RANK0_OF_TORCHRUN, WORLD_SIZE=str(world)))
    lines = error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "error: model config:" in lines[0] and needle in lines[0], lines
    assert not (tmp_path / "tb").exists()


def test_data_parallel_change_keeps_the_rng_state(tmp_path):
    """Saved by one rank, resumed by two (DP 1 -> 2, same TP / PP): Megatron-LM keeps the one RNG state it saved
    (without --data-parallel-random-init every DP rank shares it) and the run goes on from iteration 2."""
    common = ["--model-preset", "glm5-tiny", "--mock-data", "--seq-length", "32", "--micro-batch-size", "1",
              "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3", "--eval-iters", "0",
              "--save", str(tmp_path / "ck"), "--save-interval", "2"]
    first = run(common + ["--exit-interval", "2"])
    assert first.returncode == 0, first.stderr[-3000:]
    second = run(common + ["--load", str(tmp_path / "ck")], nproc=2)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "at iteration 2" in second.stdout and "RNG state not found" not in second.stdout
    assert "(TP, PP) mismatch" not in second.stdout
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_optimizer_state_megatron_cannot_reshard_is_one_line(tmp_path):
    """Distributed-optimizer state in Megatron-LM's default (DP-reshardable) format loads only at the TP / PP it was
    saved at, and any distributed-optimizer state only at its EP: resuming it elsewhere is refused with one line
    naming the ways out, before any work."""
    common = ["--model-preset", "glm5-tiny", "--mock-data", "--seq-length", "32", "--micro-batch-size", "1",
              "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0",
              "--use-distributed-optimizer", "--save", str(tmp_path / "ck"), "--save-interval", "1"]
    first = run(common + ["--exit-interval", "1", "--tensor-model-parallel-size", "2", "--sequence-parallel"], nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run(common + ["--load", str(tmp_path / "ck")], env=dict(RANK0_OF_TORCHRUN, WORLD_SIZE="2"))
    lines = error_lines(second)
    assert second.returncode == 2 and len(lines) == 1, second.stderr[-2000:]
    assert "--load:" in lines[0] and "TP 2 PP 1" in lines[0] and "--dist-ckpt-optim-fully-reshardable" in lines[0]
    other_ep = run(common + ["--load", str(tmp_path / "ck"), "--tensor-model-parallel-size", "2", "--sequence-parallel",
                             "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"],
                   env=dict(RANK0_OF_TORCHRUN, WORLD_SIZE="2"))
    lines = error_lines(other_ep)
    assert other_ep.returncode == 2 and len(lines) == 1 and "saved at EP 1" in lines[0], other_ep.stderr[-2000:]
