"""``padding_mask``: tokens appended as padding (a CP split pads its row) leave the MoE routers' expert loads (the
expert-bias update) and aux loss untouched, in the decoder and in the MTP layer; the real tokens' loss is unchanged."""

import torch


def _model():
    from megatron_glm5.config import Glm5Config, tiny_hf_config
    from megatron_glm5.models.builder import build_model

    cfg = Glm5Config.from_hf(tiny_hf_config(num_layers=3, mtp=True, with_vision=False), use_cpu_initialization=True,
                             moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)
    model = build_model(cfg)
    model.train()
    return model


def _run(model, ids, docs, padding_mask=None):
    from megatron_glm5.data.synthetic import cu_seqlens_of
    from megatron_glm5.models.packing import make_packed_seq_params

    for r in model.moe_routers().values():
        r.local_tokens_per_expert.zero_()
    labels = torch.roll(ids, -1, 1)
    loss = model(ids, labels=labels, packed_seq_params=make_packed_seq_params(cu_seqlens_of(docs)),
                 padding_mask=padding_mask)
    loads = {k: r.local_tokens_per_expert.clone() for k, r in model.moe_routers().items()}
    return loss, loads


def test_padding_tokens_leave_the_expert_loads(mcore):
    model = _model()
    g = torch.Generator().manual_seed(0)
    real = torch.randint(1, 240, (1, 20), generator=g)
    pad = torch.zeros(1, 6, dtype=torch.long)
    loss0, loads0 = _run(model, real, (9, 11))
    padded = torch.cat([real, pad], 1)
    mask = torch.zeros(1, 26, dtype=torch.bool)
    mask[:, 20:] = True
    loss1, loads1 = _run(model, padded, (9, 11, 6), padding_mask=mask)
    _, loads2 = _run(model, padded, (9, 11, 6))
    assert len(loads0) == 3  # two MoE decoder layers and the MTP layer
    for k in loads0:
        assert torch.equal(loads0[k], loads1[k]), k
        assert loads2[k].sum() > loads0[k].sum()  # without the mask the padding is counted
    torch.testing.assert_close(loss1[:, :19], loss0[:, :19], rtol=1e-6, atol=1e-6)
