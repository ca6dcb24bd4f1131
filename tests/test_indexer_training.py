"""Training the KPool indexer (issue 35, docs/indexer_training.md): the indexer KL against its plain-PyTorch
reference (values and gradients), the detach structure, frozen-by-default, the warm-up and sparse stages through
the trainer, the re-initialised indexer's warm-up, and the loss under TP + SP, CP and PP."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5.config import Glm5Config, tiny_hf_config
from megatron_glm5.models.indexer_loss import kpool_indexer_kl, kpool_indexer_kl_reference
from megatron_glm5.models.kpool_indexer import KPoolIndexer
from megatron_glm5.models.packing import make_packed_seq_params


def _cfg(**over):
    t = dict(tiny_hf_config(with_vision=False)["text_config"])
    extra = {k: over.pop(k) for k in list(over) if k.startswith("dsa_")}
    t.update(over)
    return Glm5Config.from_hf({"text_config": t, "architectures": ["Glm5NextForConditionalGeneration"],
                               "model_type": "glm5_next"}, use_cpu_initialization=True, **extra)


def _random_indexer(cfg, seed):
    torch.manual_seed(seed)
    ix = KPoolIndexer(cfg)
    with torch.no_grad():
        for p in ix.parameters():
            p.normal_(0.0, 0.5)
        ix.k_norm.weight.add_(1.0)
    return ix


# Rows: documents shorter than a pool, exactly a pool, ragged; kpool 4, topk 8 (2 pools) or 12 (3 pools).
CASES = [
    dict(lens=[3, 4, 17, 9, 30], index_topk=8, sparse=False),
    dict(lens=[3, 4, 17, 9, 30], index_topk=8, sparse=True),
    dict(lens=[12, 1, 23], index_topk=12, sparse=True),          # top-k = every pool of the 12-token document
    dict(lens=[40], index_topk=8, sparse=True, antithetic=False),  # ReLU ties among the pool scores
    dict(lens=[2, 5, 9], index_topk=8, sparse=False),            # few pools, rows without any candidate
]


@pytest.mark.parametrize("case", CASES, ids=[f"{'sparse' if c['sparse'] else 'dense'}-{c['lens']}" for c in CASES])
def test_indexer_kl_equals_reference_values_and_gradients(case):
    """The chunked loss (absorbed latents, per-chunk candidate pools, gathered selected pools) equals the
    whole-matrix reference (expanded keys, token-to-pool matrix, scatter masks) to 1e-6 relative in fp32, and so
    do the gradients of every indexer parameter; chunks of one query give the same."""
    cfg = _cfg(index_topk=case["index_topk"], index_n_heads=4, dsa_indexer_loss_coeff=1.0)
    ix = _random_indexer(cfg, seed=len(case["lens"]) + case["index_topk"])
    if case.get("antithetic", True) is False:
        with torch.no_grad():
            ix.wq_b.weight.abs_().neg_()            # most per-head scores ReLU to 0: equal pool scores
    lens = case["lens"]
    s = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    psp = make_packed_seq_params(cu)
    H, dq, r = 3, 8, 6
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(s, 1, cfg.hidden_size, generator=gen)
    qr = torch.randn(s, 1, cfg.q_lora_rank, generator=gen)
    q = torch.randn(1, s, H, dq, generator=gen)
    c = torch.randn(1, s, r, generator=gen)
    w_kc = torch.randn(H, dq, r, generator=gen) * 0.5
    k = torch.einsum("hdr,bsr->bshd", w_kc, c)
    q_lat = torch.einsum("bshd,hdr->bshr", q, w_kc)
    scale = dq ** -0.5

    def ours(chunk_elements):
        ix.zero_grad(set_to_none=True)
        idx, f = ix(x, qr, packed_seq_params=psp, return_features=True)
        kl, rows = kpool_indexer_kl(f, q_lat, c, scale, ix.softmax_scale, idx, ix.kpool, ix.index_topk,
                                    case["sparse"], chunk_elements=chunk_elements)
        kl.backward()
        return kl.detach(), rows, {n: p.grad.clone() for n, p in ix.named_parameters()}, idx, f

    kl, rows, grads, idx, f = ours(1 << 24)
    ix.zero_grad(set_to_none=True)
    f2 = ix.features(x, qr, psp)
    sel = dict(topk_indices=idx, selected_pools=f.selected_pools) if case["sparse"] else {}
    ref_kl, ref_rows = kpool_indexer_kl_reference(f2.q, f2.pool_keys, f2.weights, q, k, cu, ix.kpool, scale,
                                                  ix.softmax_scale, **sel)
    ref_kl.backward()
    print(f"{case}: kl {kl.item():.6f} over {int(rows)} rows, reference {ref_kl.item():.6f}")
    assert int(rows) == int(ref_rows) and int(rows) > 0
    assert int(rows) < s                                             # rows before the first pool have no term
    assert abs(kl - ref_kl) <= 1e-6 * abs(ref_kl), (kl.item(), ref_kl.item())
    for n, p in ix.named_parameters():
        g, rg = grads[n], p.grad
        assert rg is not None and rg.abs().max() > 0, n
        assert (g - rg).norm() <= 1e-6 * rg.norm(), (n, ((g - rg).norm() / rg.norm()).item())
    if case["sparse"]:  # with the attention's log-sum-exp (what the fused kernel returns): the same loss
        from megatron_glm5.kernels.sparse_mla import sparse_mla_reference

        _, lse = sparse_mla_reference(q_lat, c, idx, scale, return_lse=True)
        with torch.no_grad():
            kl_lse, rows_lse = kpool_indexer_kl(f, q_lat, c, scale, ix.softmax_scale, idx, ix.kpool, ix.index_topk,
                                                True, lse=lse)
        assert int(rows_lse) == int(rows) and abs(kl_lse - kl) <= 1e-6 * abs(kl), (kl_lse.item(), kl.item())
    kl1, rows1, grads1, _, _ = ours(1)                               # one query per chunk
    assert int(rows1) == int(rows) and abs(kl1 - kl) <= 1e-6 * abs(kl)
    assert all((grads1[n] - grads[n]).norm() <= 1e-6 * grads[n].norm() for n in grads)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_padding_rows_have_no_term(sparse):
    """A context-parallel split's padding is a document of its own at the end of the row (row_length = the
    unpadded length): the loss of the padded row equals the loss of the row without it (values and counts)."""
    cfg = _cfg(index_topk=8, index_n_heads=4, dsa_indexer_loss_coeff=1.0)
    ix = _random_indexer(cfg, seed=5)
    H, dq, r = 2, 8, 6
    gen = torch.Generator().manual_seed(3)
    lens, pad = [17, 9], 10
    s = sum(lens) + pad
    x = torch.randn(s, 1, cfg.hidden_size, generator=gen)
    qr = torch.randn(s, 1, cfg.q_lora_rank, generator=gen)
    q_lat = torch.randn(1, s, H, r, generator=gen)
    c = torch.randn(1, s, r, generator=gen)
    out = []
    for n, cu in ((s, [0, 17, 26, s]), (26, [0, 17, 26])):
        psp = make_packed_seq_params(torch.tensor(cu, dtype=torch.int32))
        with torch.no_grad():
            idx, f = ix(x[:n], qr[:n], packed_seq_params=psp, return_features=True)
            out.append(kpool_indexer_kl(f, q_lat[:, :n], c[:, :n], dq ** -0.5, ix.softmax_scale, idx, ix.kpool,
                                        ix.index_topk, sparse, row_length=26 if n == s else None))
    (kl_pad, rows_pad), (kl, rows) = out
    assert int(rows_pad) == int(rows) > 0 and abs(kl_pad - kl) <= 1e-6 * abs(kl)


# ---------------------------------------------------------------------------- the model: detach and frozen
DOCS = (21, 34, 17, 40)


def _model(mcore_seed=3, **cfg_over):
    from megatron_glm5.config import tiny_hf_config
    from megatron_glm5.models.builder import build_model

    hf = tiny_hf_config(with_vision=False, mtp=True)
    torch.manual_seed(mcore_seed)
    cfg = Glm5Config.from_hf(hf, use_cpu_initialization=True, **cfg_over)
    return build_model(cfg)


def _packed_batch(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 240, (1, sum(DOCS)), generator=g)
    labels = torch.randint(1, 240, (1, sum(DOCS)), generator=g)
    cu = torch.tensor([0] + torch.tensor(DOCS).cumsum(0).tolist(), dtype=torch.int32)
    return ids, labels, make_packed_seq_params(cu)


def _lm_backward(model, ids, labels, psp):
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper

    model.zero_grad(set_to_none=True)
    model.train()
    loss = model(ids, labels=labels, packed_seq_params=psp)
    loss.float().mean().backward()
    values = DSAIndexerLossLoggingHelper.tracker.get("values")
    logged = values.clone() if values is not None else None
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
    return {n: p.grad for n, p in model.named_parameters()}, logged


@pytest.mark.parametrize("sparse", [False, True], ids=["dense-kl", "sparse-kl"])
def test_lm_gradients_bitwise_equal_with_indexer_loss_on_and_off(mcore, sparse):
    """The LM loss's gradient of every non-indexer parameter (decoder, MTP, embedding, head) is bitwise the same
    with the indexer loss on and off: the indexer's inputs are detached and the loss joins the backward only
    through megatron-core's DSAIndexerLossAutoScaler. With it off the indexers are frozen (no gradient); with it on
    each one gets a gradient and its loss is recorded in its slot (2 decoder DSA layers + the MTP layer)."""
    off = _model()
    on = _model(dsa_indexer_loss_coeff=0.5, dsa_indexer_use_sparse_loss=sparse)
    on.load_state_dict(off.state_dict())
    ids, labels, psp = _packed_batch(off.config.vocab_size)
    g_off, logged_off = _lm_backward(off, ids, labels, psp)
    g_on, logged_on = _lm_backward(on, ids, labels, psp)
    indexer = [n for n in g_off if ".indexer." in n]
    assert len(indexer) == 3 * 7, indexer                      # 3 indexers (layers 2, 4 and the MTP layer)
    assert logged_off is None or not logged_off.any()
    assert all(not p.requires_grad for n, p in off.named_parameters() if ".indexer." in n)
    assert all(g_off[n] is None for n in indexer)
    assert all(g_on[n] is not None and g_on[n].abs().sum() > 0 for n in indexer), indexer
    others = [n for n in g_off if n not in indexer]
    assert all(g_off[n] is not None for n in others if "vision" not in n)
    differ = [n for n in others if not (g_off[n] is None and g_on[n] is None) and not torch.equal(g_off[n], g_on[n])]
    assert differ == []
    print(f"\nindexer loss per slot ({'sparse' if sparse else 'dense'} KL): {logged_on.tolist()}")
    assert logged_on.shape == (3,) and (logged_on > 0).all()


# ---------------------------------------------------------------------------- through pretrain_glm5_vlm.py
def _train(tmp, name, extra, iters=4):
    from tests.training_harness import TINY, run

    args = TINY + ["--mock-data", "--train-iters", str(iters), "--weight-decay", "0.1", "--save", str(tmp / name),
                   "--save-interval", "100", "--tensorboard-dir", str(tmp / f"tb_{name}")] + extra
    proc = run(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Runs of the tiny preset from the same initial weights: 'init' (one step at lr 0: the initial weights), 'off'
    (4 steps, indexer loss off, weight decay 0.1), 'sparse' (4 steps with the sparse indexer loss), 'warmup'
    (--dsa-indexer-warmup 3: the run ends at iteration 3), 'recompute' ('sparse' under full recompute)."""
    tmp = tmp_path_factory.mktemp("idx_train")
    procs = {
        "init": _train(tmp, "init", ["--lr", "0", "--min-lr", "0", "--lr-warmup-iters", "0"], iters=1),
        "off": _train(tmp, "off", []),
        "sparse": _train(tmp, "sparse", ["--dsa-indexer-loss-coeff", "1.0", "--dsa-indexer-use-sparse-loss"]),
        "warmup": _train(tmp, "warmup", ["--dsa-indexer-loss-coeff", "1.0", "--dsa-indexer-warmup", "3"]),
        "recompute": _train(tmp, "recompute", ["--dsa-indexer-loss-coeff", "1.0", "--dsa-indexer-use-sparse-loss",
                                               "--recompute-granularity", "full", "--recompute-method", "uniform",
                                               "--recompute-num-layers", "1"]),
    }
    return tmp, procs


def _weights(tmp, name, iteration):
    from tests.training_harness import read_dist_checkpoint

    sd = read_dist_checkpoint(str(tmp / name / f"iter_{iteration:07d}"))
    return {k: v for k, v in sd.items() if not k.startswith("optimizer.") and "expert_bias" not in k
            and "local_tokens_per_expert" not in k}, sd


def test_frozen_indexer_is_bitwise_unchanged_with_weight_decay(trained):
    """Loss off (the default): after 4 steps at weight decay 0.1 every indexer tensor is bitwise the initial one,
    it is in the checkpoint and has no optimizer state (no param group); the other weights did train."""
    tmp, procs = trained
    init, _ = _weights(tmp, "init", 1)
    off, full = _weights(tmp, "off", 4)
    indexer = [k for k in off if ".indexer." in k]
    assert len(indexer) == 3 * 7, indexer                      # layers 2 and 4 and the MTP layer, 7 tensors each
    assert [k for k in indexer if not torch.equal(off[k], init[k])] == []
    assert not any(".indexer." in k for k in full if k.startswith("optimizer."))
    assert any(k.startswith("optimizer.") for k in full)
    trained_keys = [k for k in off if ".indexer." not in k and not torch.equal(off[k], init[k])]
    assert len(trained_keys) > 50, trained_keys
    assert "indexer loss" not in procs["off"].stdout


def test_sparse_stage_trains_the_indexer_and_logs_its_loss(trained):
    """--dsa-indexer-loss-coeff with --dsa-indexer-use-sparse-loss: 'indexer loss' on the console line and in
    TensorBoard every iteration; the indexers train (optimizer state, changed weights) next to the model."""
    from tests.training_harness import scalars

    tmp, procs = trained
    init, _ = _weights(tmp, "init", 1)
    sparse, full = _weights(tmp, "sparse", 4)
    tb = scalars(tmp / "tb_sparse")
    assert sorted(i for i, _ in tb["indexer loss"]) == [1, 2, 3, 4]
    assert all(v > 0 for _, v in tb["indexer loss"])
    assert procs["sparse"].stdout.count("indexer loss:") == 4
    indexer = [k for k in sparse if ".indexer." in k]
    assert all(not torch.equal(sparse[k], init[k]) for k in indexer if "k_norm.bias" not in k)
    assert any(".indexer." in k for k in full if k.startswith("optimizer."))
    others = [k for k in sparse if ".indexer." not in k and not torch.equal(sparse[k], init[k])]
    assert len(others) > 50


def test_full_recompute_gives_the_same_indexer_loss_and_weights(trained):
    """Under full recompute the attention runs twice per step (without autograd, then again in the backward): the
    indexer loss is recorded once and equals the plain run's, and so do the trained weights, bitwise."""
    from tests.training_harness import scalars

    tmp, _ = trained
    assert scalars(tmp / "tb_recompute")["indexer loss"] == scalars(tmp / "tb_sparse")["indexer loss"]
    a, _ = _weights(tmp, "sparse", 4)
    b, _ = _weights(tmp, "recompute", 4)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.parametrize("extra, flag", [
    (["--dsa-indexer-warmup", "5"], "--dsa-indexer-warmup"),                        # needs the loss
    (["--dsa-indexer-loss-coeff", "1", "--dsa-indexer-warmup", "-1"], "--dsa-indexer-warmup"),
    (["--dsa-indexer-loss-coeff", "-0.5"], "--dsa-indexer-loss-coeff"),
    (["--dsa-indexer-loss-coeff", "nan"], "--dsa-indexer-loss-coeff"),
    (["--dsa-indexer-use-sparse-loss"], "--dsa-indexer-use-sparse-loss"),           # needs the loss
    (["--dsa-indexer-loss-coeff", "1", "--dsa-indexer-warmup", "5", "--exit-interval", "3"], "--exit-interval"),
    (["--dsa-indexer-loss-coeff", "1", "--dsa-indexer-warmup", "5", "--pipeline-model-parallel-size", "2",
      "--decoder-first-pipeline-num-layers", "1"], "--dsa-indexer-warmup"),           # stage 0: one KDA layer
])
def test_bad_indexer_flags_are_one_line_and_exit_2(capsys, extra, flag):
    from megatron_glm5.training.arguments import parse_args

    base = ["--model-preset", "glm5-tiny", "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "8",
            "--lr", "1e-3", "--eval-iters", "0", "--mock-data"]
    with pytest.raises(SystemExit) as exc:
        parse_args(base + extra, world_size=2, prog="pretrain_glm5_vlm.py")
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert exc.value.code == 2
    assert len(err) == 1 and err[0].startswith("pretrain_glm5_vlm.py: error:") and flag in err[0], err


def test_warmup_with_an_indexer_on_every_stage_passes():
    """pp2 with a DSA layer on each stage (layers 1-2 | 3-4 + MTP): the warm-up's layout check passes."""
    from megatron_glm5.training.arguments import parse_args

    args = parse_args(["--model-preset", "glm5-tiny", "--seq-length", "32", "--micro-batch-size", "2",
                       "--train-iters", "8", "--lr", "1e-3", "--eval-iters", "0", "--mock-data",
                       "--dsa-indexer-loss-coeff", "1", "--dsa-indexer-warmup", "5",
                       "--pipeline-model-parallel-size", "2"], world_size=2)
    assert args.dsa_indexer_warmup_stage


def test_indexer_flags_reach_the_config():
    """--dsa-indexer-warmup N makes a run that starts before N the warm-up (its config, --exit-interval N)."""
    from megatron_glm5.training.arguments import model_config_from_args, parse_args

    base = ["--model-preset", "glm5-tiny", "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "8",
            "--lr", "1e-3", "--eval-iters", "0", "--mock-data", "--dsa-indexer-loss-coeff", "0.25"]
    args = parse_args(base + ["--dsa-indexer-warmup", "5"], world_size=1)
    cfg = model_config_from_args(args, "cpu")
    assert cfg.dsa_indexer_warmup and cfg.dsa_indexer_loss_coeff == 0.25 and args.exit_interval == 5
    assert cfg.experimental_attention_variant_loss_scale_func is not None
    cfg = model_config_from_args(parse_args(base + ["--dsa-indexer-use-sparse-loss"], world_size=1), "cpu")
    assert not cfg.dsa_indexer_warmup and cfg.dsa_indexer_use_sparse_loss


def test_dense_warmup_trains_only_the_indexers_and_stops_at_n(trained):
    """--dsa-indexer-warmup 3: the run ends at iteration 3 (saved), every non-indexer weight is bitwise the
    initial one (weight decay 0.1, MTP and aux losses on), the indexers trained, 'indexer loss' is logged."""
    from tests.training_harness import scalars

    tmp, procs = trained
    assert (tmp / "warmup" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    init, _ = _weights(tmp, "init", 1)
    warm, full = _weights(tmp, "warmup", 3)
    moved = [k for k in warm if not torch.equal(warm[k], init[k])]
    assert moved and all(".indexer." in k for k in moved), moved
    assert sorted(i for i, _ in scalars(tmp / "tb_warmup")["indexer loss"]) == [1, 2, 3]
    assert not any(k.startswith("optimizer.") and ".indexer." not in k and "exp_avg" in k for k in full)


def test_resume_after_the_warmup_switches_to_the_sparse_stage(trained):
    """The same command resumed from the warm-up's checkpoint (iteration 3 of 4) is the switch: iteration 4 runs
    the sparse stage (every weight trains), at the data position (consumed samples 16) and learning rate of a
    straight run (the schedule resumed), the indexers' Adam moments carried (their second moments after the step
    are at least beta2 times the warm-up's: fresh ones would be (1 - beta2) g^2) and every other parameter's
    fresh."""
    from tests.training_harness import log_iterations, scalars

    tmp, _ = trained
    proc = _train(tmp, "warmup", ["--dsa-indexer-loss-coeff", "1.0", "--dsa-indexer-warmup", "3", "--load",
                                  str(tmp / "warmup")])
    assert "indexer warm-up -> sparse stage at iteration 3" in proc.stdout
    assert "the indexers' Adam moments (42 tensors) carried" in proc.stdout          # 21 tensors x 2 moments
    line = [it for it in log_iterations(proc.stdout) if it["iteration"] == 4]
    assert len(line) == 1 and line[0]["consumed samples"] == 16 and "indexer loss" in line[0], line
    lr = dict(scalars(tmp / "tb_warmup")["learning-rate"])
    assert lr[4] == dict(scalars(tmp / "tb_off")["learning-rate"])[4]
    warm, warm_full = _weights(tmp, "warmup", 3)
    sparse, full = _weights(tmp, "warmup", 4)
    v3 = {k: v for k, v in warm_full.items() if k.startswith("optimizer.state.exp_avg_sq.")}
    assert len(v3) == 21 and all(".indexer." in k for k in v3)
    assert all((full[k] >= 0.999 * v3[k]).all() and (v3[k] > 0).any() for k in v3)
    moved = [k for k in sparse if not torch.equal(sparse[k], warm[k])]
    assert any(".indexer." in k for k in moved) and len([k for k in moved if ".indexer." not in k]) > 50
    assert any(k.startswith("optimizer.") and ".indexer." not in k for k in full)


def test_resume_that_changes_what_the_optimizer_trains_is_one_line(trained):
    """Resuming the loss-off checkpoint with the indexer loss on (its optimizer state has nothing for the indexers)
    is one line naming --dsa-indexer-loss-coeff and --no-load-optim, exit 2, before any work; the checkpoint is
    untouched."""
    import hashlib

    from tests.training_harness import TINY, error_lines, run

    tmp, _ = trained
    files = sorted(p for p in (tmp / "off").rglob("*") if p.is_file())
    before = [hashlib.sha256(p.read_bytes()).hexdigest() for p in files]
    proc = run(TINY + ["--mock-data", "--train-iters", "6", "--weight-decay", "0.1", "--save", str(tmp / "off"),
                       "--save-interval", "100", "--load", str(tmp / "off"), "--dsa-indexer-loss-coeff", "1.0"])
    lines = error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, lines)
    assert "--dsa-indexer-loss-coeff" in lines[0] and "--no-load-optim" in lines[0] and "Traceback" not in proc.stderr
    assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in files] == before


# ---------------------------------------------------------------------------- the warm-up on a re-initialised indexer
def _top_pool_recall(seen):
    """Mean over (layer, query with more visible pools than it selects) of the fraction of the true top pools (by
    dense attention probability pooled and summed over heads) that the indexer selected."""
    from megatron_glm5.models.indexer_loss import dense_pool_mass

    hit = total = 0
    for q, kv, feats, layer in seen.values():
        w_kc, _ = layer.absorbed_weights()
        q_lat = torch.einsum("sbhd,hdr->bshr", q, w_kc.detach())
        s = q_lat.shape[1]
        lo, hi = feats.candidate_range(0, s)
        mass, visible = dense_pool_mass(feats, q_lat, kv.transpose(0, 1), layer.softmax_scale, 0, s, lo, hi)
        n_sel = layer.indexer.index_topk // layer.indexer.kpool
        rows = visible.sum(-1) > n_sel
        true = mass[0].masked_fill(~visible, -1.0).topk(n_sel, dim=-1).indices + lo            # [s, n_sel]
        found = (true[:, :, None] == feats.selected_pools[0][:, None, :]).any(-1)
        hit, total = hit + int(found[rows].sum()), total + int(rows.sum()) * n_sel
    return hit / total


def test_warmup_halves_the_loss_of_a_reinitialised_indexer(mcore, monkeypatch):
    """A tiny model with peaked attention (its attention weights drawn wide) and freshly initialised indexers,
    in the warm-up configuration (dense attention, all but the indexers frozen): 30 Adam steps on the indexer loss
    alone over 4 packed rows halve the loss, and the share of the true top pools the indexers select rises."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper

    from megatron_glm5.models.builder import build_model
    from megatron_glm5.models.kpool_dsa import Glm5DSAttention

    torch.manual_seed(0)
    cfg = Glm5Config.from_hf(tiny_hf_config(with_vision=False), use_cpu_initialization=True,
                             dsa_indexer_loss_coeff=1.0, dsa_indexer_warmup=True)
    model = build_model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".self_attention." in name and ".indexer." not in name and p.dim() == 2:
                p.normal_(0.0, 0.5)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".indexer." in n for n in trainable)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-2)

    seen = {}
    attach = Glm5DSAttention._attach_indexer_loss

    def spy(self, output, q, kv_lat, topk_indices, feats, coeff, *rest):
        seen[self.layer_number] = (q.detach(), kv_lat.detach(), feats, self)
        return attach(self, output, q, kv_lat, topk_indices, feats, coeff, *rest)

    monkeypatch.setattr(Glm5DSAttention, "_attach_indexer_loss", spy)
    docs = (40, 60, 28)
    cu = torch.tensor([0] + torch.tensor(docs).cumsum(0).tolist(), dtype=torch.int32)
    rows = [torch.randint(1, 240, (1, sum(docs)), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    model.train()
    losses, recalls = [], []
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
    for step in range(31):
        ids = rows[step % 4]
        opt.zero_grad()
        model(ids, labels=ids, packed_seq_params=make_packed_seq_params(cu)).float().mean().backward()
        values = DSAIndexerLossLoggingHelper.tracker["values"]
        losses.append(values.mean().item())
        DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
        recalls.append(_top_pool_recall(seen))
        opt.step()
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4         # one pass over the 4 rows each
    r_first, r_last = sum(recalls[:4]) / 4, sum(recalls[-4:]) / 4
    print(f"\nwarm-up indexer loss (mean over 4 rows): steps 1-4 {first:.4f} -> steps 28-31 {last:.4f}; "
          f"top-pool recall {r_first:.2f} -> {r_last:.2f}")
    assert last <= first / 2, losses
    assert r_last >= r_first + 0.2, recalls


# ---------------------------------------------------------------------------- TP + SP, CP, PP
# tests/test_parallel_training.py's runs (its 5-layer 'moe' model with vision and MTP, packed image+text rows, plain
# SGD, 3 steps), from initial weights whose indexers are drawn wide: with the default init both distributions are
# near uniform and the KL (~1e-5) is a small difference of O(1) terms, ill-conditioned for a 1e-5 comparison
from tests.test_parallel_training import LAYOUTS, STEPS, _common  # noqa: E402

INDEXER_LOSS = ["--dsa-indexer-loss-coeff", "1.0", "--dsa-indexer-use-sparse-loss"]
_ONE_RANK = {}


def _peaked_checkpoint(workdir, variant: str = "moe"):
    """(HF config dir, a layout-free 'release' checkpoint): the model ``variant`` of tests/test_parallel_training.py
    with its indexers' matrices drawn with std 0.3 (Megatron-LM's layout, as that test writes it)."""
    from tests.test_parallel_training import _initial_checkpoint

    def peaked(model):
        for name, p in model.named_parameters():
            if ".indexer." in name and p.dim() == 2:
                p.normal_(0.0, 0.3)

    return _initial_checkpoint(workdir, variant, name="init_peaked", edit=peaked)


def _indexer_run(workdir, data, name, flags, nproc, loss_flags=INDEXER_LOSS, variant="moe"):
    from tests.training_harness import read_dist_checkpoint, run, scalars

    hf, init = _peaked_checkpoint(workdir, variant)
    out = workdir / f"idx_{name}"
    args = _common(hf, data, "sgd") + ["--pretrained-checkpoint", str(init), "--save", str(out / "ckpt"),
                                       "--save-interval", "100", "--no-save-optim", "--tensorboard-dir",
                                       str(out / "tb")] + list(loss_flags) + list(flags)
    proc = run(args, nproc=nproc, timeout=1500)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    tb = scalars(out / "tb")
    weights = {k: v for k, v in read_dist_checkpoint(str(out / "ckpt" / f"iter_{STEPS:07d}")).items()
               if ".indexer." in k}
    return dict(tb["indexer loss"]), dict(tb["lm loss"]), weights


WARMUP = ["--dsa-indexer-loss-coeff", "1.0", "--dsa-indexer-warmup", str(STEPS)]


@pytest.mark.parametrize("layout, stage", [("tp2_sp", "sparse"), ("cp2", "sparse"), ("pp2", "sparse"),
                                           ("pp2_vpp2", "sparse"), ("cp2", "warmup")])
def test_indexer_loss_per_step_equals_one_rank(parallel_workdir, parallel_data, mcore, layout, stage):
    """The sparse indexer loss of each of 3 SGD steps (TensorBoard 'indexer loss': the mean over the 3 indexers,
    decoder and MTP) at tp2_sp (heads split, the head sum all-reduced), cp2 (queries split, the row's count of
    rows), pp2 (the indexers on two stages) and pp2_vpp2 (the 4-layer model, one layer per virtual stage, the MTP
    indexer on the last) equals the one-rank run's to 1e-5, and so do the LM loss and the trained indexer weights
    (relative to each tensor's largest entry); the warm-up (dense attention and target) at cp2 too."""
    loss_flags = WARMUP if stage == "warmup" else INDEXER_LOSS
    nproc, flags, variant = LAYOUTS[layout]
    model_flags = flags[flags.index("--num-layers"):][:2] if "--num-layers" in flags else []
    if (stage, variant) not in _ONE_RANK:
        _ONE_RANK[stage, variant] = _indexer_run(parallel_workdir, parallel_data, f"one_rank_{stage}_{variant}", model_flags, 1,
                                                 loss_flags, variant)
    ref_idx, ref_lm, ref_w = _ONE_RANK[stage, variant]
    idx, lm, w = _indexer_run(parallel_workdir, parallel_data, f"{layout}_{stage}", flags, nproc, loss_flags, variant)
    print(f"\n{layout} ({stage}): indexer loss {idx} one rank {ref_idx}")
    assert sorted(idx) == sorted(ref_idx) == list(range(1, STEPS + 1))
    for step in idx:
        assert ref_idx[step] > 0
        assert abs(idx[step] - ref_idx[step]) <= 1e-5 * abs(ref_idx[step]), (step, idx, ref_idx)
        assert abs(lm[step] - ref_lm[step]) <= 1e-5 * abs(ref_lm[step]), (step, lm, ref_lm)
    assert w.keys() == ref_w.keys() and len(w) == 3 * 7  # 2 decoder indexers (both variants) and the MTP one
    for k in w:
        assert (w[k] - ref_w[k]).abs().max() <= 1e-5 * ref_w[k].abs().max(), k


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernel_lse_matches_reference_and_feeds_the_sparse_loss_gpu(dtype):
    """sparse_mla(return_lse=True): the output is the one without it, the log-sum-exp equals the reference's
    (fp32 2e-5, bf16 2e-2 absolute), and the sparse indexer loss from it equals the loss from the recomputed softmax."""
    from megatron_glm5.kernels.sparse_mla import HAVE_TRITON, sparse_mla, sparse_mla_reference

    if not HAVE_TRITON:
        pytest.skip("needs triton")
    cfg = _cfg(index_topk=8, index_n_heads=4, dsa_indexer_loss_coeff=1.0)
    ix = _random_indexer(cfg, seed=11).cuda()
    lens = [3, 4, 17, 9, 30]
    s = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    psp = make_packed_seq_params(cu)
    gen = torch.Generator(device="cuda").manual_seed(2)
    H, R = 4, 32
    x = torch.randn(s, 1, cfg.hidden_size, device="cuda", generator=gen)
    qr = torch.randn(s, 1, cfg.q_lora_rank, device="cuda", generator=gen)
    q_lat = torch.randn(1, s, H, R, device="cuda", generator=gen, dtype=dtype)
    c = torch.randn(1, s, R, device="cuda", generator=gen, dtype=dtype)
    scale = R ** -0.5
    with torch.no_grad():
        idx, f = ix(x, qr, packed_seq_params=psp, return_features=True)
        o, lse = sparse_mla(q_lat, c, idx, scale, return_lse=True)
        assert torch.equal(o, sparse_mla(q_lat, c, idx, scale))
        _, ref_lse = sparse_mla_reference(q_lat, c, idx, scale, return_lse=True)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(lse, ref_lse, atol=tol, rtol=0), (lse - ref_lse).abs().max()
        kl, rows = kpool_indexer_kl(f, q_lat, c, scale, ix.softmax_scale, idx, ix.kpool, ix.index_topk, True)
        kl_lse, rows_lse = kpool_indexer_kl(f, q_lat, c, scale, ix.softmax_scale, idx, ix.kpool, ix.index_topk,
                                            True, lse=lse)
    assert int(rows) == int(rows_lse) > 0
    assert abs(kl_lse - kl) <= (1e-5 if dtype == torch.float32 else 2e-2) * abs(kl), (kl_lse.item(), kl.item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warmup_dense_attention_runs_a_fused_kernel_gpu():
    """The warm-up's dense attention at the released head widths (64 heads, qk / v 256, bf16) with a packed row's
    document-causal mask runs in one of torch's fused SDPA kernels (no fallback), forward and backward, and equals
    the unfused math path (bf16 rounding: 2e-2 of max |out|, gradients 3e-2 of max |grad|)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_glm5.models import kpool_dsa
    from megatron_glm5.kernels.documents import document_ids

    gen = torch.Generator(device="cuda").manual_seed(5)
    lens = [700, 1300, 37, 2058]
    s = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda")
    doc = document_ids(cu, s)
    pos = torch.arange(s, device="cuda")
    mask = (doc[None, :] == doc[:, None]) & (pos[None, :] <= pos[:, None])
    q, k, v = (torch.randn(1, 64, s, 256, device="cuda", generator=gen, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = kpool_dsa.fused_masked_attention(q, k, v, mask, 256 ** -0.5)
    assert kpool_dsa.dense_attention_fallback() is None
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                               scale=256 ** -0.5)
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    assert (out.float() - ref).abs().max() <= 2e-2 * ref.abs().max()
    for g, r in zip(grads, ref_grads):
        assert (g.float() - r).abs().max() <= 3e-2 * r.abs().max()
