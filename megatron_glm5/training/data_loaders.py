"""The loaders of packed image+text rows (Megatron-LM's ``--dataloader-type external``).

A packed row holds several documents (``cu_seqlens``) and a variable number of image patches, which Megatron-LM's
default batching cannot stack: these loaders batch with :func:`~megatron_glm5.data.collate.collate` over
Megatron-LM's pretraining sampler (:mod:`megatron_glm5.data.sampler`), starting at the checkpoint's consumed
samples, so that a resumed run reads exactly the rows an uninterrupted one would.
"""

from __future__ import annotations

from megatron.core import parallel_state

from megatron_glm5.data.sampler import build_data_loader


def external_loaders(datasets, args):
    """(train, valid, test) iterators over ``datasets`` for this data-parallel rank (None where a split is None)."""
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    consumed = (args.consumed_train_samples, args.consumed_valid_samples, 0)
    out = []
    for ds, start in zip(datasets, consumed):
        if ds is None:
            out.append(None)
            continue
        out.append(iter(build_data_loader(ds, start, args.micro_batch_size, dp_rank, dp_size,
                                          num_workers=args.num_workers)))
    return tuple(out)
