#!/usr/bin/env python
"""Pretrain or fine-tune GLM-5.3-Flash (text, image+text, video+text) with Megatron-LM's trainer — ``pretrain_gpt.py``
for this model: the model provider, the datasets provider, the batch, the loss and the forward step, handed to
``megatron.training.pretrain``. Megatron-LM's flags, with the GLM flags of
:func:`megatron_glm5.training.arguments.add_glm5_arguments` (``--hf-config``, ``--model-preset``,
``--dataset-type``, ``--freeze-vision``, the kernel backends).

    torchrun --nproc-per-node 8 pretrain_glm5_vlm.py --hf-config DIR --tensor-model-parallel-size 2 ... (GPUs, NCCL)
    python pretrain_glm5_vlm.py --model-preset glm5-tiny --mock-data ...                               (CPU, gloo)

``python pretrain_glm5_vlm.py --help`` lists the flags; see examples/ for launchers.
"""

from __future__ import annotations

import time

_PROGRAM_START = time.time()  # --exit-duration-in-mins counts from here (Megatron-LM's startup timestamps)

import sys  # noqa: E402
from functools import partial  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:
    import torch
# torch and megatron are imported inside the functions: a Ctrl-C while they load ends in the entry's one line


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage=None, config=None,
                   pg_collection=None):
    """The GLM-5.3 model of one (virtual) pipeline stage, its config from the flags."""
    import torch
    from megatron.training import get_args
    from megatron.training.utils import print_rank_0

    from megatron_glm5.execution_plan import resolve_execution_plan
    from megatron_glm5.models.builder import build_model
    from megatron_glm5.training.arguments import model_config_from_args
    from megatron_glm5.training.flops import register_model_chunk
    from megatron_glm5.training.moe_load_logging import finalize_grads_and_log_expert_loads

    args = get_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = model_config_from_args(args, device)
    config.check_fits_memory(device)  # one line naming the config key, before any weight is allocated
    config.finalize_model_grads_func = finalize_grads_and_log_expert_loads  # Megatron-LM keeps a func already set
    config.execution_plan = resolve_execution_plan(config, device, pg_collection)
    if not vp_stage:  # the start-up table of what runs, each fallback with its reason (once, on rank 0)
        print_rank_0(config.execution_plan.table())
    model = build_model(config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
    register_model_chunk(model)  # --log-throughput counts its weights
    if args.freeze_vision and getattr(model, "vision_model", None) is not None:
        model.vision_model.requires_grad_(False)
    return model


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Mock, indexed-text or packed image+text data, per --mock-data / --data-path / --dataset-type.

    Text rows (mock or indexed) are map-style datasets read through Megatron-LM's sampler; packed image+text rows
    (one row of several documents, ``cu_seqlens``, images) are this project's loaders (``--dataloader-type
    external``), started at the checkpoint's consumed samples. Bad data (a corrupt ``.bin`` / ``.idx`` or index
    cache, a bad record, image or tar) ends the run before training with one line naming the file."""
    from megatron_glm5.data import DataError
    from megatron_glm5.training.data_accounting import data_error_exit

    try:
        return _datasets(train_val_test_num_samples)
    except DataError as e:
        data_error_exit(e)


def _datasets(train_val_test_num_samples):
    from megatron.training import get_args

    from megatron_glm5.data.builder import build_train_valid_test_datasets
    from megatron_glm5.data.tokenizer import build_tokenizer
    from megatron_glm5.training.arguments import model_config_from_args
    from megatron_glm5.training.data_loaders import external_loaders
    from megatron_glm5.training.data_accounting import PACKING_EFFICIENCY

    args = get_args()
    tokenizer = build_tokenizer(args.tokenizer_model) if args.tokenizer_model else None
    config = model_config_from_args(args, "cpu")
    datasets = build_train_valid_test_datasets(args, config, tokenizer, sizes=tuple(train_val_test_num_samples))
    PACKING_EFFICIENCY[0] = getattr(datasets[0], "packing_efficiency", None)
    if args.dataloader_type == "external":
        return external_loaders(datasets, args)
    return datasets


train_valid_test_datasets_provider.is_distributed = True  # every rank reads its own micro batches


def get_batch(data_iterator, config) -> dict:
    """The next micro batch on this rank's device: tokens / labels [b, s], loss_mask [b, s]; a packed row (b = 1)
    also has cu_seqlens [n_docs + 1] and, with images, pixel_values [patches, C*T*P*P] and image_grid_thw [k, 3],
    with videos pixel_values_videos [patches, C*T*P*P] and video_grid_thw [v, 3] (transformers' names).

    Under context parallelism the packed row is cut into this rank's contiguous chunk (padded to a multiple of
    CP x TP with sequence parallelism) and ``packed_seq_params`` says where the chunk sits in the row."""
    import torch
    from megatron.core import parallel_state

    from megatron_glm5.data.context_parallel import split_batch_for_cp
    from megatron_glm5.models.packing import make_packed_seq_params, packed_seq_params_to, to_device_async

    from megatron.training import get_args

    from megatron_glm5.training.data_accounting import checked_rows
    from megatron_glm5.training.flops import record_images

    batch = checked_rows(next(data_iterator), config)
    record_images(get_args().curr_iteration, batch.get("image_grid_thw"), batch.get("video_grid_thw"))
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1:
        if "cu_seqlens" not in batch:  # plain rows: one document each, laid end to end as one packed row
            b, s = batch["tokens"].shape
            batch = {k: v.reshape(1, -1) if torch.is_tensor(v) and v.shape[:2] == (b, s) else v
                     for k, v in batch.items()}
            batch["cu_seqlens"] = torch.arange(0, b * s + 1, s, dtype=torch.int32)
        tp_multiple = parallel_state.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1
        row_length = batch["tokens"].shape[1]
        batch, psp = split_batch_for_cp(batch, cp, parallel_state.get_context_parallel_rank(), config,
                                        chunk_multiple=tp_multiple, pad_token_id=config.pad_token_id)
        # the split's padding (after the row) stays out of the MoE expert loads and aux losses
        batch["padding_mask"] = (psp.chunk_offset + torch.arange(batch["tokens"].shape[1]) >= row_length)[None]
    else:
        psp = make_packed_seq_params(batch["cu_seqlens"]) if "cu_seqlens" in batch else None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # through pinned memory: a copy from pageable memory would wait for the GPU's queued work each micro batch
    batch = {k: to_device_async(v, device) if torch.is_tensor(v) else v for k, v in batch.items()}
    batch["packed_seq_params"] = packed_seq_params_to(psp, device, batch["tokens"].shape[1])
    return batch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token LM loss [b, s] -> megatron-core's loss contract, with {'lm loss': [sum, count]} for reporting.

    One CP rank (the usual case) or ``--calculate-per-token-loss``: (sum over loss tokens, their count, report);
    the schedule (or, per token, the gradient reduction) divides by the count. Under context parallelism without
    per-token loss: (this rank's share of the row's token mean, report), so that the gradient equals one rank's.
    With ``--check-for-nan-in-loss-and-grad`` a NaN/inf loss goes to Megatron-LM's rerun state machine.
    ``--inject-nan-at-iteration`` (a testing aid) makes the loss NaN; in the indexer warm-up, whose LM loss reaches
    no trained parameter, it also makes the indexer loss's backward scale NaN (megatron-core's
    ``DSAIndexerLossAutoScaler``, set as the backward passes this loss, before it reaches any DSA layer), so that
    the step's gradients are NaN as the LM loss's would be in any other run."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    from megatron_glm5.models.context_parallel import cp_token_mean

    args = get_args()
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    nan = args.curr_iteration + 1 in args.inject_nan_at_iteration

    def injected(value: torch.Tensor) -> torch.Tensor:  # the loss the backward starts from, at a NaN iteration
        if getattr(args, "dsa_indexer_warmup_stage", False) and value.requires_grad:
            value.register_hook(nan_indexer_loss_scale)
        return value

    def nan_indexer_loss_scale(grad: torch.Tensor) -> torch.Tensor:
        from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

        scale = DSAIndexerLossAutoScaler.main_loss_backward_scale
        DSAIndexerLossAutoScaler.set_loss_scale(grad.new_full((), float("nan")) if scale is None
                                                else scale * float("nan"))
        return grad

    if nan:
        loss = loss * float("nan")
    if args.check_for_nan_in_loss_and_grad:
        machine = get_rerun_state_machine()
        machine.validate_result(result=loss, rejection_func=torch.isnan, message="found NaN in local forward loss "
                                "calculation", tolerance=0.0, fatal=True)
        machine.validate_result(result=loss, rejection_func=torch.isinf, message="found Inf in local forward loss "
                                "calculation", tolerance=0.0, fatal=True)
    report = {"lm loss": torch.stack([loss.detach().clone(), num_tokens.detach().float()])}
    if parallel_state.get_context_parallel_world_size() > 1 and not args.calculate_per_token_loss:
        share = cp_token_mean(losses, mask, parallel_state.get_context_parallel_group())
        return (injected(share * float("nan")) if nan else share), report
    return (injected(loss) if nan else loss), num_tokens, report


def forward_step(data_iterator, model):
    """megatron-core's forward-step contract: (output tensor, loss function of it)."""
    from megatron.core.utils import get_model_config
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    batch = get_batch(data_iterator, get_model_config(model))
    timers("batch-generator").stop()
    output = model(batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"],
                   packed_seq_params=batch["packed_seq_params"], pixel_values=batch.get("pixel_values"),
                   image_grid_thw=batch.get("image_grid_thw"), padding_mask=batch.get("padding_mask"),
                   pixel_values_videos=batch.get("pixel_values_videos"), video_grid_thw=batch.get("video_grid_thw"))
    return output, partial(loss_func, batch["loss_mask"])


def main(argv=None) -> int:
    from megatron_glm5.training.entry import run_pretrain

    return run_pretrain(train_valid_test_datasets_provider, model_provider, forward_step, argv=argv,
                        prog="pretrain_glm5_vlm.py", program_start=_PROGRAM_START)


if __name__ == "__main__":
    sys.exit(main())
