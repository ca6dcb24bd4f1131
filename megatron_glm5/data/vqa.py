"""Packed image+text SFT data (VQA): records -> tokenized documents -> first-fit packed THD rows.

Sources (``--data-path``, one or more; ``--dataset-type vqa``):

- a JSONL file: one ``{"image": PATH, "question": STR, "answer": STR}`` object per line; ``PATH`` is relative to
  the JSONL's directory (or absolute); a record without ``image`` (or ``null``) is a text-only document;
- a WebDataset tar (MedPix-VQA layout): members grouped by key (the member path up to the first dot of its file
  name), each sample one image (``jpg|jpeg|png|webp``) and one ``json`` with ``question`` / ``answer``;
- a directory: every ``*.tar`` in it (sorted), then every ``*.jsonl``.

Document (chat format; the ids of the image span come from the model's HF config)::

    <|user|>\\n  <begin_image> <image> * (t*h*w / merge^2) <end_image>  {question}  <|assistant|>\\n  {answer}  <eod>

The text pieces ``"<|user|>\\n"``, ``question``, ``"<|assistant|>\\n"`` and ``answer`` are tokenized separately
(no BOS); a tokenizer without ``<|user|>`` / ``<|assistant|>`` tokens spells them out. Loss: position ``j`` of a
document is trained (``loss_mask`` 1) iff its label ``tokens[j+1]`` is an answer token or the closing ``<eod>``;
a document's last token never is. Images go through transformers' ``Glm5NextImageProcessorPil`` (the PIL twin of
``Glm5NextImageProcessor``; same output) set up from the vision config (patch size, temporal patch size, merge
size), giving ``pixel_values`` ``[patches, C*T*P*P]`` and ``image_grid_thw`` ``[k, 3]`` per row.

Packing: each split's documents are shuffled (``numpy`` ``default_rng([seed, split, epoch])``) and packed first-fit
into rows of ``seq_length`` tokens, counting every expanded image token; the rows are then shuffled with the same
generator. A document longer than ``seq_length`` is skipped (not truncated: cutting an image span would break the
image-token / feature match) and counted in ``num_skipped``. Epochs are added until the split has at least
``num_samples`` rows. Row ``i`` depends only on ``i``, the seed and the data, so resuming is starting the sampler at
the consumed-samples count. ``packing_efficiency`` = document tokens / (rows x seq_length) over all rows built.
"""

from __future__ import annotations

import glob
import io
import os
import tarfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from megatron_glm5.errors import one_line
from megatron_glm5.data import DataError
from megatron_glm5.data.jsonl import parse_json, text_field
from megatron_glm5.data.media import MediaRef
from megatron_glm5.data.pack import assemble_row, first_fit

USER_PREFIX = "<|user|>\n"
ASSISTANT_PREFIX = "<|assistant|>\n"
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
_SPECIAL_ID_FIELDS = ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
                      "video_start_token_id", "video_end_token_id")
MAX_IMAGE_PIXELS = 64 * 1024 * 1024
"""Largest image (width x height) read; larger ones are refused before their pixels are decoded."""
MAX_IMAGE_BYTES = 256 * 1024 * 1024
"""Largest encoded image file read."""
MAX_JSON_BYTES = 64 * 1024 * 1024
"""Largest ``.json`` member of a WebDataset tar read."""
_PROCESSOR_KEYS = ("do_resize", "resample", "do_rescale", "rescale_factor", "do_normalize", "image_mean",
                   "image_std", "do_convert_rgb", "min_image_tokens", "max_image_tokens", "patch_expand_factor")


def placeholder_ids(model_config) -> set:
    """The model's image / video placeholder and span ids (``image_token_id``, ``image_start_token_id``, ...)."""
    return {int(getattr(model_config, f)) for f in _SPECIAL_ID_FIELDS if getattr(model_config, f, None) is not None}


# ------------------------------------------------------------------------------------------------ records
@dataclass(frozen=True)
class ImageRef(MediaRef):
    """Where an image's encoded bytes live (:class:`~megatron_glm5.data.media.MediaRef`)."""

    def _open(self):
        from PIL import Image, UnidentifiedImageError

        self.checked_size(MAX_IMAGE_BYTES, "image")
        try:
            img = Image.open(io.BytesIO(self.read()))
        except UnidentifiedImageError:  # its message names the BytesIO object, not the file
            raise DataError(f"{self.name}: unreadable image (not an image file PIL recognises)") from None
        w, h = img.size
        if w * h > MAX_IMAGE_PIXELS:
            raise DataError(f"{self.name}: image of {w} x {h} pixels, more than {MAX_IMAGE_PIXELS} (a decompression "
                            f"bomb or an image far larger than the model's budget)")
        return img

    def image_size(self):
        """(width, height) from the image header, without decoding the pixels."""
        try:
            with self._open() as img:
                return img.size
        except DataError:
            raise
        except Exception as e:  # PIL raises several types for unreadable data
            raise DataError(f"{self.name}: unreadable image ({one_line(e)})") from None

    def load(self):
        """The decoded PIL image, 8 bits per channel: 16-bit (and 32-bit integer) grey images are scaled to 0..255,
        not clipped; other modes as stored (the image processor converts to RGB)."""
        try:
            img = self._open()
            img.load()
            if img.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
                from PIL import Image

                a = np.asarray(img, dtype=np.float64)
                top = 65535.0 if img.mode.startswith("I;16") or a.max(initial=0) > 255 else 255.0
                img = Image.fromarray(np.clip(np.rint(a * (255.0 / top)), 0, 255).astype(np.uint8), mode="L")
        except DataError:
            raise
        except Exception as e:  # PIL raises several types for unreadable data
            raise DataError(f"{self.name}: unreadable image ({one_line(e)})") from None
        return img


@dataclass(frozen=True)
class VQARecord:
    """One question/answer pair with an optional image; ``where`` names it in messages (file:line or tar:key)."""

    question: str
    answer: str
    image: Optional[ImageRef]
    where: str


def _record(obj, where: str) -> tuple:
    return text_field(obj, "question", where), text_field(obj, "answer", where)


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def media_path(base: str, root: str, rel: str, where: str, what: str = "image") -> str:
    """``base/rel`` for a media path ``rel`` of the record ``where`` in a JSONL of the directory ``base`` (``root``:
    its real path): refused when it holds a NUL, is absolute or leaves ``base`` (symlinks resolved), or is missing."""
    full = os.path.join(base, rel)
    if "\0" in rel:
        raise DataError(f"{where}: {what} path {rel!r} holds a NUL character")
    if os.path.isabs(rel) or not _inside(os.path.realpath(full), root):
        raise DataError(f"{where}: {what} {rel!r} lies outside {base} ({what} paths are relative to the JSONL's "
                        f"directory and stay inside it)")
    if not os.path.isfile(full):
        raise DataError(f"{where}: {what} {full} not found")
    return full


def read_jsonl(path: str) -> List[VQARecord]:
    """Records of a VQA JSONL file. Image paths are relative to the file's directory and must stay inside it
    (symlinks resolved): an absolute path or one leaving the directory is refused."""
    base = os.path.dirname(os.path.abspath(path))
    root = os.path.realpath(base)
    out = []
    try:
        with open(path, "r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                where = f"{path}:{lineno}"
                if not line.strip():
                    continue
                obj = parse_json(line, where)
                q, a = _record(obj, where)
                image = obj.get("image")
                ref = None
                if image is not None:
                    full = media_path(base, root, text_field(obj, "image", where), where, "image")
                    ref = ImageRef(path=full, name=full)
                out.append(VQARecord(q, a, ref, where))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{path}: unreadable ({one_line(e)})") from None
    return out


def _split_key(member_name: str):
    """WebDataset's (key, extension): the key is the member path up to the first dot of its file name, the
    extension the rest (``a/b.image.png`` -> ``a/b``, ``image.png``)."""
    d, base = os.path.split(member_name)
    stem, dot, ext = base.partition(".")
    return (os.path.join(d, stem) if d else stem), ext.lower()


def _field(ext: str) -> Optional[str]:
    """'json', 'image' or None (a field this reader ignores) for a member's extension; the last dot-part decides
    (``image.png`` is an image)."""
    last = ext.rsplit(".", 1)[-1]
    return "json" if last == "json" else "image" if last in IMAGE_EXTENSIONS else None


def _other_image_format(ext: str) -> bool:
    """Whether a member's extension names an image format PIL reads that is not one of :data:`IMAGE_EXTENSIONS`
    (``bmp``, ``gif``, ``tif``, ...)."""
    from PIL import Image

    Image.init()
    fmt = Image.registered_extensions().get("." + ext.rsplit(".", 1)[-1])
    return fmt is not None and fmt in Image.OPEN and ext.rsplit(".", 1)[-1] not in IMAGE_EXTENSIONS


def read_webdataset(path: str) -> List[VQARecord]:
    """Records of a WebDataset tar: per key one ``json`` (question/answer) and at most one image. A member that
    is not a regular file (a link, a device), an image of another format than :data:`IMAGE_EXTENSIONS`, a truncated
    or unreadable tar, a second image or json of a key is refused in one line."""
    try:
        size = os.path.getsize(path)
        tf = tarfile.open(path, "r:")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"{path}: not a readable tar file ({one_line(e)})") from None
    samples: Dict[str, dict] = {}
    try:
        with tf:
            for m in tf:
                key, ext = _split_key(m.name)
                field = _field(ext)
                where = f"{path}:{key}"
                if m.isdir():
                    continue
                if field is None:
                    if _other_image_format(ext):  # else the sample would train without its image
                        raise DataError(f"{path}: member {m.name} is an image of a format this reader does not take "
                                        f"({', '.join(IMAGE_EXTENSIONS)}); convert it, or the sample has no image")
                    continue
                if not m.isreg() or m.issparse():
                    raise DataError(f"{path}: member {m.name} is not a regular file (a link or special file); "
                                    f"samples must hold their own data")
                if m.offset_data + m.size > size:
                    raise DataError(f"{path}: member {m.name} runs past the end of the file (truncated tar)")
                s = samples.setdefault(key, {})
                if field in s:
                    raise DataError(f"{where}: more than one {field} ({s[field + '_name']}, {m.name})")
                s[field + "_name"] = m.name
                if field == "json":
                    if m.size > MAX_JSON_BYTES:
                        raise DataError(f"{path}: member {m.name} has {m.size} bytes, more than {MAX_JSON_BYTES} "
                                        f"for a question/answer record")
                    s["json"] = parse_json(tf.extractfile(m).read(), f"{path}:{m.name}")
                else:
                    s["image"] = ImageRef(path=path, name=f"{path}:{m.name}", offset=m.offset_data, size=m.size)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DataError(f"{path}: unreadable tar ({one_line(e)})") from None
    out = []
    for key, s in samples.items():
        where = f"{path}:{key}"
        if "json" not in s:
            raise DataError(f"{where}: sample has no .json (question/answer)")
        q, a = _record(s["json"], where)
        out.append(VQARecord(q, a, s.get("image"), where))
    return out


def data_files(paths: Sequence[str]) -> List[str]:
    """The files of ``--data-path``: each file as given, each directory's ``*.tar`` then ``*.jsonl`` (sorted)."""
    files: List[str] = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "*.tar"))) + sorted(glob.glob(os.path.join(p, "*.jsonl")))
            if not found:
                raise DataError(f"--data-path: directory {p} holds no *.tar or *.jsonl")
            files.extend(found)
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise DataError(f"--data-path: {p} not found")
    return files


def read_vqa_records(paths: Sequence[str]) -> List[VQARecord]:
    """All records of ``paths`` (JSONL files, tars, or directories of them), in order."""
    records: List[VQARecord] = []
    for f in data_files(paths):
        records.extend(read_webdataset(f) if f.endswith(".tar") else read_jsonl(f))
    if not records:
        raise DataError(f"--data-path: no records in {', '.join(paths)}")
    return records


# ------------------------------------------------------------------------------------------------ images
def build_image_processor(vision_config, preprocessor_config: Optional[str] = None,
                          min_image_tokens: Optional[int] = None, max_image_tokens: Optional[int] = None):
    """transformers' ``Glm5NextImageProcessorPil`` for ``vision_config`` (a ``Glm5VisionConfig``).

    Patch size, temporal patch size and merge size come from the vision config. ``preprocessor_config`` (an HF
    ``preprocessor_config.json``, optional) supplies the rest (mean / std, token budget ...) and must agree on the
    three sizes; ``min_image_tokens`` / ``max_image_tokens`` (merged LM tokens per image) override it.
    """
    from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

    sizes = {"patch_size": vision_config.patch_size, "temporal_patch_size": vision_config.temporal_patch_size,
             "merge_size": vision_config.spatial_merge_size}
    kw = {}
    if preprocessor_config is not None:
        try:
            with open(preprocessor_config, "rb") as f:
                pre = parse_json(f.read(), preprocessor_config)
        except OSError as e:
            raise DataError(f"{preprocessor_config}: unreadable ({one_line(e)})") from None
        if not isinstance(pre, dict):
            raise DataError(f"{preprocessor_config}: expected a JSON object, got {type(pre).__name__}")
        for k, v in sizes.items():
            if k in pre and pre[k] != v:
                raise DataError(f"{preprocessor_config}: {k}={pre[k]} disagrees with the vision config ({v})")
        kw = {k: pre[k] for k in _PROCESSOR_KEYS if k in pre}
    if min_image_tokens is not None:
        kw["min_image_tokens"] = int(min_image_tokens)
    if max_image_tokens is not None:
        kw["max_image_tokens"] = int(max_image_tokens)
    try:
        from PIL import Image

        processor = Glm5NextImageProcessorPil(**sizes, **kw)
        # a setting of the wrong type or range fails here, not when a row is read mid-run
        image_token_count(processor, 32, 32)
        with np.errstate(all="ignore"):
            probe = processor(images=[Image.new("RGB", (32, 32), (128, 64, 32))],
                              return_tensors="pt")["pixel_values"]
        if not bool(torch.isfinite(probe).all()):
            raise ValueError("they make non-finite pixel values")
    except Exception as e:  # noqa: BLE001 - transformers raises many types for bad settings
        where = preprocessor_config or "--min-image-tokens / --max-image-tokens"
        raise DataError(f"{where}: the image processor settings {kw} are unusable ({one_line(e)})") from None
    return processor


def image_token_count(image_processor, height: int, width: int) -> int:
    """LM tokens (merged patches) the processor makes of a ``height`` x ``width`` image."""
    return image_processor.get_number_of_image_patches(height, width) // image_processor.merge_size ** 2


# ------------------------------------------------------------------------------------------------ documents
class VQADocuments:
    """The tokenized documents of a list of records (see the module docstring for the format).

    Per document ``d``: ``tokens[d]`` int64 [L], ``targets[d]`` bool [L] (loss mask), ``images[d]`` (ImageRef or
    None) and ``image_tokens[d]`` (number of ``<image>`` placeholders).
    """

    def __init__(self, records: Sequence[VQARecord], tokenizer, model_config, image_processor):
        ids = {f: int(getattr(model_config, f)) for f in _SPECIAL_ID_FIELDS}
        special = set(ids.values())
        vocab = int(model_config.vocab_size)
        eod = int(tokenizer.eod)
        if eod in special or eod >= vocab:
            raise DataError(f"--tokenizer-model: end-of-document id {eod} is an image/video id or outside the "
                            f"model vocabulary ({vocab})")
        texts = [USER_PREFIX, ASSISTANT_PREFIX]
        for r in records:
            texts += [r.question, r.answer]
        tok = tokenizer.tokenize_batch(texts)
        user, assistant = tok[0], tok[1]
        self.tokens: List[np.ndarray] = []
        self.targets: List[np.ndarray] = []
        self.images: List[Optional[ImageRef]] = []
        self.image_tokens: List[int] = []
        for k, r in enumerate(records):
            q, a = tok[2 + 2 * k], tok[3 + 2 * k]
            for i in q + a + user + assistant:
                if i in special or i >= vocab:
                    what = ("an image/video placeholder id" if i in special
                            else f"outside the model vocabulary ({vocab})")
                    raise DataError(f"{r.where}: the text tokenizes to id {i}, {what}: the tokenizer does not fit "
                                    f"the model config")
            n_img = 0
            span: List[int] = []
            if r.image is not None:
                w, h = r.image.image_size()
                n_img = image_token_count(image_processor, h, w)
                span = [ids["image_start_token_id"]] + [ids["image_token_id"]] * n_img + [ids["image_end_token_id"]]
            prompt = user + span + q + assistant
            toks = np.array(prompt + a + [eod], dtype=np.int64)
            tgt = np.zeros(len(toks), dtype=bool)
            tgt[len(prompt) - 1:len(toks) - 1] = True  # labels tokens[j+1] in answer + <eod>
            self.tokens.append(toks)
            self.targets.append(tgt)
            self.images.append(r.image)
            self.image_tokens.append(n_img)
        self.image_processor = image_processor
        self.lengths = np.array([len(t) for t in self.tokens], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.tokens)


# ------------------------------------------------------------------------------------------------ dataset
class PackedVQADataset(torch.utils.data.Dataset):
    """Map-style packed rows of one split.

    ``ds[i]``: ``tokens`` / ``labels`` [s] int64, ``loss_mask`` [s] float32, ``cu_seqlens`` [n_docs + 1] int32
    (the padding tail counted as one document), plus ``pixel_values`` [patches, C*T*P*P] float32 and
    ``image_grid_thw`` [k, 3] int64 when the row has images (images in row order), and ``skipped_documents`` [1]
    int64: documents of the row whose image could not be decoded (found only when the row is read: the header was
    readable when the documents were built), replaced by padding (loss 0) with a notice line naming the image.
    Attributes: ``packing_efficiency``, ``num_skipped`` (documents longer than ``seq_length``), ``num_epochs``,
    ``rows`` (document indices per row).
    """

    def __init__(self, documents: VQADocuments, doc_indices: np.ndarray, num_samples: Optional[int],
                 seq_length: int, seed: int, pad_id: int, split_index: int = 0, name: str = "train"):
        self.documents = documents
        self.seq_length = int(seq_length)
        self.pad_id = int(pad_id)
        self.name = name
        lengths = documents.lengths
        fits = np.asarray([d for d in doc_indices if lengths[d] <= self.seq_length], dtype=np.int64)
        self.num_documents = len(fits)
        self.num_skipped = len(doc_indices) - len(fits)
        if len(fits) == 0:
            raise DataError(f"--seq-length {seq_length}: all {len(doc_indices)} {name} documents are longer "
                            f"(the shortest has {int(lengths[doc_indices].min())} tokens with its image tokens)")
        self.rows: List[List[int]] = []
        self.num_epochs = 0
        while self.num_epochs == 0 or (num_samples is not None and len(self.rows) < num_samples):
            rng = np.random.default_rng([int(seed), int(split_index), self.num_epochs])
            order = fits[rng.permutation(len(fits))]
            bins = first_fit(lengths[order].tolist(), self.seq_length)
            rows = [[int(order[j]) for j in b] for b in bins]
            self.rows.extend(rows[k] for k in rng.permutation(len(rows)))
            self.num_epochs += 1
        used = sum(int(lengths[r].sum()) for r in self.rows)
        self.packing_efficiency = used / (len(self.rows) * self.seq_length)

    def summary(self) -> str:
        return (f"packed VQA {self.name}: {len(self.rows)} rows of {self.seq_length} tokens from "
                f"{self.num_epochs} epoch(s) of {self.num_documents} documents ({self.num_skipped} longer than "
                f"seq_length skipped), "
                f"packing efficiency {self.packing_efficiency:.3f}")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        docs = self.documents
        row = self.rows[idx]
        images, skipped = {}, set()
        for d in row:
            if docs.images[d] is not None:
                try:
                    images[d] = docs.images[d].load()
                except DataError as e:  # a damaged image found mid-run: the document becomes padding, counted
                    print(f"notice: {one_line(e)}: document skipped", flush=True)
                    skipped.add(d)
        tokens = [np.full(len(docs.tokens[d]), self.pad_id, np.int64) if d in skipped else docs.tokens[d]
                  for d in row]
        targets = [np.zeros(len(docs.tokens[d]), bool) if d in skipped else docs.targets[d] for d in row]
        out = assemble_row(tokens, targets, self.seq_length, self.pad_id)
        with_image = [d for d in row if d in images]
        if with_image:
            feats = docs.image_processor(images=[images[d] for d in with_image], return_tensors="pt")
            grid = feats["image_grid_thw"].to(torch.int64)
            merge = docs.image_processor.merge_size ** 2
            for d, g in zip(with_image, grid):
                if int(g.prod()) // merge != docs.image_tokens[d]:
                    raise DataError(f"{docs.images[d].name}: the image processor made {int(g.prod()) // merge} "
                                    f"image tokens, the plan {docs.image_tokens[d]}")
            out["pixel_values"] = feats["pixel_values"].to(torch.float32)
            out["image_grid_thw"] = grid
        out["skipped_documents"] = torch.tensor([len(skipped)], dtype=torch.int64)
        return out
