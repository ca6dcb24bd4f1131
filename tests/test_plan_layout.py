"""scripts/plan_layout.py: the parameter counts it plans with are the model's own."""

import os
import sys


sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))


def test_parameters_per_stage_add_up_to_the_model(mcore):
    import plan_layout

    from megatron_glm5.config import Glm5Config, tiny_hf_config
    from megatron_glm5.models.builder import build_model

    hf = tiny_hf_config(num_layers=5, mtp=True)
    model = build_model(Glm5Config.from_hf(hf, use_cpu_initialization=True))
    total = sum(p.numel() for p in model.parameters())
    emb = model.embedding.word_embeddings.weight.numel()

    one = plan_layout.estimate(hf, plan_layout.Plan(gpus=1, global_batch_size=4, seq_length=32))
    assert one["stages"][0]["params"] == total
    two = plan_layout.estimate(hf, plan_layout.Plan(gpus=2, pp=2, global_batch_size=4, seq_length=32))
    assert [s["layers"] for s in two["stages"]] == [3, 2]  # the balanced layout of 5 layers
    assert sum(s["params"] for s in two["stages"]) == total + emb  # + the MTP stage's embedding copy
    ep = plan_layout.estimate(hf, plan_layout.Plan(gpus=2, ep=2, global_batch_size=4, seq_length=32))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and "shared" not in n)
    assert ep["stages"][0]["params"] == total - experts / 2
    r = one["stages"][0]
    assert r["weights"] == 2 * total and r["grads"] == 4 * total and r["optimizer"] == 12 * total


def test_one_line_refusal(capsys):
    import plan_layout

    assert plan_layout.main(["--config", "tiny", "--gpus", "4", "--tp", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("plan_layout: error:"), err


def _tiny():
    from megatron_glm5.config import Glm5Config, tiny_hf_config
    from megatron_glm5.models.builder import build_model

    hf = tiny_hf_config(num_layers=5, mtp=True)
    model = build_model(Glm5Config.from_hf(hf, use_cpu_initialization=True))
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in layer.parameters()) for layer in model.decoder.layers)
    return hf, total, largest


def test_lever_memory_against_hand_computation(mcore):
    """Each lever's per-rank bytes on the tiny config at dp 2 (experts at expert-dp 2), computed by hand from the
    model's parameter count P and its largest layer L."""
    import plan_layout

    hf, P, L = _tiny()

    def stage(**lev):
        r = plan_layout.estimate(hf, plan_layout.Plan(gpus=2, global_batch_size=4, seq_length=32, **lev))
        return r, r["stages"][0]

    _, s = stage()                                                    # distributed optimizer, fp32 state
    assert (s["weights"], s["grads"], s["optimizer"], s["fsdp_buffers"]) == (2 * P, 4 * P, 12 * P / 2, 0)
    _, s = stage(grad_reduce_in_bf16=True)                            # bf16 buffer + the step's fp32 grad shard
    assert (s["grads"], s["optimizer"]) == (2 * P, 12 * P / 2 + 4 * P / 2)
    pao = dict(use_precision_aware_optimizer=True, main_grads_dtype="bf16", exp_avg_dtype="bf16",
               exp_avg_sq_dtype="bf16")
    _, s = stage(**pao)                                               # fp32 master, bf16 m, v, bf16 grads
    assert (s["weights"], s["grads"], s["optimizer"]) == (2 * P, 2 * P, (4 + 2 + 2) * P / 2)
    _, s = stage(use_precision_aware_optimizer=True, main_params_dtype="fp16", exp_avg_dtype="fp8",
                 exp_avg_sq_dtype="bf16")
    assert (s["grads"], s["optimizer"]) == (4 * P, (2 + 1 + 2) * P / 2)
    _, s = stage(use_megatron_fsdp=True)                              # optim_grads_params
    assert (s["weights"], s["grads"], s["optimizer"]) == (2 * P / 2, 4 * P / 2, 12 * P / 2)
    assert s["fsdp_buffers"] == 2 * 2 * L + 4 * L
    _, s = stage(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads", **pao)
    assert (s["weights"], s["grads"], s["fsdp_buffers"]) == (2 * P, 2 * P / 2, 2 * L)
    r, s = stage(use_precision_aware_optimizer=True, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)
    n = 0.5 * P / 2                                                   # offloaded parameters of this rank
    assert s["optimizer"] == 12 * P / 2 - 12 * n and s["host"] == 16 * n
    assert r["host_memory_gb_per_node"] == 8 * 16 * n / 1e9
    pcie, host = n * (4 + 4) / 25e9, 8 * n * 28 / 100e9              # grads D2H + params H2D; host Adam traffic
    assert r["time_s"]["offload"] == pcie + host
    r2, _ = stage(use_precision_aware_optimizer=True, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5,
                  overlap_cpu_optimizer_d2h_h2d=True)
    assert r2["time_s"]["offload"] == max(pcie, host)
    assert r2["time_s"]["step"] - r2["time_s"]["offload"] == r["time_s"]["step"] - r["time_s"]["offload"]
    r3, _ = stage(use_precision_aware_optimizer=True, optimizer_cpu_offload=True, host_memory_gb=1e-12)
    assert r3["fits"] is False                                        # the host check
    assert "--optimizer-offload-fraction" in plan_layout.pretrain_flags(r2)


def test_lever_refusals_are_one_line(capsys):
    import plan_layout

    for argv, flag in ((["--exp-avg-dtype", "bf16"], "--exp-avg-dtype bf16"),
                       (["--optimizer-cpu-offload"], "--optimizer-cpu-offload"),
                       (["--use-precision-aware-optimizer", "--no-distributed-optimizer"],
                        "--use-precision-aware-optimizer")):
        assert plan_layout.main(["--config", "tiny", "--gpus", "1"] + argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"plan_layout: error: {flag}"), err


def test_search_ranked_summary(mcore, capsys):
    import plan_layout

    assert plan_layout.main(["--config", "tiny", "--gpus", "2", "--seq-length", "64", "--global-batch-size", "4",
                             "--search", "--json"]) == 0
    results = __import__("json").loads(capsys.readouterr().out)
    assert results and all(r["fits"] for r in results)
    steps = [r["time_s"]["step"] for r in results]
    assert max(steps[1:] or [0]) >= steps[0] / 1.03  # no later row faster than the first beyond the near-tie band
    assert len({r["levers"] for r in results}) > 1    # the levers are searched
    summary = plan_layout.ranked_summary(results).splitlines()
    rows = [ln for ln in summary if ln[:4].strip().isdigit()]
    assert len(rows) == len(results) and rows[0].split()[0] == "1"
    assert results[0]["levers"] in rows[0] and f"{results[0]['time_s']['step']:.2f}" in rows[0]
    assert summary[-1] == "winner: python pretrain_glm5_vlm.py " + " ".join(
        f"'{f}'" if "|" in f else f for f in results[0]["flags"])


def test_glm5_flash_fits_64_h100_at_4k_and_48_at_2k_only_with_the_levers(mcore):
    """The layouts `--search` ranks first for glm5-flash (64 H100 at 4K, 48 H100 at 2K with a global batch of 768,
    docs/parallelism.md) fit in 90 % of 80 GB and of a node's 2 TB host memory with their levers, and not
    without them (the distributed optimizer with fp32 state)."""
    import plan_layout

    from megatron_glm5.config import PRESETS

    hf = PRESETS["glm5-flash"]().to_hf_dict()
    params = plan_layout.count_parameters(plan_layout.layout_config(hf, plan_layout.Plan(gpus=1,
                                                                                           global_batch_size=1)))
    pao = dict(use_precision_aware_optimizer=True, main_grads_dtype="bf16", exp_avg_dtype="bf16",
               exp_avg_sq_dtype="bf16", optimizer_cpu_offload=True, overlap_cpu_optimizer_d2h_h2d=True)
    cases = [
        (dict(gpus=64, tp=4, pp=8, vpp=2, ep=8, etp=1, seq_length=4096, global_batch_size=1024,
              recompute="selective"), dict(**pao, optimizer_offload_fraction=0.5)),
        (dict(gpus=48, tp=1, pp=8, vpp=2, ep=2, etp=1, seq_length=2048, global_batch_size=768, recompute="full"),
         dict(**pao, optimizer_offload_fraction=1.0, use_megatron_fsdp=True)),
    ]
    for layout, levers in cases:
        with_levers = plan_layout.estimate(hf, plan_layout.Plan(gpu="h100", **layout, **levers), params)
        assert with_levers["fits"] and with_levers["memory_gb"] <= 72 and with_levers["host_memory_gb_per_node"] <= \
            0.9 * 2048, (layout, with_levers["memory_gb"])
        without = plan_layout.estimate(hf, plan_layout.Plan(gpu="h100", **layout), params)
        assert not without["fits"] and without["memory_gb"] > 72


def test_help_shows_defaults_and_the_card(capsys):
    import pytest

    import plan_layout

    with pytest.raises(SystemExit) as exc:
        plan_layout.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exc.value.code == 0
    for text in ("h100 (80 GB", "h200 (141 GB", "(default: h200)", "(default: 2048.0)", "(default: 25.0)",
                 "--optimizer-offload-fraction OPTIMIZER_OFFLOAD_FRACTION fraction offloaded (default: 1.0)",
                 "(default: optim_grads_params)"):
        assert text in out, text


def test_no_layout_names_the_global_batch(mcore, capsys):
    """12 GPUs: every data-parallel size is a multiple of 3, which 1024 sequences do not split into; the answer says
    so and proposes a global batch every data-parallel size divides."""
    import plan_layout

    assert plan_layout.main(["--config", "tiny", "--gpus", "12", "--search"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == ("no layout for 12 GPUs divides the model (every data-parallel size here is a multiple of 3; "
                   "data-parallel size x --micro-batch-size must divide --global-batch-size 1024: e.g. "
                   "--global-batch-size 1020)")
