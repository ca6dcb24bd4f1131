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
    """(train, valid, test) iterators over ``datasets`` for this data-parallel rank (None where a split is None).

    An Energon source comes as its iterator already (:class:`megatron_glm5.data.energon.EnergonIterator`): its state
    is written into each checkpoint folder (:func:`_save_state_with_checkpoints`) and, when the run resumes
    (consumed samples > 0), restored from the checkpoint it loaded."""
    from megatron_glm5.data.energon import EnergonIterator, load_state, state_path

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    consumed = (args.consumed_train_samples, args.consumed_valid_samples, 0)
    out = []
    for ds, start in zip(datasets, consumed):
        if ds is None:
            out.append(None)
            continue
        if isinstance(ds, EnergonIterator):
            if start > 0 and args.load:
                ds.restore(load_state(state_path(args.load, args.iteration, dp_rank)))
            if args.save:
                _save_state_with_checkpoints(ds, args, dp_rank)
            out.append(ds)
            continue
        out.append(iter(build_data_loader(ds, start, args.micro_batch_size, dp_rank, dp_size,
                                          num_workers=args.num_workers)))
    return tuple(out)


def _save_state_with_checkpoints(loader, args, dp_rank: int) -> None:
    """Megatron-LM's ``save_checkpoint`` (the loader part of :func:`megatron_glm5.training.save_guard._save_checkpoint`),
    writing first this data-parallel rank's loader state into the checkpoint
    folder (``iter_NNNNNNN/train_dataloader_dprankRRR.pt``, Megatron-LM's file name; rank 0 of its tensor- and
    pipeline-parallel group writes it). The folder's ``integrity.json`` then covers it. Megatron-LM's own
    ``--dataloader-save`` puts it in an ``mp_rank_00/`` subfolder, which no checkpoint folder of this model holds."""
    from megatron_glm5.mcore_version import TRAINER_VERSIONS, require_version

    require_version(TRAINER_VERSIONS, "the Energon loader state in checkpoints (training/data_loaders.py)")
    import os

    import torch

    from megatron_glm5.data.energon import state_path
    from megatron_glm5.training.save_guard import install_save_checkpoint

    def with_loader_state(save):
        def save_checkpoint(iteration, *a, **kw):
            if not kw.get("non_persistent_ckpt") and parallel_state.get_tensor_model_parallel_rank() == 0 \
                    and parallel_state.is_pipeline_first_stage(ignore_virtual=True):
                path = state_path(args.save, iteration, dp_rank)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save({"dataloader_state_dict": loader.save_state()}, path + ".tmp")
                os.replace(path + ".tmp", path)
            return save(iteration, *a, **kw)

        return save_checkpoint

    install_save_checkpoint("loader", with_loader_state)  # the loader part of the one save_checkpoint wrapper
