"""megatron-core's MTP layer with the token shift of this package's contiguous context parallelism."""

from __future__ import annotations

from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer
from megatron.core.utils import make_viewless_tensor

from megatron_glm5.models.context_parallel import roll_left_in_documents

__all__ = ["Glm5MultiTokenPredictionLayer"]


class Glm5MultiTokenPredictionLayer(MultiTokenPredictionLayer):
    """``MultiTokenPredictionLayer`` whose input-token shift is :func:`roll_left_in_documents` (contiguous CP chunks,
    documents of a packed row) instead of megatron's ``roll_tensor`` (whose CP branch assumes zig-zag chunks).
    Everything else is megatron's."""

    def _get_embeddings(self, input_ids, position_ids, embedding, hidden_states, packed_seq_params=None,
                        padding_mask=None):
        """Shift ``input_ids`` / ``position_ids`` ``[b, s]`` left by one inside documents, embed the shifted ids.
        ``padding_mask`` marks rows of ``hidden_states`` (the positions this layer computes), so it is not shifted.
        Returns ``(input_ids, position_ids, padding_mask, decoder_input [s, b, h], hidden_states)`` like megatron."""
        input_ids = roll_left_in_documents(input_ids, packed_seq_params, self.cp_group)
        if position_ids is not None:
            position_ids = roll_left_in_documents(position_ids, packed_seq_params, self.cp_group)
        decoder_input = embedding(input_ids=input_ids, position_ids=position_ids)
        if self.config.mtp_detach_heads:
            decoder_input = decoder_input.detach()
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        if not hidden_states.requires_grad:
            hidden_states.requires_grad_(True)
        return input_ids, position_ids, padding_mask, decoder_input, hidden_states
