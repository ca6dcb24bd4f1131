"""Per-micro-batch checks and data accounting of ``pretrain_glm5_vlm.py``'s batches, and the one-line exit for bad
data: :func:`checked_rows` (token ids inside the vocabulary, image/video placeholder ids kept out of the loss of
text rows, the packed rows' skipped documents and text / image / video token counts), the totals
:data:`DATA_COUNTS` and their report, :func:`data_error_exit`.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

import torch
from megatron.training import get_args

from megatron_glm5.data import DataError
from megatron_glm5.data.vqa import placeholder_ids
from megatron_glm5.errors import one_line
from megatron_glm5.training.arguments import PROG


PACKING_EFFICIENCY: List[Optional[float]] = [None]
"""The share of real tokens in the packed image+text rows so far (None: no packed rows), written as the
``packing-efficiency`` scalar by :mod:`megatron_glm5.training.moe_load_logging`."""


def data_error_exit(e: Exception):
    """A bad data input (:class:`megatron_glm5.data.DataError`): one line on stderr (from rank 0 for what every rank
    finds, from the rank that read it otherwise), exit status 1."""
    if getattr(e, "rank_local", False) or int(os.environ.get("RANK", "0")) == 0:
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr, flush=True)
    raise SystemExit(1)


DATA_COUNTS = {"placeholder_tokens_masked": 0, "documents_skipped": 0, "train_documents_skipped": 0, "reported": 0,
               "text_tokens": 0, "image_tokens": 0, "video_tokens": 0, "row_tokens": 0}
"""Totals of this rank: text tokens that are image/video placeholder ids kept out of the loss, packed documents
skipped because their image or video could not be read (all micro batches, the console line;
``train_documents_skipped`` those of training micro batches), the text / image / video tokens of the packed
documents of the training micro batches (``--dataset-type chat``; ``packing-efficiency`` is their sum over
``row_tokens``, the rows' capacity trained on so far); ``reported``: the iteration of the last console report.
A training micro batch is one read with gradients enabled: Megatron-LM's ``evaluate`` runs under ``torch.no_grad``,
so validation and test batches are not counted."""

DATA_TAGS = {"data/text-tokens": "text_tokens", "data/image-tokens": "image_tokens",
             "data/video-tokens": "video_tokens", "data/documents-skipped": "train_documents_skipped"}
"""TensorBoard tag -> :data:`DATA_COUNTS` key: this rank's running totals over the training micro batches."""


def write_data_counts(writer, iteration: int) -> None:
    """The :data:`DATA_TAGS` at TensorBoard step ``iteration`` (called once per training step, after its micro
    batches), when packed rows carry counts."""
    if writer is not None and DATA_COUNTS["row_tokens"]:
        for tag, key in DATA_TAGS.items():
            writer.add_scalar(tag, DATA_COUNTS[key], iteration)


def report_data_counts(iteration: int, log_interval: int) -> None:
    """The totals as one line, on the first occurrence and then at most once per ``--log-interval`` iterations."""
    if DATA_COUNTS["reported"] and iteration - DATA_COUNTS["reported"] < max(log_interval, 1):
        return
    DATA_COUNTS["reported"] = iteration
    parts = []
    if DATA_COUNTS["placeholder_tokens_masked"]:
        parts.append(f"{DATA_COUNTS['placeholder_tokens_masked']} text token(s) that are image/video placeholder ids "
                     f"kept out of the loss")
    if DATA_COUNTS["documents_skipped"]:
        parts.append(f"{DATA_COUNTS['documents_skipped']} document(s) with an unreadable image or video skipped")
    print(f"data: up to iteration {iteration} on this rank: {'; '.join(parts)}", flush=True)


def checked_rows(batch: dict, config) -> dict:
    """A micro batch as the loader gave it, checked: token ids outside the model's vocabulary end the run (one line,
    exit 1: the data was tokenized for another model); in indexed text rows (no ``cu_seqlens``, not
    ``--mock-data``) positions whose token or label is an image/video placeholder id get ``loss_mask`` 0 and are
    counted (a text corpus holding literal ``<|image|>`` strings must not teach the model to emit or follow
    placeholders without images); packed rows report the documents they skipped (``skipped_documents``, an
    unreadable image), counted. The totals are printed when they grow (at most once per ``--log-interval``)."""
    args = get_args()
    iteration = args.curr_iteration + 1
    grew = False
    skipped = batch.pop("skipped_documents", None)
    if skipped is not None and int(skipped.sum()) > 0:
        DATA_COUNTS["documents_skipped"] += int(skipped.sum())
        grew = True
        if torch.is_grad_enabled():
            DATA_COUNTS["train_documents_skipped"] += int(skipped.sum())
    modality = batch.pop("modality_tokens", None)
    if modality is not None and torch.is_grad_enabled():
        for key, n in zip(("text_tokens", "image_tokens", "video_tokens"), modality.reshape(-1, 3).sum(0).tolist()):
            DATA_COUNTS[key] += int(n)
        DATA_COUNTS["row_tokens"] += int(batch["tokens"].numel())
        PACKING_EFFICIENCY[0] = sum(DATA_COUNTS[k] for k in ("text_tokens", "image_tokens", "video_tokens")) \
            / DATA_COUNTS["row_tokens"]
    vocab = int(config.vocab_size)
    for key in ("tokens", "labels"):
        bad = (batch[key] < 0) | (batch[key] >= vocab)
        if bool(bad.any()):
            e = DataError(f"--data-path: a micro batch of iteration {iteration} holds {key[:-1]} id "
                          f"{int(batch[key][bad][0])}, outside the model's vocabulary of {vocab}: the data was "
                          f"tokenized for another model (re-run tools/preprocess_data.py with its tokenizer)")
            e.rank_local = True
            data_error_exit(e)
    if "cu_seqlens" not in batch and not args.mock_data:
        special = torch.tensor(sorted(placeholder_ids(config)), dtype=batch["tokens"].dtype)
        hit = torch.isin(batch["tokens"], special) | torch.isin(batch["labels"], special)
        n = int((hit & (batch["loss_mask"] != 0)).sum())
        if n:
            batch["loss_mask"] = batch["loss_mask"].masked_fill(hit, 0.0)
            DATA_COUNTS["placeholder_tokens_masked"] += n
            grew = True
    if grew:
        report_data_counts(iteration, args.log_interval)
    return batch
