"""megatron-core's MTP layer with the token shift of this package's contiguous context parallelism, and a full
recompute that takes packed rows."""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer
from megatron.core.utils import make_viewless_tensor

from megatron_glm5.models.context_parallel import roll_left_in_documents

__all__ = ["Glm5MultiTokenPredictionLayer"]


class Glm5MultiTokenPredictionLayer(MultiTokenPredictionLayer):
    """``MultiTokenPredictionLayer`` whose input-token shift is :func:`roll_left_in_documents` (contiguous CP chunks,
    documents of a packed row) instead of megatron's ``roll_tensor`` (whose CP branch assumes zig-zag chunks), and
    whose full recompute takes packed rows (megatron-core 0.16.1 hands every keyword argument of the checkpointed
    function to ``tensor_parallel.checkpoint`` positionally and autograd cannot save a ``PackedSeqParams``: here only
    the tensors go through the checkpoint, the rest is bound in a closure). Everything else is megatron's."""

    def _get_embeddings(self, input_ids, position_ids, embedding, hidden_states, packed_seq_params=None):
        """Shift ``input_ids`` / ``position_ids`` ``[b, s]`` left by one inside documents, embed the shifted ids.
        Returns ``(input_ids, position_ids, decoder_input [s, b, h], hidden_states)`` like megatron."""
        input_ids = roll_left_in_documents(input_ids, packed_seq_params, self.cp_group)
        if position_ids is not None:
            position_ids = roll_left_in_documents(position_ids, packed_seq_params, self.cp_group)
        decoder_input = embedding(input_ids=input_ids, position_ids=position_ids)
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        return input_ids, position_ids, decoder_input, hidden_states

    def _checkpointed_forward(self, forward_func, *args, **kwargs):
        if self.config.recompute_method != "uniform":
            return super()._checkpointed_forward(forward_func, *args, **kwargs)
        names = [k for k, v in kwargs.items() if torch.is_tensor(v)]
        others = {k: v for k, v in kwargs.items() if not torch.is_tensor(v)}

        def run(*values):
            return forward_func(*args, **dict(zip(names, values)), **others)

        return tensor_parallel.checkpoint(run, self.config.distribute_saved_activations,
                                          *(kwargs[k] for k in names))
