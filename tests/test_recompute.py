"""Activation recompute (megatron's full uniform / block and selective settings) leaves the loss and every gradient
unchanged (fp32, one process)."""

import pytest
import torch


def _model(**kw):
    from megatron_glm5.config import Glm5Config, tiny_hf_config
    from megatron_glm5.models.builder import build_model

    torch.manual_seed(0)
    cfg = Glm5Config.from_hf(tiny_hf_config(num_layers=5, mtp=True), use_cpu_initialization=True, **kw)
    model = build_model(cfg)
    model.train()
    return model


def _loss_and_grads(model, batch):
    from megatron_glm5.models.packing import make_packed_seq_params

    model.zero_grad()
    loss = model(batch["input_ids"], labels=batch["labels"], loss_mask=batch["loss_mask"],
                 packed_seq_params=make_packed_seq_params(batch["cu_seqlens"]), pixel_values=batch["pixel_values"],
                 image_grid_thw=batch["image_grid_thw"])
    loss = (loss * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kw", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
    dict(recompute_granularity="selective", recompute_modules=["core_attn", "layernorm", "mlp", "moe"]),
], ids=["full_uniform", "full_block", "selective"])
def test_recompute_gives_the_same_gradients(kw, mcore):
    import sys
    import os

    sys.path.insert(0, os.path.dirname(__file__))
    from megatron_glm5.config import tiny_hf_config
    from parallel_harness import make_batches

    batch = make_batches(tiny_hf_config(num_layers=5, mtp=True), 1)[0]
    ref = _model()
    got = _model(**kw)
    got.load_state_dict(ref.state_dict())
    calls = []
    watched = got.decoder.layers[0].self_attention  # runs twice when it is recomputed
    watched.register_forward_hook(lambda *a: calls.append(1))
    l0, g0 = _loss_and_grads(ref, batch)
    l1, g1 = _loss_and_grads(got, batch)
    block_skips_layer0 = kw.get("recompute_method") == "block" and kw["recompute_num_layers"] < 1
    assert len(calls) == (1 if block_skips_layer0 else 2), len(calls)
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys() and len(g0) > 100
    worst = max(float((g0[k] - g1[k]).abs().max() / g0[k].abs().max().clamp(min=1e-30)) for k in g0)
    print(f"\n[recompute {kw}] loss {l0.item():.6f}, max rel grad diff {worst:.1e}")
    assert worst <= 1e-6


def test_full_uniform_recompute_with_mtp_needs_one_layer_groups():
    from megatron_glm5.config import Glm5Config, Glm5ConfigError, tiny_hf_config

    with pytest.raises(Glm5ConfigError, match="recompute_num_layers: must be 1"):
        Glm5Config.from_hf(tiny_hf_config(mtp=True), recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=2)
    with pytest.raises(Glm5ConfigError, match="recompute_modules"):
        Glm5Config.from_hf(tiny_hf_config(), recompute_granularity="selective", recompute_modules=["mla_up_proj"])


def test_full_recompute_of_a_shared_indexer_layer_with_two_micro_batches_in_flight(mcore):
    """megatron's full recompute (``TransformerBlock``'s ``checkpointed_forward``) of a group that starts at a
    'shared' DSA layer, with two micro batches forwarded before either backward (a pipeline schedule's warm-up):
    each recompute reuses the top-k of its own micro batch (it rides in the group's saved inputs), so the gradients
    equal those of plain micro batches run one after the other."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from megatron_glm5.config import Glm5Config, tiny_hf_config
    from megatron_glm5.models.builder import build_model
    from megatron_glm5.models.packing import make_packed_seq_params
    from parallel_harness import make_batches

    hf = tiny_hf_config(num_layers=5)
    hf["text_config"]["indexer_types"] = ["full", "full", "full", "shared", "full"]  # DSA 3 reuses DSA 1's top-k
    batches = make_batches(hf, 2)

    def model(**kw):
        torch.manual_seed(0)
        m = build_model(Glm5Config.from_hf(hf, use_cpu_initialization=True, **kw))
        m.train()
        return m

    def loss(m, batch):
        out = m(batch["input_ids"], labels=batch["labels"], loss_mask=batch["loss_mask"],
                packed_seq_params=make_packed_seq_params(batch["cu_seqlens"]),
                pixel_values=batch.get("pixel_values"), image_grid_thw=batch.get("image_grid_thw"))
        return (out * batch["loss_mask"]).sum() / batch["loss_mask"].sum()

    ref = model()
    got = model(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    got.load_state_dict(ref.state_dict())
    shared = got.decoder.layers[3].self_attention
    assert shared.is_shared and shared.indexer is None
    topks = []
    shared.register_forward_hook(lambda mod, args, kwargs, out: topks.append(out[1]), with_kwargs=True)

    for batch in batches:  # one micro batch after the other
        loss(ref, batch).backward()
    first, second = loss(got, batches[0]), loss(got, batches[1])  # both forwards, then both backwards
    first.backward()
    second.backward()

    assert len(topks) == 4  # two forwards, two recomputes (first micro batch's first)
    assert torch.equal(topks[0], topks[2]) and torch.equal(topks[1], topks[3])
    assert not torch.equal(topks[0], topks[1])  # the two micro batches select differently
    g0 = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    g1 = {n: p.grad for n, p in got.named_parameters() if p.grad is not None}
    assert g0.keys() == g1.keys() and len(g0) > 100
    worst = max(float((g0[k] - g1[k]).abs().max() / g0[k].abs().max().clamp(min=1e-30)) for k in g0)
    assert worst <= 1e-6, worst


def test_full_recompute_is_megatron_cores_transformer_block(mcore, monkeypatch):
    """The decoder is megatron-core's ``TransformerBlock`` over ``TransformerLayer`` s: full recompute runs its
    ``checkpointed_forward`` (once per forward), the layers carry global layer numbers."""
    import megatron.core.transformer.transformer_block as tb
    from megatron.core.transformer.transformer_layer import TransformerLayer

    calls = []
    real = tb.checkpointed_forward
    monkeypatch.setattr(tb, "checkpointed_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = _model(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    assert isinstance(model.decoder, tb.TransformerBlock)
    assert all(isinstance(layer, TransformerLayer) for layer in model.decoder.layers)
    assert [layer.layer_number for layer in model.decoder.layers] == [1, 2, 3, 4, 5]
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    model(ids, labels=ids).sum().backward()
    assert len(calls) == 1
    model.eval()
    with torch.no_grad():
        model(ids)
    assert len(calls) == 1  # not in eval
