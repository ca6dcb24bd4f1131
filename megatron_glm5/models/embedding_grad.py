"""The word embedding's share of gradient-accumulation fusion (``config.gradient_accumulation_fusion``).

megatron-core fuses the weight-gradient accumulation of its linears only (:mod:`megatron_glm5.mcore_extensions`).
Its ``VocabParallelEmbedding`` backward writes a dense ``[V/tp, h]`` bf16 gradient (zeros, then the batch's rows
added in), which DDP's hook then adds to the fp32 ``main_grad``: three passes over the whole table per micro batch
for the few thousand rows a batch touches. :class:`EmbeddingIntoMainGrad` adds the batch's rows straight into
``main_grad`` in fp32 (``index_put_`` with ``accumulate``, deterministic on CUDA: sorted indices, each row summed in
order) and hands autograd a dummy gradient, as megatron-core's fused linears do (``grad_added_to_main_grad``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding


class EmbeddingIntoMainGrad(torch.autograd.Function):
    """``out [*ids.shape, h] = weight[ids]``; backward: ``weight.main_grad[ids] += d_out`` (fp32), no dense
    gradient."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        main_grad = weight.main_grad
        main_grad.index_put_((ids.reshape(-1),), grad_out.reshape(-1, grad_out.shape[-1]).to(main_grad.dtype),
                             accumulate=True)
        weight.grad_added_to_main_grad = True
        # autograd still calls the weight's AccumulateGrad (DDP's hook runs there): an unwritten tensor, never read
        return None, torch.empty_like(weight)


class FusedGradVocabEmbedding(VocabParallelEmbedding):
    """megatron-core's ``VocabParallelEmbedding`` (same parameters, state dicts and forward) whose weight gradient
    goes through :class:`EmbeddingIntoMainGrad` where that applies: one tensor-parallel rank holding the whole
    table, a weight with DDP's ``main_grad``, autograd on. ``ids [b, s]`` -> ``[b, s, h]``."""

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (hasattr(weight, "main_grad") and hasattr(weight, "grad_added_to_main_grad") and torch.is_grad_enabled()
                and weight.requires_grad and self.tp_group.size() == 1 and not self.reduce_scatter_embeddings
                and getattr(self, "gtp_remat_size", 1) == 1):
            return EmbeddingIntoMainGrad.apply(input_, weight)
        return super().forward(input_)


def fuse_embedding_grad(embedding: VocabParallelEmbedding) -> None:
    """Make ``embedding`` (built by megatron-core's ``LanguageModelEmbedding``) a :class:`FusedGradVocabEmbedding`
    in place: nothing it holds changes."""
    embedding.__class__ = FusedGradVocabEmbedding
