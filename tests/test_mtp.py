"""The MTP layer (checkpoint layer L = num_layers) through megatron-core's MultiTokenPredictionBlock."""


import pytest
import torch
import torch.nn.functional as F

from megatron_glm5.data.synthetic import cu_seqlens_of


DOCS = (21, 34, 17)


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    from megatron_glm5.cli.make_tiny_hf_checkpoint import write_checkpoint

    from megatron_glm5.config import tiny_hf_config

    return write_checkpoint(str(tmp_path_factory.mktemp("mtp") / "ckpt"), tiny_hf_config(with_vision=False),
                            fmt="fp32", mtp=True, seed=2)


def _batch(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, 240, (n,), generator=g) for n in DOCS]
    labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs])[None]
    cu = cu_seqlens_of(DOCS)
    return torch.cat(docs)[None], labels, cu


def _roll_in_docs(x, cu, fill=0):
    """Shift left by one inside every document; the last slot of each document gets ``fill``."""
    out = torch.full_like(x, fill)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        out[..., a:b - 1] = x[..., a + 1:b]
    return out


def test_mtp_loss_matches_manual_and_main_loss_unchanged(mtp_ckpt, mcore):
    from megatron_glm5.models.builder import build_model_from_hf
    from megatron_glm5.models.mhc import contract_streams, expand_streams
    from megatron_glm5.models.packing import make_packed_seq_params

    model = build_model_from_hf(mtp_ckpt)
    plain = build_model_from_hf(mtp_ckpt, mtp_num_layers=None)
    assert model.config.mtp_num_layers == 1 and not plain.config.mtp_num_layers
    ids, labels, cu = _batch(model.config.vocab_size)
    psp = make_packed_seq_params(cu)
    mask = (labels != -100).float()

    loss_mtp = model(ids, labels=labels.clamp(min=0), loss_mask=mask, packed_seq_params=psp)
    loss_plain = plain(ids, labels=labels.clamp(min=0), packed_seq_params=psp)
    torch.testing.assert_close(loss_mtp, loss_plain, rtol=0, atol=0)  # MTP never changes the main loss

    # manual MTP depth 1: predict token t+2 from (normed main hidden at t, embedding of token t+1), per document
    with torch.no_grad():
        h = model.final_layernorm(contract_streams(
            model.decoder(expand_streams(model.embed(ids), model.hc_mult), packed_seq_params=psp), model.hc_mult))
        mtp = model.mtp.layers[0]
        e = model.embedding(input_ids=_roll_in_docs(ids, cu), position_ids=None)
        x, _ = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(h)], -1))
        x, _ = mtp.mtp_model_layer(x, packed_seq_params=psp)
        logits, _ = model.output_layer(mtp.final_layernorm(x))
        lab2 = _roll_in_docs(labels.clamp(min=0), cu)
        m2 = _roll_in_docs(mask, cu)
        ce = F.cross_entropy(logits[:, 0].float(), lab2[0], reduction="none")
        manual = (ce * m2[0]).sum() / m2.sum()
    print(f"\n[mtp] loss {model.last_mtp_loss.item():.6f} manual {manual.item():.6f}")
    torch.testing.assert_close(model.last_mtp_loss, manual, rtol=1e-5, atol=1e-6)

    # the MTP loss reaches the MTP weights and (through the shared trunk) the decoder
    model.zero_grad()
    ((loss_mtp * mask).sum() / mask.sum()).backward()
    assert model.mtp.layers[0].eh_proj.weight.grad.abs().sum() > 0
    assert model.mtp.layers[0].mtp_model_layer.attn_hc.fn.grad.abs().sum() > 0


def test_mtp_layer_is_a_dsa_moe_glm_layer(mtp_ckpt, mcore):
    from megatron_glm5.models.builder import build_model_from_hf
    from megatron_glm5.models.kpool_dsa import Glm5DSAttention

    model = build_model_from_hf(mtp_ckpt)
    layer = model.mtp.layers[0].mtp_model_layer
    assert isinstance(layer.self_attention, Glm5DSAttention) and not layer.self_attention.is_shared
    assert type(layer.mlp).__name__ == "MoELayer"
