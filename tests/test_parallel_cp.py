"""Context parallelism end to end: the tiny model (KDA + DSA layers, MoE, vision tower, MTP) trained 3 SGD steps on
one packed row cut by ``split_batch_for_cp`` gives, at cp2 / cp4 / tp2_cp2, the same lm loss, MTP loss and gradients
of every parameter at every step (and so the same weights) as one rank on the uncut row.

The row: 4 documents, 45 tokens (padded to 46 / 48), one document spanning three cp4 chunks, two chunks starting
exactly at a document start, an image whose tokens cross a chunk edge (cp4) and an image inside a later chunk.
Loss convention (megatron, ``calculate_per_token_loss=False``): every CP rank back-propagates ``cp`` times its share
of the row's token mean (``cp_token_mean``) and gradients are averaged over CP, like megatron's DDP over DP x CP.
"""

import os
import sys

import pytest
import torch

from megatron_glm5.data.synthetic import cu_seqlens_of, packed_documents

sys.path.insert(0, os.path.dirname(__file__))

from tests.helpers import rel_max, spawn  # noqa: E402

LENS = (3, 30, 5, 7)
STEPS = 3
LR = 0.01
TOL = 1e-5  # losses per step and weights after the steps
GRAD_TOL = 3e-5  # first-step gradients, per tensor: a reordered fp32 sum alone moves them ~3e-5 (see `reference`;
# the worst is an mHC `scale`, three numbers each summed over every token with cancelling terms)


def _hf_config():
    from megatron_glm5.config import tiny_hf_config

    return tiny_hf_config(mtp=True)


def _batch():
    """One packed row: tokens / labels (shifted inside each document) / loss_mask / cu_seqlens, two images."""
    cfg = _hf_config()
    docs, pix, grid = packed_documents(cfg, LENS, image_doc=1, grid_thw=(1, 6, 6), image_at=2, seed=4)
    d = docs[3]  # a second image (2 x 2 merged tokens) inside the last document
    d[1], d[2:6], d[6] = cfg["image_start_token_id"], cfg["image_token_id"], cfg["image_end_token_id"]
    g = torch.Generator().manual_seed(5)
    pix = torch.cat([pix, torch.randn(16, pix.shape[1], generator=g)])
    grid = torch.cat([grid, torch.tensor([[1, 4, 4]])])
    labels = torch.cat([torch.cat([x[1:], torch.tensor([-100])]) for x in docs])[None]
    return {"tokens": torch.cat(docs)[None], "labels": labels, "loss_mask": (labels != -100).float(),
            "cu_seqlens": cu_seqlens_of(LENS), "pixel_values": pix, "image_grid_thw": grid}


def _build(ckpt, tp=1, cp=1):
    from megatron_glm5.models.builder import build_model_from_hf

    model = build_model_from_hf(ckpt, parallel_output=True, kda_chunk_size=16, tensor_model_parallel_size=tp,
                                context_parallel_size=cp)
    return model.train()


def _train(model, batch, psp, steps=STEPS, lr=LR):
    """``steps`` SGD steps; returns ([(lm loss, MTP loss, {canonical name: gradient averaged over CP})] per step,
    {canonical name: weight after the steps})."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_glm5.checkpoint.hf_keys import canonical_name
    from megatron_glm5.models.context_parallel import cp_all_reduce, cp_token_mean

    group, cp = ps.get_context_parallel_group(), ps.get_context_parallel_world_size()
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        visual = {k: batch.get(k) for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}
        per_token = model(batch["tokens"], labels=batch["labels"].clamp(min=0), loss_mask=batch["loss_mask"],
                          packed_seq_params=psp, **visual)
        share = cp_token_mean(per_token, batch["loss_mask"], group)
        (share * cp).backward()
        grads = {}
        for name, p in model.named_parameters():
            g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
            if cp > 1:
                dist.all_reduce(g, group=group)
                g /= cp
            grads[canonical_name(name, model)] = g
            with torch.no_grad():
                p -= lr * g
        out.append((cp_all_reduce(share, group).item(), model.last_mtp_loss.item(), grads))
    return out, {canonical_name(n, model): p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, mcore):
    from megatron_glm5.cli.make_tiny_hf_checkpoint import write_checkpoint

    from megatron_glm5.models.packing import make_packed_seq_params

    root = tmp_path_factory.mktemp("cp")
    ckpt = write_checkpoint(str(root / "hf"), _hf_config(), fmt="fp32", mtp=True, seed=7)
    batch = _batch()
    # one thread, as on the ranks: torch's CPU kernels split their sums by thread count, and this model's fp32
    # gradients move ~3e-5 with that order alone (1 vs 2 threads, one process), more than TOL
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        steps, weights = _train(_build(ckpt), batch, make_packed_seq_params(batch["cu_seqlens"]))
    finally:
        torch.set_num_threads(threads)
    path = str(root / "ref.pt")
    torch.save((steps, weights), path)
    print("\n[reference] lm loss " + " ".join(f"{s[0]:.6f}" for s in steps)
          + " | mtp " + " ".join(f"{s[1]:.6f}" for s in steps))
    return ckpt, path


def _worker(ckpt, ref_path, tp, cp):
    from megatron.core import parallel_state as ps

    from megatron_glm5.checkpoint.hf_keys import canonical_name, mcore_to_hf
    from megatron_glm5.data.context_parallel import split_batch_for_cp
    from megatron_glm5.initialize import initialize_megatron
    from test_convert_hf_to_mcore import _tp_shard

    initialize_megatron(tp=tp, cp=cp)
    model = _build(ckpt, tp=tp, cp=cp)
    if tp > 1:  # megatron's MoELayer refuses TP without sequence parallelism in training mode (and DSA has no
        model.eval()  # sequence parallelism on this branch yet); eval mode computes the same gradients
    local, psp = split_batch_for_cp(_batch(), cp, ps.get_context_parallel_rank(), model.config)
    got, weights = _train(model, local, psp)
    ref, ref_weights = torch.load(ref_path)
    params = {canonical_name(n, model): p for n, p in model.named_parameters()}

    def worst(tensors, ref_tensors):
        out = (0.0, "")
        for name, t in tensors.items():
            if tp > 1 and ".mlp.experts." in name:
                continue  # TP without SP: megatron's MoE gives routed experts twice the gradient (at CP 1 too)
            want = ref_tensors[name]
            if tp > 1:
                want = _tp_shard(want, t, params[name], len(mcore_to_hf(name, model.config.num_layers)),
                                 ps.get_tensor_model_parallel_rank(), tp)
            out = max(out, (rel_max(t, want), name))
        return out

    errs = {}
    for step, ((loss, mtp, _), (rloss, rmtp, _)) in enumerate(zip(got, ref)):
        errs[f"step{step} lm loss"] = abs(loss - rloss) / abs(rloss)
        errs[f"step{step} mtp loss"] = abs(mtp - rmtp) / abs(rmtp)
    # gradients at the first step (later steps start from weights that differ by rounding, and this model's
    # gradients move ~1e-4 for weight changes of that size); the weights after all steps
    err, name = worst(got[0][2], ref[0][2])
    errs[f"step0 grad (worst: {name})"] = err
    err, name = worst(weights, ref_weights)
    errs[f"weights after {STEPS} steps (worst: {name})"] = err
    errs["n_params"] = -float(len(weights))
    return (errs, [s[0] for s in got])


def _run(reference, tp, cp):
    ckpt, ref_path = reference
    results = spawn(_worker, tp * cp, ckpt, ref_path, tp, cp, timeout=600)
    worst = {}
    for errs, _ in results:
        for k, v in errs.items():
            worst[k] = max(worst.get(k, -1e9), v)
    print(f"\n[tp{tp} cp{cp}] lm loss " + " ".join(f"{x:.6f}" for x in results[0][1]))
    for k, v in worst.items():
        if k != "n_params":
            print(f"[tp{tp} cp{cp}] {k}: {v:.2e}")
    assert -worst["n_params"] > 100
    bad = {k: v for k, v in worst.items() if v > (GRAD_TOL if k.startswith("step0 grad") else TOL)}
    assert not bad, bad


def test_parallel_cp2(reference):
    _run(reference, tp=1, cp=2)


def test_parallel_cp4(reference):
    _run(reference, tp=1, cp=4)


def test_parallel_tp2_cp2(reference):
    _run(reference, tp=2, cp=2)
