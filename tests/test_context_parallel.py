"""Contiguous context parallelism, module by module: the batch cut (split / merge, padding, images), the contiguous
MTP roll, KDA (conv tail + recurrent state across ranks), the KPool indexer and DSA on 2 and 4 gloo ranks equal the
same module on the whole row in one process (outputs, input gradients, parameter gradients summed over CP)."""

import os

import pytest
import torch

from megatron_glm5.config import tiny_config
from megatron_glm5.data.context_parallel import merge_cp_chunks, split_batch_for_cp
from megatron_glm5.data.synthetic import cu_seqlens_of
from tests.helpers import rel_max, spawn

# Rows of 40 tokens whose documents cross chunk edges (at cp = 4 the third one spans chunks 1, 2 and 3), and a row of
# 8 tokens whose chunks at cp = 4 are shorter than the conv's W - 1 = 3 inputs.
ROWS = {"long": (3, 14, 21, 2), "short": (7, 1)}


# ============================================================================ the batch cut (one process)
def _row(cfg, lens, image_at=None, n_img=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = sum(lens)
    tokens = torch.randint(1, 200, (1, s), generator=g)
    if image_at is not None:
        tokens[0, image_at:image_at + n_img] = cfg.image_token_id
    batch = {"tokens": tokens, "labels": torch.randint(0, 200, (1, s), generator=g),
             "loss_mask": (torch.rand(1, s, generator=g) > 0.2).float(), "cu_seqlens": cu_seqlens_of(lens),
             "position_ids": torch.arange(s)[None], "dataset_id": torch.tensor([3])}
    if image_at is not None:
        batch["pixel_values"] = torch.randn(4 * n_img, 1176, generator=g)
        batch["image_grid_thw"] = torch.tensor([[1, 6, 6]])
    return batch


@pytest.mark.parametrize("cp,multiple", [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (4, 3)])
def test_split_merge_round_trip(cp, multiple):
    cfg = tiny_config()
    batch = _row(cfg, (4, 16, 3), image_at=5)  # 23 tokens: padded for every cp > 1; the image spans chunk edges
    s = 23
    parts = [split_batch_for_cp(batch, cp, r, cfg, chunk_multiple=multiple) for r in range(cp)]
    total = -(-s // (cp * multiple)) * cp * multiple
    glob = [0, 4, 20, 23] + ([total] if total > s else [])
    n_before = 0
    for r, (local, p) in enumerate(parts):
        L = total // cp
        assert local["tokens"].shape == (1, L) and p.chunk_offset == r * L and p.global_seq_len == total
        assert p.cu_seqlens_global.tolist() == glob
        assert p.cu_seqlens_q.tolist() == [0] + [c - r * L for c in glob if r * L < c < (r + 1) * L] + [L]
        assert torch.equal(local["cu_seqlens"], p.cu_seqlens_q)
        assert p.image_token_offset == n_before  # feature rows of the image tokens before this chunk
        n_before += int((local["tokens"] == cfg.image_token_id).sum())
        assert local["pixel_values"] is batch["pixel_values"]  # every rank keeps the row's images
        pad = torch.arange(r * L, (r + 1) * L) >= s
        assert bool((local["loss_mask"][0, pad] == 0).all()) and bool((local["labels"][0, pad] == 0).all())
        assert bool((local["position_ids"][0, pad] == 0).all())
    merged = merge_cp_chunks([lb for lb, _ in parts], parts[0][1], s)
    for k, v in batch.items():
        assert torch.equal(merged[k], v.to(merged[k].dtype)), k


def test_split_rejects_bad_batches():
    cfg = tiny_config()
    batch = _row(cfg, (4, 6))
    with pytest.raises(ValueError, match="cu_seqlens"):
        split_batch_for_cp({**batch, "cu_seqlens": torch.tensor([0, 4, 9])}, 2, 0)
    with pytest.raises(ValueError, match="one packed row"):
        split_batch_for_cp({**batch, "tokens": batch["tokens"].expand(2, -1)}, 2, 0)
    with pytest.raises(ValueError, match="bad CP layout"):
        split_batch_for_cp(batch, 2, 2)


def test_roll_without_cp_is_megatrons_packed_roll(mcore):
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    from megatron_glm5.models.context_parallel import roll_left_in_documents
    from megatron_glm5.models.packing import make_packed_seq_params

    x = torch.randint(1, 100, (1, 40))
    psp = make_packed_seq_params(cu_seqlens_of(ROWS["long"]))
    assert torch.equal(roll_left_in_documents(x, psp, None), roll_tensor(x, -1, -1, None, psp)[0])
    xb = torch.randn(3, 9)
    assert torch.equal(roll_left_in_documents(xb, None, None), roll_tensor(xb, -1, -1, None, None)[0])


# ============================================================================ the KDA state hand-off (one process)
def _chunked_kda(core, q, k, v, g, beta, cu, cp, monkeypatch):
    """:func:`cp_chunk_kda` of every CP chunk of the row in one process, the all-gather replaced by the chunks'
    summaries (first pass: collect them; second pass: every chunk sees all of them). Returns the row's output."""
    import megatron_glm5.models.kda_cp as kda_cp
    from megatron_glm5.models.context_parallel import SequenceLayout

    S = q.shape[1]
    L = S // cp
    summaries = []

    def run():
        outs = []
        for r in range(cp):
            layout = SequenceLayout(cu.to(q.device), r * L, L, S, None, cp, r)
            part = [t[:, r * L:(r + 1) * L] for t in (q, k, v, g, beta)]
            outs.append(kda_cp.cp_chunk_kda(core, *part, q.shape[-1] ** -0.5, layout, chunk_size=16))
        return torch.cat(outs, 1)

    monkeypatch.setattr(kda_cp, "gather_sequence", lambda x, group, seq_dim=0: summaries.append(x) or x.repeat(cp, 1, 1, 1))
    run()
    gathered = torch.cat(summaries)
    monkeypatch.setattr(kda_cp, "gather_sequence", lambda x, group, seq_dim=0: gathered)
    return run()


def _kda_inputs(S, H, K, V, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = [torch.randn(1, S, H, K, generator=gen), torch.randn(1, S, H, K, generator=gen),
         torch.randn(1, S, H, V, generator=gen), -5 * torch.sigmoid(torch.randn(1, S, H, K, generator=gen)),
         torch.rand(1, S, H, generator=gen)]
    return [x.to(device) for x in t]


@pytest.mark.parametrize("cp,lens", [(2, (3, 14, 21, 2)), (4, (3, 14, 21, 2)), (5, (3, 40, 2)), (4, (7, 1))])
def test_kda_state_hand_off_one_process(cp, lens, monkeypatch):
    """The affine state summaries composed across chunks give the whole row's delta rule (a document spanning up to
    four chunks, chunks that start at a document start, chunks of 2 tokens)."""
    from megatron_glm5.models.kda import chunk_kda_torch

    cu = cu_seqlens_of(lens)
    q, k, v, g, beta = _kda_inputs(int(cu[-1]), 2, 8, 6, "cpu")
    ref = chunk_kda_torch(q, k, v, g, beta, cu_seqlens=cu, chunk_size=16, use_qk_l2norm=True)
    got = _chunked_kda(chunk_kda_torch, q, k, v, g, beta, cu, cp, monkeypatch)
    err = rel_max(got, ref)
    print(f"cp{cp} {lens}: rel max err {err:.2e}")
    assert err < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,heads,dim", [(torch.float32, 4, 64), (torch.bfloat16, 64, 128)], ids=["fp32", "bf16"])
def test_kda_state_hand_off_fla_core(monkeypatch, dtype, heads, dim):
    """The same hand-off around FLA's ``chunk_kda`` (value width V + K, write / probe tokens) at cp 4, forward and
    gradients. fp32: equal to FLA on the whole row (FLA's kernels use TF32 dots). bf16 (the released KDA widths, 64
    heads of 128, FLA's tuned path): against the fp32 reference ``chunk_kda_torch``, the hand-off's error is at most
    twice FLA's own on the whole row (plus 2e-3 of the scale)."""
    pytest.importorskip("triton")
    from megatron_glm5.models.kda import chunk_kda_fla, chunk_kda_torch

    cu = cu_seqlens_of((30, 200, 170, 112))
    inputs = _kda_inputs(512, heads, dim, dim, "cuda")

    def run(core, chunked, in_dtype):
        xs = [x.to(in_dtype, copy=True).requires_grad_(True) for x in inputs]   # fresh leaves for every run
        if chunked:
            out = _chunked_kda(core, *xs, cu, 4, monkeypatch)
        else:
            out = core(*xs, cu_seqlens=cu.cuda(), chunk_size=16, use_qk_l2norm=True)
        out.float().backward(torch.ones_like(out, dtype=torch.float32))
        return [out.detach().float()] + [x.grad.float() for x in xs]

    whole, handed = run(chunk_kda_fla, False, dtype), run(chunk_kda_fla, True, dtype)
    if dtype == torch.float32:
        assert rel_max(handed[0], whole[0]) < 5e-3
        for a, b in zip(handed[1:], whole[1:]):
            assert rel_max(a, b) < 1e-2
        return
    ref = run(chunk_kda_torch, False, torch.float32)
    for name, h, w, r in zip(("out", "dq", "dk", "dv", "dg", "dbeta"), handed, whole, ref):
        err_handed, err_whole = rel_max(h, r), rel_max(w, r)
        print(f"bf16 {name}: hand-off {err_handed:.2e}, FLA whole row {err_whole:.2e}")
        assert torch.isfinite(h).all(), name
        assert err_handed <= 2 * err_whole + 2e-3, name


# ============================================================================ modules on 2 / 4 ranks
def _module_config(**over):
    kw = dict(use_cpu_initialization=True, params_dtype=torch.float32, kda_chunk_size=16)
    kw.update(over)
    return tiny_config(**kw)


def _same_weights(module):
    import torch.distributed as dist

    for p in module.parameters():
        dist.broadcast(p.data, 0)


def _compare(mod_ref, mod_cp, row_len, cu, forward, rank, cp, seed):
    """Run ``forward(module, x, packed_seq_params) -> (out, extra)`` on the whole row (reference) and on this rank's
    chunk; returns the relative errors of the output, the input gradient and every parameter gradient (summed over
    CP), and whether ``extra`` (e.g. DSA's selection) matches."""
    import torch.distributed as dist

    from megatron_glm5.models.packing import make_packed_seq_params

    cfg = mod_ref.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(row_len, 1, cfg.hidden_size, generator=g)
    w = torch.randn(row_len, 1, cfg.hidden_size, generator=g)
    batch = {"tokens": torch.zeros(1, row_len, dtype=torch.long), "cu_seqlens": cu}
    _, params = split_batch_for_cp(batch, cp, rank)
    L = params.global_seq_len // cp
    assert params.global_seq_len == row_len
    sl = slice(rank * L, (rank + 1) * L)

    xr = x.clone().requires_grad_(True)
    out_ref, extra_ref = forward(mod_ref, xr, make_packed_seq_params(cu))
    (out_ref * w).sum().backward()
    xc = x[sl].clone().requires_grad_(True)
    out, extra = forward(mod_cp, xc, params)
    (out * w[sl]).sum().backward()

    errs = {"out": rel_max(out.detach(), out_ref.detach()[sl]), "x.grad": rel_max(xc.grad, xr.grad[sl])}
    ref_grads = dict(mod_ref.named_parameters())
    for name, p in mod_cp.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(grad)
        ref = ref_grads[name].grad
        errs[name] = rel_max(grad, torch.zeros_like(p) if ref is None else ref)
    same_extra = extra is None or torch.equal(extra, extra_ref[:, sl])
    return errs, same_extra


def _module_worker(row_names):
    """This rank's ``{check: relative difference or 0/1 failure flag}`` (run by :func:`tests.helpers.spawn`)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megatron_glm5.initialize import initialize_megatron
    from megatron_glm5.models.context_parallel import roll_left_in_documents
    from megatron_glm5.models.kda import KimiDeltaAttention, get_kda_module_spec
    from megatron_glm5.models.kpool_dsa import get_dsa_module_spec
    from megatron.core.transformer.multi_token_prediction import roll_tensor
    from megatron_glm5.models.packing import make_packed_seq_params

    initialize_megatron(cp=world)
    solo = [dist.new_group([r]) for r in range(world)][rank]  # a CP group of one: the whole-row reference
    ref_pgs = ProcessGroupCollection(tp=ps.get_tensor_model_parallel_group(), cp=solo)
    results = {}
    for row in row_names:
        lens = ROWS[row]
        cu = cu_seqlens_of(lens)
        s = sum(lens)
        # the contiguous roll == megatron's packed roll of the whole row
        lab = torch.randint(0, 100, (1, s), generator=torch.Generator().manual_seed(3))
        _, params = split_batch_for_cp({"tokens": lab, "cu_seqlens": cu}, world, rank)
        L = s // world
        want = roll_tensor(lab, -1, -1, None, make_packed_seq_params(cu))[0][:, rank * L:(rank + 1) * L]
        results[f"roll/{row}"] = float(not torch.equal(
            roll_left_in_documents(lab[:, rank * L:(rank + 1) * L], params, ps.get_context_parallel_group()),
            want))

        for gate in ("bounded", "softplus"):
            over = {} if gate == "bounded" else {"linear_lower_bound": None}
            cfg = _module_config(**over)
            spec = get_kda_module_spec()
            ref = KimiDeltaAttention(cfg, spec.submodules, layer_number=1, pg_collection=ref_pgs)
            mod = KimiDeltaAttention(cfg, spec.submodules, layer_number=1)
            _same_weights(ref)
            mod.load_state_dict(ref.state_dict())
            errs, _ = _compare(ref, mod, s, cu, lambda m, x, p: (m(x, packed_seq_params=p)[0], None), rank,
                               world, seed=1)
            results.update({f"kda-{gate}/{row}/{k}": v for k, v in errs.items()})
            try:  # a chunk with plain PackedSeqParams under CP is refused with one line
                mod(torch.zeros(s // world, 1, cfg.hidden_size), packed_seq_params=make_packed_seq_params(
                    torch.tensor([0, s // world], dtype=torch.int32)))
                results["roll/refuses plain params"] = 1.0
            except ValueError as e:
                results["roll/refuses plain params"] = float("split_batch_for_cp" not in str(e))

        if row != "long":
            continue
        for backend in ("torch", "sparse"):
            cfg = _module_config(dsa_backend=backend)
            ref = build_module(get_dsa_module_spec(), config=cfg, layer_number=2, pg_collection=ref_pgs)
            mod = build_module(get_dsa_module_spec(), config=cfg, layer_number=2)
            with torch.no_grad():  # a random indexer (its HF init is degenerate) so that the selection matters
                for p in ref.indexer.parameters():
                    p.normal_(0, 0.5)
            _same_weights(ref)
            mod.load_state_dict(ref.state_dict())
            errs, same = _compare(ref, mod, s, cu, lambda m, x, p: m(x, packed_seq_params=p), rank, world,
                                  seed=2)
            results.update({f"dsa-{backend}/{k}": v for k, v in errs.items()})
            results[f"dsa-{backend}/selection differs"] = float(not same)
    return results


@pytest.mark.parametrize("cp", [2, 4])
def test_modules_cp_equal_whole_row(cp):
    rows = ["long", "short"] if cp == 4 else ["long"]
    results = spawn(_module_worker, cp, rows, timeout=300)
    worst = {}
    for res in results:
        for k, v in res.items():
            worst[k] = max(worst.get(k, 0.0), v)
    for group in ("roll", "kda-bounded", "kda-softplus", "dsa-torch", "dsa-sparse"):
        items = {k: v for k, v in worst.items() if k.startswith(group)}
        top = max(items, key=items.get)
        print(f"cp{cp} {group}: {len(items)} checks, worst {top} {items[top]:.2e}")
    bad = {k: v for k, v in worst.items() if v > 1e-5}
    assert not bad, bad
