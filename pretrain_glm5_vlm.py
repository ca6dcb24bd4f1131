#!/usr/bin/env python
"""Pretrain or fine-tune GLM-5.3-Flash (text and image+text) on megatron-core — Megatron-LM's ``pretrain_gpt.py``
for this model: the model provider, the batch, the loss and the forward step; everything else lives in
``megatron_glm5.training``.

    torchrun --nproc-per-node 8 pretrain_glm5_vlm.py --hf-config DIR --tensor-model-parallel-size 2 ... (GPUs, NCCL)
    python pretrain_glm5_vlm.py --model-preset glm5-tiny --mock-data ...                               (CPU, gloo)

``python pretrain_glm5_vlm.py --help`` lists the flags (Megatron-LM's names); see examples/ for launchers.
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from megatron_glm5.training import global_vars
from megatron_glm5.training.loop import pretrain


def model_provider(config, pre_process: bool = True, post_process: bool = True, vp_stage=None):
    """The GLM-5.3 model of one (virtual) pipeline stage."""
    from megatron_glm5.models.builder import build_model

    return build_model(config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


def train_valid_test_datasets_provider(args, config):
    """Mock, indexed-text or packed image+text datasets, per --mock-data / --data-path / --dataset-type."""
    from megatron_glm5.data.builder import build_train_valid_test_datasets
    from megatron_glm5.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(args.tokenizer_model) if args.tokenizer_model else None
    return build_train_valid_test_datasets(args, config, tokenizer)


def get_batch(data_iterator, config) -> dict:
    """The next micro batch on this rank's device: tokens / labels [b, s], loss_mask [b, s]; a packed row (b = 1)
    also has cu_seqlens [n_docs + 1] and, with images, pixel_values [patches, C*T*P*P] and image_grid_thw [k, 3].

    Under context parallelism the packed row is cut into this rank's contiguous chunk (padded to a multiple of
    CP x TP with sequence parallelism) and ``packed_seq_params`` says where the chunk sits in the row."""
    from megatron.core import parallel_state

    from megatron_glm5.data.context_parallel import split_batch_for_cp
    from megatron_glm5.models.packing import make_packed_seq_params

    batch = next(data_iterator)
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
    batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
    if psp is not None and device == "cuda":
        psp.cu_seqlens_q = psp.cu_seqlens_q.to(device)
        psp.cu_seqlens_kv = psp.cu_seqlens_kv.to(device)
    batch["packed_seq_params"] = psp
    return batch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token LM loss [b, s] -> megatron-core's loss contract, with {'lm loss': [sum, count]} for reporting.

    One CP rank (the usual case) or ``--calculate-per-token-loss``: (sum over loss tokens, their count, report);
    the schedule (or, per token, the gradient reduction) divides by the count. Under context parallelism without
    per-token loss: (this rank's share of the row's token mean, report), so that the gradient equals one rank's."""
    from megatron.core import parallel_state

    from megatron_glm5.models.context_parallel import cp_token_mean

    args = global_vars.get_args()
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    nan = global_vars.get_iteration() in args.inject_nan_at_iteration
    if nan:
        loss = loss * float("nan")
    report = {"lm loss": torch.stack([loss.detach().clone(), num_tokens.detach().float()])}
    cp_group = parallel_state.get_context_parallel_group()
    if parallel_state.get_context_parallel_world_size() > 1 and not args.calculate_per_token_loss:
        share = cp_token_mean(losses, mask, cp_group)
        return (share * float("nan") if nan else share), report
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    """megatron-core's forward-step contract: (output tensor, loss function of it)."""
    batch = get_batch(data_iterator, global_vars.get_config())
    output = model(batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"],
                   packed_seq_params=batch["packed_seq_params"], pixel_values=batch.get("pixel_values"),
                   image_grid_thw=batch.get("image_grid_thw"), padding_mask=batch.get("padding_mask"))
    return output, partial(loss_func, batch["loss_mask"])


def main(argv=None) -> int:
    return pretrain(train_valid_test_datasets_provider, model_provider, forward_step, argv=argv,
                    prog="pretrain_glm5_vlm.py")


if __name__ == "__main__":
    sys.exit(main())
