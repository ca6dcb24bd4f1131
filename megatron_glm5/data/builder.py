"""Build the train / valid / test datasets from Megatron-LM-style arguments.

Three sources, chosen by ``args``:

- ``--mock-data``: megatron-core's ``MockGPTDataset`` (documents ``1, 2, ..., n-1, <eod>`` of pseudo-random
  lengths, tokens modulo the vocabulary), sized for the run. Without a tokenizer the EOD id is 0.
- ``--data-path`` with ``--dataset-type gpt`` (default): indexed text (``PREFIX.bin/.idx`` written by
  ``tools/preprocess_data.py``), optionally weighted (``--data-path 0.3 A 0.7 B``), split by ``--split`` through
  megatron-core's ``GPTDataset`` + ``BlendedMegatronDatasetBuilder``. Rows are ``seq_length`` tokens cut across
  document boundaries (Megatron-LM pretraining), no ``cu_seqlens``.
- ``--data-path`` with ``--dataset-type vqa``: packed image+text SFT rows (``data/vqa.py``) from JSONL files,
  WebDataset tars or directories of them, split by ``--split`` over the records.
- ``--data-path`` with ``--dataset-type chat``: packed conversations with images and videos rendered by the
  checkpoint's chat template (``data/conversations.py``: messages JSONL, the VQA sources mapped to messages), split
  by ``--split`` over the conversations; ``--chat-template``, ``--loss-on-all-turns``, ``--loss-on-last-turn-only``.

Sample counts follow Megatron-LM: train ``train_iters * global_batch_size`` (or ``train_samples``), valid
``(train_iters // eval_interval + 1) * eval_iters * global_batch_size``, test ``eval_iters * global_batch_size``.
A split that gets no documents (e.g. the ``1`` of ``949,50,1`` on a small corpus) or no samples is ``None``; a run
that asks for validation samples (``--eval-iters`` > 0) and gets no validation split is refused.
Bad input raises :class:`~megatron_glm5.data.DataError` (one line naming the flag or file) before anything is built:
every ``.bin`` / ``.idx`` pair is checked first (:func:`megatron_glm5.data.indexed.check_indexed_dataset`); the
index caches are megatron-core's, read without pickle and checked (:mod:`megatron_glm5.data.index_cache`).
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from typing import Tuple

import numpy as np

from megatron_glm5.data import DataError

DATASET_TYPES = ("gpt", "vqa", "chat")
_SPLIT_NAMES = ("train", "valid", "test")


def _print_rank0(msg: str) -> None:
    import torch

    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(msg, flush=True)


def train_valid_test_num_samples(args) -> Tuple[int, int, int]:
    """Samples each split must provide (Megatron-LM's ``get_train_valid_test_num_samples``)."""
    train = getattr(args, "train_samples", None) or args.train_iters * args.global_batch_size
    eval_iters = int(getattr(args, "eval_iters", 0) or 0)
    eval_interval = int(getattr(args, "eval_interval", 0) or 0)
    evals = (args.train_iters // eval_interval + 1) if eval_interval > 0 else 1
    return int(train), evals * eval_iters * args.global_batch_size, eval_iters * args.global_batch_size


def _split_matrix(split: str):
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    try:
        with np.errstate(invalid="ignore", divide="ignore"):
            vec = parse_and_normalize_split(split)
    except (AssertionError, ValueError, ZeroDivisionError):
        vec = None
    if vec is None or not np.isfinite(vec).all():
        raise DataError(f"--split {split!r}: expected up to three non-negative weights, e.g. 949,50,1")
    return convert_split_vector_to_split_matrix(vec)


def _split_range(bookend, n: int) -> Tuple[int, int]:
    """Megatron's document range of one split (``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits``)."""
    return int(round(bookend[0] * float(n))), int(round(bookend[1] * float(n)))


class _MockTokenizer:
    """What MockGPTDataset needs of a tokenizer when the run has none: the model's vocabulary, EOD 0."""

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)
        self.eod = 0
        self.pad = 0

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict([("class", "mock"), ("vocab_size", self.vocab_size), ("eod", self.eod)])


def _check_tokenizer(tokenizer, model_config) -> None:
    if tokenizer is None:
        raise DataError("--tokenizer-model is required with --data-path")
    if tokenizer.vocab_size > model_config.vocab_size:
        raise DataError(f"--tokenizer-model: the tokenizer has {tokenizer.vocab_size} ids, more than the model's "
                        f"vocab_size {model_config.vocab_size}")


def _gpt_config(args, tokenizer, blend):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    return GPTDatasetConfig(
        random_seed=int(args.seed), sequence_length=int(args.seq_length), blend=blend,
        split=args.split if blend is not None else None, path_to_cache=getattr(args, "data_cache_path", None),
        tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=bool(getattr(args, "eod_mask_loss", False)), create_attention_mask=False,
        mmap_bin_files=True, num_dataset_builder_threads=1)


def _build_gpt(args, model_config, tokenizer, sizes, mock: bool):
    try:  # GPTDataset / BlendedDataset index builders (compiled module shipped in the megatron-core wheel)
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError as e:
        raise DataError(f"megatron-core's compiled dataset helpers are missing ({e}); see docs/data.md") from None
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.core.datasets.utils import get_blend_from_list

    from megatron_glm5.data.indexed import check_indexed_dataset

    if mock:
        config = _gpt_config(args, tokenizer or _MockTokenizer(model_config.vocab_size), None)
        # mock splits are megatron's arbitrary 1,1,1; a split the run never reads is not built
        config.split_matrix = [m if sizes[i] > 0 else None for i, m in enumerate(config.split_matrix)]
        cls = MockGPTDataset
    else:
        try:
            prefixes, weights = get_blend_from_list(list(args.data_path))
        except (AssertionError, ValueError):
            raise DataError(f"--data-path: expected PREFIX ... or WEIGHT PREFIX ..., got {args.data_path}") from None
        if weights is not None and any(not (w > 0) for w in weights):
            raise DataError(f"--data-path: weights must be positive, got {weights}")
        counts = {p: check_indexed_dataset(p) for p in prefixes}  # one line for a missing / corrupt .bin/.idx
        matrix = _split_matrix(args.split)
        config = _gpt_config(args, tokenizer, (prefixes, weights))
        for p in prefixes:  # splits without documents (or without samples to draw) are not built
            n = counts[p]
            for i, bookend in enumerate(matrix):
                if bookend is not None:
                    beg, end = _split_range(bookend, n)
                    if end <= beg or sizes[i] == 0:
                        if sizes[i] > 0:
                            _print_rank0(f"> --split {args.split}: the {_SPLIT_NAMES[i]} split of {p} ({n} "
                                         f"documents) is empty: no {_SPLIT_NAMES[i]} dataset")
                        matrix[i] = None
        config.split_matrix = matrix
        cls = GPTDataset
    with warnings.catch_warnings():
        # pad == eod (GLM has no separate pad token): megatron then pads with -1, which is what we want
        warnings.filterwarnings("ignore", message="The pad token id in the tokenizer collides")
        datasets = BlendedMegatronDatasetBuilder(cls, list(sizes), lambda: True, config).build()
    for name, ds in zip(_SPLIT_NAMES, datasets):
        if ds is not None:
            _print_rank0(f"> {'mock ' if mock else ''}{cls.__name__} {name}: {len(ds)} samples of "
                         f"{args.seq_length} tokens")
    return tuple(datasets)


def _refuse_weights(data_path, dataset_type: str, hint: str = "") -> None:
    """:class:`DataError` for a blend weight (a number that names no file) in ``--data-path``: packed sources take
    files only."""
    for p in data_path:
        try:
            float(p)
        except ValueError:
            continue
        if not os.path.exists(p):
            raise DataError(f"--data-path: weights are not supported with --dataset-type {dataset_type} (got {p!r})"
                            f"{hint}")


def _build_vqa(args, model_config, tokenizer, sizes):
    from megatron_glm5.data.vqa import PackedVQADataset, VQADocuments, build_image_processor, read_vqa_records

    if model_config.vision is None:
        raise DataError("--dataset-type vqa: the model config has no vision_config")
    _refuse_weights(args.data_path, "vqa")
    matrix = _split_matrix(args.split)
    hf_dir = getattr(args, "hf_config", None)
    pre = os.path.join(hf_dir, "preprocessor_config.json") if isinstance(hf_dir, str) else None
    processor = build_image_processor(model_config.vision, pre if pre and os.path.isfile(pre) else None,
                                      getattr(args, "min_image_tokens", None), getattr(args, "max_image_tokens", None))
    records = read_vqa_records(args.data_path)
    docs = VQADocuments(records, tokenizer, model_config, processor)
    return _packed_splits(PackedVQADataset, docs, "records", matrix, sizes, args, tokenizer)


def _packed_splits(dataset_cls, docs, what: str, matrix, sizes, args, tokenizer) -> tuple:
    """(train, valid, test) ``dataset_cls`` over the ``--split`` ranges of ``docs`` (``None`` for a split with no
    samples asked or no documents; an empty one is said in one line naming ``what`` the documents are)."""
    out = []
    for i, (name, bookend) in enumerate(zip(_SPLIT_NAMES, matrix)):
        if bookend is None or sizes[i] == 0:
            out.append(None)
            continue
        beg, end = _split_range(bookend, len(docs))
        if end <= beg:
            _print_rank0(f"> --split {args.split}: the {name} split of {len(docs)} {what} is empty: no {name} "
                         f"dataset")
            out.append(None)
            continue
        ds = dataset_cls(docs, np.arange(beg, end), sizes[i], args.seq_length, args.seed, tokenizer.pad,
                         split_index=i, name=name)
        _print_rank0(f"> {ds.summary()}")
        out.append(ds)
    return tuple(out)


def _build_chat(args, model_config, tokenizer, sizes):
    from megatron_glm5.data.chat_template import build_processor, build_video_processor, load_chat_template
    from megatron_glm5.data.conversations import ChatDocuments, PackedChatDataset, read_conversations
    from megatron_glm5.data.vqa import build_image_processor

    from megatron_glm5.data.energon import energon_source

    if model_config.vision is None:
        raise DataError("--dataset-type chat: the model config has no vision_config")
    _refuse_weights(args.data_path, "chat", "; blend with an Energon metadataset")
    energon = energon_source(list(args.data_path))
    matrix = _split_matrix(args.split) if energon is None else None
    hf_dir = getattr(args, "hf_config", None)
    pre = {n: os.path.join(hf_dir, n) if isinstance(hf_dir, str) and os.path.isdir(hf_dir) else None
           for n in ("preprocessor_config.json", "video_preprocessor_config.json")}
    pre = {n: p if p and os.path.isfile(p) else None for n, p in pre.items()}
    lo, hi = getattr(args, "min_image_tokens", None), getattr(args, "max_image_tokens", None)
    image_processor = build_image_processor(model_config.vision, pre["preprocessor_config.json"], lo, hi)
    video_processor = build_video_processor(model_config.vision, pre["video_preprocessor_config.json"], lo, hi)
    template = load_chat_template(args.tokenizer_model, getattr(args, "chat_template", None))
    processor = build_processor(args.tokenizer_model, template, image_processor, video_processor)
    loss = ("all" if getattr(args, "loss_on_all_turns", False) else
            "last" if getattr(args, "loss_on_last_turn_only", False) else "assistant")
    if energon is not None:
        return _build_energon(args, energon, ChatDocuments([], processor, model_config, tokenizer.eod, loss=loss),
                              tokenizer, sizes)
    docs = ChatDocuments(read_conversations(args.data_path), processor, model_config, tokenizer.eod, loss=loss)
    return _packed_splits(PackedChatDataset, docs, "conversations", matrix, sizes, args, tokenizer)


def _build_energon(args, path, planner, tokenizer, sizes):
    """(train iterator, None, None) over the Energon source ``path`` (its own splits: the ``train`` part)."""
    from megatron.core import parallel_state

    from megatron_glm5.data.energon import build_energon_loader

    if sizes[1] or sizes[2]:
        raise DataError(f"--data-path {path}: validation and test from an Energon source are not read by this "
                        f"trainer: give --eval-iters 0")
    initialized = parallel_state.model_parallel_is_initialized()
    dp_rank = parallel_state.get_data_parallel_rank() if initialized else 0
    dp_size = parallel_state.get_data_parallel_world_size() if initialized else 1
    loader = build_energon_loader(path, planner, args.seq_length, tokenizer.pad, args.micro_batch_size, dp_rank,
                                  dp_size, int(getattr(args, "num_workers", 0) or 0), int(args.seed),
                                  int(getattr(args, "energon_packing_buffer", 64)),
                                  int(getattr(args, "energon_shuffle_buffer", 0) or 0))
    _print_rank0(f"> Energon chat source {path}: packed rows of {args.seq_length} tokens streamed per data-parallel "
                 f"rank (loader state saved with each checkpoint)")
    return loader, None, None


def build_train_valid_test_datasets(args, model_config, tokenizer, sizes=None):
    """(train, valid, test) map-style datasets (each possibly None) for ``args`` (see the module docstring).

    ``args``: Megatron-LM attribute names ``mock_data``, ``data_path`` (list of str), ``split``, ``seq_length``,
    ``seed``, ``train_iters``, ``global_batch_size``, ``eval_iters``, ``eval_interval``, plus ``dataset_type``
    (``gpt`` | ``vqa``, default ``gpt``); optional: ``train_samples``, ``data_cache_path``, ``eod_mask_loss``,
    ``hf_config`` (a directory; its ``preprocessor_config.json`` configures the image processor),
    ``min_image_tokens`` / ``max_image_tokens``. ``model_config``: the ``Glm5Config``. ``tokenizer``: from
    ``build_tokenizer`` (may be None with mock data). ``sizes``: the (train, valid, test) samples to provide
    (Megatron-LM's ``train_val_test_num_samples``; default :func:`train_valid_test_num_samples`).
    """
    dataset_type = getattr(args, "dataset_type", None) or "gpt"
    if dataset_type not in DATASET_TYPES:
        raise DataError(f"--dataset-type: expected one of {', '.join(DATASET_TYPES)}, got {dataset_type!r}")
    if int(args.seq_length) <= 0:
        raise DataError(f"--seq-length must be positive, got {args.seq_length}")
    sizes = tuple(int(n) for n in sizes) if sizes is not None else train_valid_test_num_samples(args)
    if getattr(args, "mock_data", False):
        if dataset_type != "gpt":
            raise DataError(f"--mock-data makes text rows only: drop --dataset-type {dataset_type} or give "
                            f"--data-path")
        if tokenizer is not None:
            _check_tokenizer(tokenizer, model_config)
        return _build_gpt(args, model_config, tokenizer, sizes, mock=True)
    if not getattr(args, "data_path", None):
        raise DataError("--data-path is required (or --mock-data)")
    _check_tokenizer(tokenizer, model_config)
    if dataset_type == "vqa":
        datasets = _build_vqa(args, model_config, tokenizer, sizes)
    elif dataset_type == "chat":
        datasets = _build_chat(args, model_config, tokenizer, sizes)
    else:
        datasets = _build_gpt(args, model_config, tokenizer, sizes, mock=False)
    if sizes[1] > 0 and datasets[1] is None:  # Megatron-LM would run validation on no loader and fail mid-run
        raise DataError(f"--eval-iters {getattr(args, 'eval_iters', None)}: --split {args.split} leaves no "
                        f"validation data in --data-path: give the validation split a weight that holds documents, "
                        f"or --eval-iters 0")
    return datasets
