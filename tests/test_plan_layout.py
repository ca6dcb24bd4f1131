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
