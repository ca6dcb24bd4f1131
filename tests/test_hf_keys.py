"""The one HF <-> megatron key table: the inverse (compiled from the same rows) undoes the forward map for every
tensor of a model with MTP, vision, KDA, DSA, dense and MoE layers."""

import torch

from megatron_glm5.checkpoint.hf_keys import canonical_name, hf_to_mcore, is_non_persistent, mcore_to_hf
from megatron_glm5.config import tiny_hf_config


def test_inverse_undoes_forward_for_every_tensor(mcore):
    from megatron_glm5.models.builder import build_meta_model

    model = build_meta_model(tiny_hf_config(mtp=True), torch.bfloat16)
    n, mtp = model.config.num_layers, model.config.mtp_num_layers
    names = [canonical_name(k, model) for k in model.state_dict(keep_vars=True) if not is_non_persistent(k)]
    assert any(x.startswith("mtp.layers.0.mtp_model_layer.mlp.experts.") for x in names)
    seen = set()
    for name in names:
        hf = mcore_to_hf(name, n)
        for j, key in enumerate(hf):
            assert hf_to_mcore(key, n, mtp) == (name, j, len(hf)), (name, key)
            assert key not in seen, key
            seen.add(key)
    assert hf_to_mcore(f"model.language_model.layers.{n}.eh_proj.weight", n, 0) is None  # no MTP layer configured
