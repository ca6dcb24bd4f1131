"""Megatron-Energon datasets as a ``--dataset-type chat`` source: packed conversation rows streamed by Energon's
savable loader, whose state goes into the checkpoint so that a resumed run reads exactly the rows an uninterrupted
one would.

``--data-path PATH``: a dataset prepared with ``energon prepare`` (a folder holding ``.nv-meta/``) or an Energon
metadataset YAML (``MetadatasetV2``: blends of datasets with weights, as Energon defines them). Sample types:

- ``VQASample`` (``energon prepare --sample-type VQASample --field-map '{"image": "png", "context":
  "json[question]", "answers": "json[answer]"}'``): one user turn (image, question), one assistant turn (the first
  answer);
- ``CrudeWebdataset`` samples of a ``json`` part ``{"messages": [...]}`` in the HF / OpenAI form
  (:mod:`megatron_glm5.data.conversations`), whose image and video items name a part of the same sample
  (``{"type": "image", "image": "0.png"}`` for the member ``KEY.0.png``): multi-turn conversations with images and
  videos, cooked by :func:`cook_conversation`.

Parts are not decoded by Energon (:class:`RawDecoder`: JSON parts are parsed, everything else stays bytes, nothing is
unpickled); each sample becomes a document through the same chat template and processor as the map-style source
(:meth:`~megatron_glm5.data.conversations.ChatDocuments.plan`), documents are packed first-fit
(:func:`~megatron_glm5.data.pack.first_fit`) within Energon's packing buffer (``--energon-packing-buffer``) into
rows of ``--seq-length`` tokens (:func:`~megatron_glm5.data.conversations.packed_row`) and batched with
:func:`~megatron_glm5.data.collate.collate`. A sample that is unusable (a bad record, unreadable media, longer than
``--seq-length``, a crude sample without a ``messages`` list) is skipped with a notice line and counted in the next
row's ``skipped_documents``, and :data:`MAX_UNUSABLE_IN_A_ROW` of them in a row stop the loader; a sample Energon's
own pipeline cannot load (a part that does not parse, a field map that does not match) is skipped with a notice line
(:func:`_notice`), and Energon stops the run when 100 in a row fail. A read that fails (a damaged shard) and such a
stop reach the training loop as one :class:`~megatron_glm5.data.DataError` line (exit status 1).

Configs: Energon's loader imports and calls what its YAML names (``__module__`` / ``__class__`` /
``__function__``, ``.nv-meta/*.py`` named by ``part_filter`` / ``sample_loader``);
:func:`~megatron_glm5.data.energon_config.check_energon_source` checks every config of the source first and refuses
anything but plain keys and the classes read here, in one line naming the file and the key.

Resume: the iterator has ``save_state()`` (Energon's ``save_state_rank()``), written per data-parallel rank into
each checkpoint folder, ``iter_NNNNNNN/train_dataloader_dprankRRR.pt``
(:func:`megatron_glm5.training.data_loaders.external_loaders`), where ``integrity.json`` covers it. The state is
written as JSON text (:func:`encode_state`) and read back with ``torch.load(weights_only=True)`` and
:func:`decode_state`, which makes only dataclasses of Energon's own modules: nothing is unpickled.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

from megatron_glm5.data import DataError

ENERGON_META = ".nv-meta"
MAX_UNUSABLE_IN_A_ROW = 1000
"""The loader stops (one line, exit 1) when this many samples in a row cannot be used (a bad record, unreadable
media, longer than ``--seq-length``): a data set with no usable sample ends the run instead of looping."""
STATE_FILE = "train_dataloader_dprank{:03d}.pt"


def is_energon_source(path: str) -> bool:
    """Whether ``path`` is an Energon dataset folder or an Energon metadataset YAML."""
    if os.path.isdir(path):
        return os.path.isdir(os.path.join(path, ENERGON_META))
    return path.endswith((".yaml", ".yml")) and os.path.isfile(path)


def _energon_classes():
    """Energon's classes this module builds on (imported on first use: the package is only needed with Energon)."""
    from megatron.energon import (Cooker, Sample, SampleDecoder, SkipSample, TaskEncoder, VQASample, basic_sample_keys,
                                  edataclass, stateless)

    return Cooker, Sample, SampleDecoder, SkipSample, TaskEncoder, VQASample, basic_sample_keys, edataclass, stateless


def build_energon_loader(path: str, documents, seq_length: int, pad_id: int, micro_batch_size: int, dp_rank: int,
                         dp_size: int, num_workers: int, seed: int, packing_buffer: int, shuffle_buffer: int):
    """The train iterator of ``path``: :class:`EnergonIterator` over Energon's savable loader; ``documents`` (a
    :class:`~megatron_glm5.data.conversations.ChatDocuments` of no conversations) plans each sample."""
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

    from megatron_glm5.data.energon_config import check_energon_source

    check_energon_source(path)
    encoder = energon_class("ChatTaskEncoder")(documents, seq_length, pad_id)
    worker_config = WorkerConfig(rank=dp_rank, world_size=dp_size, num_workers=num_workers, seed_offset=seed,
                                 global_error_handler=_notice)
    try:
        ds = get_train_dataset(path, batch_size=micro_batch_size, shuffle_buffer_size=shuffle_buffer or None,
                               max_samples_per_sequence=None, packing_buffer_size=packing_buffer,
                               worker_config=worker_config, task_encoder=encoder)
    except (FileNotFoundError, ValueError, TypeError, KeyError, AssertionError) as e:
        from megatron_glm5.errors import one_line

        raise DataError(f"--data-path {path}: not a usable Energon dataset ({one_line(e)})") from None
    return EnergonIterator(get_savable_loader(ds, worker_config=worker_config), path)


def _notice(e: Exception, sample, sources=None) -> None:
    """Energon's error handler for a sample that fails inside its pipeline (a part that does not parse, a field
    map that does not match): one notice line naming the sample's files, no traceback; the sample is skipped."""
    from megatron_glm5.errors import one_line

    names = ", ".join(f"{s.dataset_path}/{s.shard_name}:{'+'.join(s.file_names)}" for s in (sources or [])[:2])
    print(f"notice: {names or 'an Energon sample'}: {one_line(e)}: sample skipped", flush=True)


class EnergonIterator:
    """Micro batches of an Energon savable loader, with the ``save_state()`` Megatron-LM's checkpointing calls.

    A read that fails in the loader (a damaged shard or index: ``tarfile.ReadError``, ``OSError``, ``EOFError``,
    ``ValueError``; no usable sample in :data:`MAX_UNUSABLE_IN_A_ROW` tries) raises a
    :class:`~megatron_glm5.data.DataError` of one line naming ``path``, also when a loader worker process read it."""

    def __init__(self, loader, path: str = "an Energon source"):
        self.loader = loader
        self.path = path
        self._it = None

    def restore(self, state) -> None:
        """Continue from ``state`` (what ``save_state()`` returned in the run that wrote the checkpoint)."""
        self.loader.restore_state_rank(state)
        self._it = None

    def save_state(self) -> str:
        return encode_state(self.loader.save_state_rank())

    def __iter__(self):
        return self

    def __next__(self) -> Dict:
        import tarfile

        try:
            if self._it is None:
                self._it = iter(self.loader)
            return next(self._it)
        except (OSError, EOFError, ValueError, tarfile.TarError) as e:
            raise DataError(f"--data-path {self.path}: reading the Energon dataset failed ({loader_error_line(e)})") \
                from None


NO_USABLE = "no usable sample in"


def loader_error_line(e: BaseException) -> str:
    """What went wrong in Energon's loader, as one line: the message of the first error of ``e``'s chain (Energon
    wraps errors in ``FatalSampleError``; torch re-raises a worker's error with the worker's traceback text as its
    message, whose last line is the error)."""
    from megatron_glm5.errors import one_line

    chain, x = [], e
    while x is not None and len(chain) < 16:
        chain.append(x)
        x = x.__cause__ or x.__context__
    for x in chain:
        if NO_USABLE in str(x):
            text = str(x)
            return one_line(ValueError(text[text.index(NO_USABLE):].splitlines()[0].rstrip(".")))
    text = str(chain[-1])
    if "Traceback (most recent call last)" in text:
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith((" ", "\t"))]
        text = lines[-1] if lines else text
    return one_line(ValueError(text) if text else chain[-1])


def state_path(root: str, iteration: int, dp_rank: int) -> str:
    """This data-parallel rank's loader state in the checkpoint of ``iteration`` under the save root ``root``:
    ``iter_NNNNNNN/train_dataloader_dprankRRR.pt`` (Megatron-LM's file name, in the checkpoint folder itself)."""
    from megatron.training.checkpointing import get_checkpoint_name

    return os.path.join(get_checkpoint_name(root, iteration, return_base_dir=True), STATE_FILE.format(dp_rank))


def encode_state(state) -> str:
    """Energon's loader state (dataclasses, ``FlexState`` dicts, lists, tuples, bytes, str, numbers, None) as JSON
    text: nothing in the checkpoint needs unpickling to read it back."""
    import base64
    import dataclasses
    import json

    import numpy as np
    import torch
    from megatron.energon.state import FlexState

    def enc(o):
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return {"__dataclass__": f"{type(o).__module__}:{type(o).__qualname__}",
                    "fields": {f.name: enc(getattr(o, f.name)) for f in dataclasses.fields(o)}}
        if isinstance(o, FlexState):
            return {"__flex__": [[enc(k), enc(v)] for k, v in o.items()]}
        if isinstance(o, dict):
            return {"__dict__": [[enc(k), enc(v)] for k, v in o.items()]}
        if isinstance(o, tuple):
            return {"__tuple__": [enc(v) for v in o]}
        if isinstance(o, list):
            return [enc(v) for v in o]
        if isinstance(o, (bytes, bytearray)):
            return {"__bytes__": base64.b64encode(bytes(o)).decode("ascii")}
        if isinstance(o, (torch.Tensor, np.ndarray)):
            a = o.detach().cpu().numpy() if isinstance(o, torch.Tensor) else o
            return {"__tensor__" if isinstance(o, torch.Tensor) else "__ndarray__": {
                "dtype": a.dtype.str, "shape": list(a.shape),
                "data": base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")}}
        if isinstance(o, np.generic):
            return o.item()
        if o is None or isinstance(o, (bool, int, float, str)):
            return o
        raise TypeError(f"Energon loader state holds a {type(o).__module__}.{type(o).__qualname__}, which "
                        f"megatron_glm5.data.energon.encode_state does not write")

    return json.dumps(enc(state))


def decode_state(text: str, where: str):
    """The loader state of :func:`encode_state`'s JSON; only dataclasses of ``megatron.energon`` modules are made."""
    import base64
    import binascii
    import dataclasses
    import importlib
    import json

    import numpy as np
    import torch
    from megatron.energon.state import FlexState

    def cls_of(name: str):
        module, _, qual = name.partition(":")
        if not (module == "megatron.energon" or module.startswith("megatron.energon.")) or "." in qual or not qual:
            raise ValueError(f"class {name} is not one of Energon's state classes")
        c = getattr(importlib.import_module(module), qual, None)
        if not (isinstance(c, type) and dataclasses.is_dataclass(c)):
            raise ValueError(f"{name} is not a dataclass")
        return c

    def dec(o):
        if isinstance(o, list):
            return [dec(v) for v in o]
        if not isinstance(o, dict):
            return o
        if "__dataclass__" in o:
            c = cls_of(o["__dataclass__"])
            names = {f.name for f in dataclasses.fields(c)}
            fields = {k: dec(v) for k, v in o["fields"].items()}
            if set(fields) != names:
                raise ValueError(f"{o['__dataclass__']}: fields {sorted(fields)}, expected {sorted(names)}")
            return c(**fields)
        if "__flex__" in o:
            return FlexState((dec(k), dec(v)) for k, v in o["__flex__"])
        if "__dict__" in o:
            return {dec(k): dec(v) for k, v in o["__dict__"]}
        if "__tuple__" in o:
            return tuple(dec(v) for v in o["__tuple__"])
        if "__bytes__" in o:
            return base64.b64decode(o["__bytes__"], validate=True)
        for key in ("__tensor__", "__ndarray__"):
            if key in o:
                t = o[key]
                dtype = np.dtype(t["dtype"])
                if dtype.kind not in "biuf":  # numbers only: an object dtype would unpickle
                    raise ValueError(f"array of dtype {dtype}")
                a = np.frombuffer(base64.b64decode(t["data"], validate=True), dtype=dtype).reshape(t["shape"]).copy()
                return torch.from_numpy(a) if key == "__tensor__" else a
        raise ValueError(f"unknown entry {sorted(o)[:3]}")

    try:
        return dec(json.loads(text))
    except (ValueError, TypeError, KeyError, AttributeError, ImportError, binascii.Error, RecursionError) as e:
        from megatron_glm5.errors import one_line

        raise DataError(f"{where}: not an Energon loader state this program wrote ({one_line(e)})") from None


def load_state(path: str):
    """The loader state a checkpoint holds (``torch.load`` with ``weights_only``: a dict holding JSON text)."""
    import torch

    from megatron_glm5.errors import one_line

    if not os.path.isfile(path):
        raise DataError(f"{path} not found: the checkpoint holds no Energon loader state for this data-parallel "
                        f"rank (it was written by a run with another data source or data-parallel size)")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
        text = obj["dataloader_state_dict"]
    except Exception as e:  # noqa: BLE001 - torch.load raises many types for a damaged file
        raise DataError(f"{path}: unreadable Energon loader state ({one_line(e)})") from None
    if not isinstance(text, str):
        raise DataError(f"{path}: not an Energon loader state this program wrote")
    return decode_state(text, path)


# ------------------------------------------------------------------------------------------------ task encoder
def _classes():
    Cooker, Sample, SampleDecoder, SkipSample, TaskEncoder, VQASample, basic_sample_keys, edataclass, stateless = \
        _energon_classes()

    class RawDecoder(SampleDecoder):
        """Parses ``json`` parts (UTF-8 JSON) and leaves every other part as bytes: the processors decode images and
        videos as for the map-style source, and no part is unpickled (webdataset's default handlers would unpickle
        ``.pyd`` / ``.pickle`` members)."""

        def __init__(self):
            self._config = {"glm5_raw_decoder": 1}

        def __call__(self, sample: dict) -> dict:
            from megatron_glm5.data.jsonl import parse_json

            where = f"{sample.get('__shard__') or '?'}:{sample.get('__key__')}"
            return {k: parse_json(v, f"{where}.{k}")
                    if isinstance(v, (bytes, bytearray)) and (k == "json" or k.endswith(".json")) else v
                    for k, v in sample.items()}

        def decode(self, fname: str, raw: bytes):
            return self({"__key__": fname, fname.rsplit(".", 1)[-1]: raw})[fname.rsplit(".", 1)[-1]]

    @edataclass
    class ConversationSample(Sample):
        """A crude sample cooked: its ``messages`` and its other parts (bytes by part name)."""

        messages: list
        parts: dict

    from megatron.energon.errors import FatalSampleError

    class NoUsableSample(FatalSampleError):
        """No usable sample in :data:`MAX_UNUSABLE_IN_A_ROW` tries: Energon does not handle this error, it ends the
        loader."""

    @stateless
    def cook_conversation(crude: dict):
        obj = crude.get("json")
        messages = obj.get("messages") if isinstance(obj, dict) else None
        parts = {k: v for k, v in crude.items() if not k.startswith("__") and k != "json"}
        return ConversationSample(**basic_sample_keys(crude), messages=messages, parts=parts)

    class ChatTaskEncoder(TaskEncoder):
        """Samples -> planned documents -> first-fit packed rows -> collated micro batches."""

        cookers = [Cooker(cook_conversation)]
        decoder = RawDecoder()

        def __init__(self, documents, seq_length: int, pad_id: int):
            super().__init__()
            self.documents = documents
            self.seq_length = int(seq_length)
            self.pad_id = int(pad_id)
            self.skipped = 0
            self.unusable_in_a_row = 0

        def _skip(self, why: str):
            print(f"notice: {why}: document skipped", flush=True)
            self.skipped += 1
            self.unusable_in_a_row += 1
            if self.unusable_in_a_row >= MAX_UNUSABLE_IN_A_ROW:
                raise NoUsableSample(f"{NO_USABLE} {self.unusable_in_a_row} tries in a row (the last: {why}); "
                                     f"every sample is unusable")
            raise SkipSample()

        @stateless
        def encode_sample(self, sample):
            from megatron_glm5.errors import one_line

            where = f"{getattr(sample, '__key__', '?')}"
            try:
                conv = to_conversation(sample, VQASample, where)
                doc = self.documents.plan(conv)
            except DataError as e:
                self._skip(one_line(e))
            if len(doc.tokens) > self.seq_length:
                self._skip(f"{where}: {len(doc.tokens)} tokens, longer than --seq-length {self.seq_length}")
            self.unusable_in_a_row = 0
            return _Encoded(doc, sample.__restore_key__)

        def select_samples_to_pack(self, samples: List) -> List[List]:
            from megatron_glm5.data.pack import first_fit

            bins = first_fit([len(s.doc.tokens) for s in samples], self.seq_length)
            return [[samples[i] for i in b] for b in bins]

        @stateless
        def pack_selected_samples(self, samples: List):
            from megatron_glm5.data.conversations import packed_row

            skipped, self.skipped = self.skipped, 0
            row = packed_row([s.doc for s in samples], self.seq_length, self.pad_id, self.documents.image_processor,
                             self.documents.video_processor, skipped_before=skipped)
            return _Row(row, tuple(k for s in samples for k in s.__restore_key__))

        def batch(self, rows: List):
            from megatron_glm5.data.collate import collate

            return collate([r.row for r in rows])

        def encode_batch(self, batch):
            return batch

    return RawDecoder, ConversationSample, cook_conversation, ChatTaskEncoder


class _Encoded:
    """A planned document with the restore key of the sample it came from (Energon re-encodes it on restore)."""

    def __init__(self, doc, restore_key):
        self.doc = doc
        self.__restore_key__ = restore_key


class _Row:
    """A packed row with the restore keys of its documents."""

    def __init__(self, row, restore_key):
        self.row = row
        self.__restore_key__ = restore_key


def to_conversation(sample, vqa_cls, where: str):
    """A :class:`~megatron_glm5.data.conversations.Conversation` of an Energon ``VQASample`` or cooked
    ``ConversationSample`` (media as bytes in memory)."""
    from megatron_glm5.data.conversations import Conversation, conversation_from_parts
    from megatron_glm5.data.vqa import ImageRef

    if isinstance(sample, vqa_cls):
        answers = sample.answers
        answer = answers if isinstance(answers, str) else (answers[0] if answers else None)
        if not isinstance(sample.context, str) or not isinstance(answer, str):
            raise DataError(f"{where}: a VQA sample needs a text context and answer")
        media, user = (), [{"type": "text", "text": sample.context}]
        if isinstance(sample.image, (bytes, bytearray)):
            media = (ImageRef("", name=f"{where}: image", data=bytes(sample.image)),)
            user.insert(0, {"type": "image"})
        elif sample.image is not None:
            raise DataError(f"{where}: the image part was decoded by Energon; use the raw decoder")
        return Conversation([{"role": "user", "content": user}, {"role": "assistant", "content": answer}], media,
                            where)
    if not isinstance(sample.messages, list):
        raise DataError(f"{where}: the sample's json part holds no 'messages' list")
    return conversation_from_parts({"messages": sample.messages}, sample.parts, where)


_CACHE: Dict[str, object] = {}


def energon_class(name: str):
    """``RawDecoder``, ``ConversationSample``, ``cook_conversation`` or ``ChatTaskEncoder``: built on Energon's
    classes when first asked for (the package is imported only for an Energon source)."""
    if not _CACHE:
        _CACHE.update(zip(("RawDecoder", "ConversationSample", "cook_conversation", "ChatTaskEncoder"), _classes()))
    return _CACHE[name]


def energon_source(paths) -> Optional[str]:
    """The Energon source of ``--data-path`` (None if it names none); one only, not mixed with files."""
    found = [p for p in paths if is_energon_source(p)]
    if not found:
        return None
    if len(paths) != 1:
        raise DataError(f"--data-path: an Energon dataset ({found[0]}) is the only source of a run; blend datasets "
                        f"with an Energon metadataset YAML")
    return found[0]
