"""The word embedding's share of gradient-accumulation fusion (``config.gradient_accumulation_fusion``).

megatron-core fuses the weight-gradient accumulation of its linears only (:mod:`megatron_glm5.mcore_extensions`).
Its ``VocabParallelEmbedding`` backward writes a dense ``[V/tp, h]`` bf16 gradient (zeros, then the batch's rows
added in), which DDP's hook then adds to the fp32 ``main_grad``: three passes over the whole table per micro batch
for the few thousand rows a batch touches. :class:`EmbeddingIntoMainGrad` adds the batch's rows straight into
``main_grad`` in fp32 (``index_put_`` with ``accumulate``, deterministic on CUDA: sorted indices, each row summed in
order) and hands autograd a dummy gradient, as megatron-core's fused linears do (``grad_added_to_main_grad``).

A weight that two layers of one pipeline stage share (the MTP block's embedding, a tied output layer) carries
megatron-core's ``zero_out_wgrad``: DDP's hook then adds the weight's summed ``.grad`` to ``main_grad`` after all,
so the fused uses hand zeros (a use without the fusion is counted once). :func:`clear_zero_out_wgrad` drops the
flag where every use of the weight adds into ``main_grad`` itself, which saves that dense zero table and its add.
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
        # autograd still calls the weight's AccumulateGrad, where DDP's hook runs: the hook adds .grad to main_grad
        # under zero_out_wgrad (zeros then), otherwise it never reads it (an unwritten tensor)
        if getattr(weight, "zero_out_wgrad", False):
            return None, torch.zeros_like(weight)
        return None, torch.empty_like(weight)


class FusedGradVocabEmbedding(VocabParallelEmbedding):
    """megatron-core's ``VocabParallelEmbedding`` (same parameters, state dicts and forward) whose weight gradient
    goes through :class:`EmbeddingIntoMainGrad` where that applies: one tensor-parallel rank holding the whole
    table, a weight with DDP's ``main_grad``, autograd on. ``ids [b, s]`` -> ``[b, s, h]``."""

    def takes_the_fusion(self) -> bool:
        """The conditions fixed at build: one tensor-parallel rank, no reduce-scattered embeddings, no GTP."""
        return (self.tp_group.size() == 1 and not self.reduce_scatter_embeddings
                and getattr(self, "gtp_remat_size", 1) == 1)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (hasattr(weight, "main_grad") and hasattr(weight, "grad_added_to_main_grad") and torch.is_grad_enabled()
                and weight.requires_grad and self.takes_the_fusion()):
            return EmbeddingIntoMainGrad.apply(input_, weight)
        return super().forward(input_)


def fuse_embedding_grad(embedding: VocabParallelEmbedding) -> None:
    """Make ``embedding`` (built by megatron-core's ``LanguageModelEmbedding``) a :class:`FusedGradVocabEmbedding`
    in place: nothing it holds changes."""
    embedding.__class__ = FusedGradVocabEmbedding


def clear_zero_out_wgrad(embedding: VocabParallelEmbedding, output_layer=None) -> bool:
    """Drop megatron-core's ``zero_out_wgrad`` from ``embedding``'s weight (set by ``LanguageModule`` where the MTP
    block or a tied ``output_layer`` on the same stage shares it) when every use adds its gradient into ``main_grad``
    itself: the embedding takes the fusion (:class:`FusedGradVocabEmbedding`) and a tied output layer has
    gradient-accumulation fusion on. Then DDP's hook never needs the summed ``.grad`` and the flag would only cost a
    dense zero table and its add per micro batch. Returns whether it was cleared."""
    weight = embedding.weight
    if not getattr(weight, "zero_out_wgrad", False):
        return False
    if not (isinstance(embedding, FusedGradVocabEmbedding) and embedding.takes_the_fusion()):
        return False
    if output_layer is not None and output_layer.weight is None and not output_layer.gradient_accumulation_fusion:
        return False
    weight.zero_out_wgrad = False
    return True
