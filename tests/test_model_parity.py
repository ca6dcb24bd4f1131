"""Whole-model parity against transformers' Glm5NextForConditionalGeneration on a tiny random checkpoint.

The checkpoint is built and saved by transformers itself (tools/make_tiny_hf_checkpoint.py). Our model runs one
packed row of 3 documents (one with an image); transformers has no packing, so its reference is each document run
on its own. fp32, CPU.
"""

import os
import time

import pytest
import torch

from megatron_glm5.data.synthetic import cu_seqlens_of


DOC_LENS = (23, 37, 30)  # document 1 carries the image


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from megatron_glm5.cli.make_tiny_hf_checkpoint import write_checkpoint

    from megatron_glm5.config import tiny_hf_config

    path = str(tmp_path_factory.mktemp("ckpt") / "tiny_fp32")
    return write_checkpoint(path, tiny_hf_config(), fmt="fp32", seed=3)


def _hf_model(path):
    from transformers import Glm5NextForConditionalGeneration

    m = Glm5NextForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return m.eval()


def make_inputs(cfg_json, seed=0):
    """One packed row: 3 documents; the second holds <begin_image> <image>*k <end_image>."""
    from megatron_glm5.data.synthetic import packed_documents

    return packed_documents(cfg_json, DOC_LENS, image_doc=1, grid_thw=(1, 4, 6), image_at=5, seed=seed)


def hf_doc_forward(hf, docs, pixel_values, grid, image_doc=1):
    outs = []
    for i, d in enumerate(docs):
        kw = dict(pixel_values=pixel_values, image_grid_thw=grid) if i == image_doc else {}
        outs.append(hf(input_ids=d[None], **kw).logits[0])
    return torch.cat(outs, 0)


def hf_grads_by_checkpoint_name(hf):
    """HF module-tree grads renamed/split to the checkpoint key layout."""
    out = {}
    for name, p in hf.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        name = name.replace("self_attn.forget_gate.", "self_attn.")
        name = name.replace(".attn_hc.", ".hc_attn_").replace(".ffn_hc.", ".hc_ffn_")
        if name.endswith("self_attn.conv1d.weight"):
            for part, t in zip("qkv", g.chunk(3, dim=0)):
                out[name.replace("conv1d", f"{part}_conv1d")] = t
        elif name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(g.shape[0]):
                gate, up = g[e].chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"] = gate
                out[f"{base}{e}.up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(g.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = g[e]
        else:
            out[name] = g
    return out


def test_logits_and_grads_match_transformers(tiny_ckpt, mcore):
    import json

    from megatron_glm5.checkpoint.hf_keys import canonical_name, mcore_to_hf
    from megatron_glm5.models.builder import build_model_from_hf
    from megatron_glm5.models.packing import make_packed_seq_params

    cfg_json = json.load(open(os.path.join(tiny_ckpt, "config.json")))
    docs, pv, grid = make_inputs(cfg_json)
    hf = _hf_model(tiny_ckpt)
    ours = build_model_from_hf(tiny_ckpt, dtype=torch.float32, device="cpu")
    cfg = ours.config
    assert cfg.index_topk < max(DOC_LENS), "the indexer must really drop positions"

    ids = torch.cat(docs)[None]
    cu = cu_seqlens_of(DOC_LENS)
    psp = make_packed_seq_params(cu)

    # ---- logits (the timed pass is the second one: the first pays one-off lazy initialisation)
    with torch.no_grad():
        for _ in range(2):
            t0 = time.perf_counter()
            ref = hf_doc_forward(hf, docs, pv, grid)
            t_hf = time.perf_counter() - t0
            t0 = time.perf_counter()
            got = ours(ids, packed_seq_params=psp, pixel_values=pv, image_grid_thw=grid)[0]
            t_ours = time.perf_counter() - t0
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"\n[parity] fp32 CPU logits: max|dlogit| = {err:.3e}, max|logit| = {scale:.3f}, "
          f"ratio = {err / scale:.3e}, top-1 agreement = {top1 * 100:.2f}%")
    print(f"[timing] tiny model forward, {ids.shape[1]} tokens: ours {t_ours * 1e3:.1f} ms, "
          f"transformers (per document) {t_hf * 1e3:.1f} ms")
    assert err <= 1e-4 * scale
    assert top1 == 1.0

    # ---- gradients of one loss wrt every parameter
    g = torch.Generator().manual_seed(11)
    w = torch.randn(ref.shape, generator=g)
    hf.zero_grad()
    (hf_doc_forward(hf, docs, pv, grid) * w).sum().backward()
    ref_grads = hf_grads_by_checkpoint_name(hf)
    ours.zero_grad()
    (ours(ids, packed_seq_params=psp, pixel_values=pv, image_grid_thw=grid)[0] * w).sum().backward()

    compared, worst = 0, (0.0, "")
    for local, p in ours.named_parameters():
        hf_names = mcore_to_hf(canonical_name(local, ours), cfg.num_layers)
        refs = [ref_grads.get(n) for n in hf_names]
        if all(r is None for r in refs):
            # parameters transformers gives no gradient (the indexer runs under no_grad)
            assert p.grad is None or p.grad.abs().max() == 0, f"{local} has a gradient but transformers' has none"
            continue
        r = torch.cat(refs, 0) if len(refs) > 1 else refs[0]
        assert p.grad is not None, f"{local}: no gradient"
        rel = ((p.grad - r).norm() / r.norm().clamp(min=1e-30)).item()
        compared += 1
        worst = max(worst, (rel, local))
        assert rel <= 1e-4, f"{local}: gradient rel L2 {rel:.2e}"
    print(f"[parity] gradients: {compared} parameters compared, worst rel L2 = {worst[0]:.2e} ({worst[1]})")
    assert compared > 50


def test_hf_forward_tool_matches_transformers(tiny_ckpt, tmp_path, mcore):
    import json

    from megatron_glm5.cli import hf_forward

    cfg_json = json.load(open(os.path.join(tiny_ckpt, "config.json")))
    docs, pv, grid = make_inputs(cfg_json, seed=1)
    ids = torch.cat(docs)[None]
    cu = cu_seqlens_of(DOC_LENS)
    inp, out = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"input_ids": ids, "pixel_values": pv, "image_grid_thw": grid, "cu_seqlens": cu}, inp)
    assert hf_forward.main(["--hf-dir", tiny_ckpt, "--input", str(inp), "--output", str(out)]) == 0
    got = torch.load(out)["logits"][0]
    with torch.no_grad():
        ref = hf_doc_forward(_hf_model(tiny_ckpt), docs, pv, grid)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_hf_forward_tool_rejects_bad_input(tiny_ckpt, tmp_path, mcore, capsys):
    from megatron_glm5.cli import hf_forward

    out = tmp_path / "out.pt"
    cases = {
        "ids_dtype": {"input_ids": torch.rand(1, 8)},
        "out_of_vocab": {"input_ids": torch.full((1, 8), 10 ** 6)},
        "bad_cu": {"input_ids": torch.ones(1, 8, dtype=torch.long), "cu_seqlens": torch.tensor([0, 5], dtype=torch.int32)},
        "pv_without_grid": {"input_ids": torch.ones(1, 8, dtype=torch.long), "pixel_values": torch.zeros(4, 1176)},
    }
    for name, batch in cases.items():
        inp = tmp_path / f"{name}.pt"
        torch.save(batch, inp)
        rc = hf_forward.main(["--hf-dir", tiny_ckpt, "--input", str(inp), "--output", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2, name
        assert len(err) == 1 and err[0].startswith("hf_forward: error:"), (name, err)
        assert not out.exists(), name
