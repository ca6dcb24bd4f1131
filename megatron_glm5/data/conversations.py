"""Conversations (text, images, videos) rendered by the checkpoint's own chat template through transformers'
``Glm5NextProcessor``, tokenized into documents and packed into THD rows (``--dataset-type chat``).

Sources (``--data-path``, one or more; a directory means its ``*.tar`` then its ``*.jsonl``, sorted):

- a JSONL of conversations in the HF / OpenAI form, one per line::

      {"messages": [{"role": "system" | "user" | "assistant" | ..., "content": STR | [ITEM, ...]}, ...]}

  ``ITEM``: ``{"type": "text", "text": STR}``, ``{"type": "image", "image" | "url" | "path": PATH}`` (OpenAI's
  ``{"type": "image_url", "image_url": {"url": PATH}}`` too) or ``{"type": "video", "video" | "url" | "path":
  PATH}``; ``PATH`` is relative to the JSONL's directory and must stay inside it (as for VQA images);
- a JSONL of ``{"image", "question", "answer"}`` records and WebDataset tars (MedPix layout), read by
  :mod:`megatron_glm5.data.vqa` and mapped to ``[user: [image, question], assistant: answer]``.

Document of a conversation (what the processor gives at inference, :class:`ChatDocuments`): the template renders
the messages (media items as ``{"type": "image"}`` / ``{"type": "video"}``); each ``<|image|>`` / ``<|video|>``
placeholder is replaced by the processor's own expansion (``replace_image_token`` / ``replace_video_token``: merged
patch tokens, and per video frame pair ``<|begin_of_image|> <|image|>*n <|end_of_image|> {t:.1f} seconds`` with the
timestamps of the frames the video processor samples); the text is tokenized by the tokenizer as the processor calls
it; the tokenizer's end-of-document token is appended unless the rendering ends with it. Token counts come from image
headers and video container headers (no pixels are decoded when documents are built); the pixels are decoded and
processed when a row is read, and their grids checked against the plan.

Loss (``loss_mask`` of position ``j`` is 1 iff its label, token ``j + 1``, is a target):

- default: the tokens of every assistant turn, and the turn's closing token (the token after the turn, e.g. the
  next ``<|user|>`` or the appended end-of-document) when the turn, trailing whitespace dropped, does not end in a
  special token of its own (a template with an end-of-turn token keeps it inside the turn); an empty turn (an empty
  or all-whitespace answer) trains its closing token alone;
- ``--loss-on-last-turn-only``: the same for the last assistant turn only;
- ``--loss-on-all-turns``: every token (system and user turns too);

never a token of an image or video span. A set of conversations with no target at all is refused in one line. An
assistant turn is where the template puts it: the ``{% generation %}`` blocks of a template that has them
(transformers' ``return_assistant_tokens_mask``), otherwise the text between the rendering of the messages before
it with the generation prompt and the rendering up to it (a template that does not render conversations
prefix-consistently needs the tags; refused in one line).

Text of a message holding a special token of the tokenizer (``<|image|>``, ``<|user|>`` ...) is refused in one
line naming ``FILE:LINE``: those strings would be read as the control tokens.
"""

from __future__ import annotations

import bisect
import math
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple, Union

import numpy as np
import torch

from megatron_glm5.errors import one_line
from megatron_glm5.data import DataError
from megatron_glm5.data.chat_template import render_bounded
from megatron_glm5.data.jsonl import parse_json, text_field
from megatron_glm5.data.vqa import (ImageRef, PackedVQADataset, data_files, media_path, placeholder_ids,
                                     read_jsonl, read_webdataset)
from megatron_glm5.data.video_io import VideoRef

LOSS_MODES = ("assistant", "last", "all")
MAX_LINE_BYTES = 64 * 1024 * 1024
"""Largest JSONL line (one conversation) read."""
_IMAGE_KEYS = ("image", "url", "path")
_VIDEO_KEYS = ("video", "url", "path")


@dataclass(frozen=True)
class Conversation:
    """Messages for the chat template (media items reduced to ``{"type": "image"|"video"}``), the media in their
    order of appearance, and ``where`` (``FILE:LINE`` or ``TAR:KEY``) to name it in messages."""

    messages: list
    media: Tuple[Union[ImageRef, VideoRef], ...]
    where: str


# ------------------------------------------------------------------------------------------------ reading
def _file_resolver(base: str):
    """Media paths relative to ``base`` (the JSONL's directory), kept inside it."""
    root = os.path.realpath(base)

    def resolve(rel, kind: str, where: str):
        if not isinstance(rel, str) or not rel:
            raise DataError(f"{where}: the {kind} path must be a non-empty string, got {type(rel).__name__}")
        full = media_path(base, root, rel, where, kind)
        cls = ImageRef if kind == "image" else VideoRef
        return cls(full, name=f"{where}: {kind} {rel}")

    return resolve


def _parts_resolver(parts: dict):
    """Media named by the part (member suffix) of the same sample, e.g. ``0.png`` for ``KEY.0.png``."""

    def resolve(rel, kind: str, where: str):
        data = parts.get(rel) if isinstance(rel, str) else None
        if not isinstance(data, (bytes, bytearray)):
            raise DataError(f"{where}: the sample has no part {rel!r} for its {kind}")
        cls = ImageRef if kind == "image" else VideoRef
        return cls("", name=f"{where}: {kind} {rel}", data=bytes(data))

    return resolve


def _item(item, resolve, where: str, media: list):
    """One content item, reduced for the template; a media item's reference is appended to ``media``."""
    if not isinstance(item, dict):
        raise DataError(f"{where}: a content item must be an object, got {type(item).__name__}")
    kind = item.get("type")
    if kind == "text":
        return {"type": "text", "text": text_field(item, "text", where)}
    if kind == "image_url":  # OpenAI
        url = item.get("image_url")
        media.append(resolve(url.get("url") if isinstance(url, dict) else url, "image", where))
        return {"type": "image"}
    if kind in ("image", "video"):
        keys = _IMAGE_KEYS if kind == "image" else _VIDEO_KEYS
        found = [k for k in keys if k in item]
        if len(found) != 1:
            raise DataError(f"{where}: a {kind} item needs exactly one of {', '.join(repr(k) for k in keys)}")
        media.append(resolve(item[found[0]], kind, where))
        return {"type": kind}
    raise DataError(f"{where}: content item type {kind!r} is not one of text, image, image_url, video")


def _conversation(obj, resolve, where: str) -> Conversation:
    msgs = obj.get("messages") if isinstance(obj, dict) else None
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: 'messages' must be a non-empty list")
    media: list = []
    out = []
    for m in msgs:
        if not isinstance(m, dict):
            raise DataError(f"{where}: a message must be an object, got {type(m).__name__}")
        role = text_field(m, "role", where)
        content = m.get("content")
        if isinstance(content, str):
            content = text_field(m, "content", where)
        elif isinstance(content, list):
            content = [_item(it, resolve, where, media) for it in content]
        else:
            raise DataError(f"{where}: a message's 'content' must be a string or a list of items")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: the conversation has no assistant message (nothing to train on)")
    return Conversation(out, tuple(media), where)


def conversation_from_json(obj, base: str, where: str) -> Conversation:
    """A :class:`Conversation` of a ``{"messages": [...]}`` object; media paths relative to ``base``."""
    return _conversation(obj, _file_resolver(base), where)


def conversation_from_parts(obj, parts: dict, where: str) -> Conversation:
    """A :class:`Conversation` of a ``{"messages": [...]}`` object whose media items name ``parts`` (bytes by part
    name, the other members of an Energon / WebDataset sample)."""
    return _conversation(obj, _parts_resolver(parts), where)


def _from_vqa(r) -> Conversation:
    user = ([{"type": "image"}] if r.image is not None else []) + [{"type": "text", "text": r.question}]
    return Conversation([{"role": "user", "content": user}, {"role": "assistant", "content": r.answer}],
                        (r.image,) if r.image is not None else (), r.where)


def _is_messages_jsonl(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    obj = parse_json(line[:MAX_LINE_BYTES], f"{path}:1")
                    return isinstance(obj, dict) and "messages" in obj
    except OSError as e:
        raise DataError(f"{path}: unreadable ({one_line(e)})") from None
    return False


def read_messages_jsonl(path: str) -> List[Conversation]:
    base = os.path.dirname(os.path.abspath(path))
    out = []
    try:
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                where = f"{path}:{lineno}"
                if len(line) > MAX_LINE_BYTES:
                    raise DataError(f"{where}: a line of {len(line)} bytes, more than {MAX_LINE_BYTES}")
                if not line.strip():
                    continue
                out.append(conversation_from_json(parse_json(line, where), base, where))
    except OSError as e:
        raise DataError(f"{path}: unreadable ({one_line(e)})") from None
    return out


def read_conversations(paths: Sequence[str]) -> List[Conversation]:
    """All conversations of ``paths`` (messages JSONL, VQA JSONL, WebDataset tars, or directories of them)."""
    out: List[Conversation] = []
    for f in data_files(paths):
        if f.endswith(".tar"):
            out.extend(_from_vqa(r) for r in read_webdataset(f))
        elif _is_messages_jsonl(f):
            out.extend(read_messages_jsonl(f))
        else:
            out.extend(_from_vqa(r) for r in read_jsonl(f))
    if not out:
        raise DataError(f"--data-path: no conversations in {', '.join(paths)}")
    return out


# ------------------------------------------------------------------------------------------------ media plans
def image_grid(image_processor, height: int, width: int) -> List[int]:
    """``[1, grid_h, grid_w]`` the image processor makes of a ``height`` x ``width`` image."""
    from transformers.models.glm5_next.image_processing_pil_glm5_next import smart_resize

    ip = image_processor
    rh, rw = smart_resize(num_frames=ip.temporal_patch_size, height=height, width=width,
                          factor=ip.patch_size * ip.merge_size, min_pixels=ip.min_image_tokens,
                          max_pixels=ip.max_image_tokens, temporal_factor=ip.temporal_patch_size)
    return [1, rh // ip.patch_size, rw // ip.patch_size]


def video_plan(video_processor, metadata) -> Tuple[np.ndarray, List[int]]:
    """(frame indices the video processor samples, ``[grid_t, grid_h, grid_w]``) for a video of ``metadata``;
    :class:`DataError` for a video too short to give a frame at the processor's fps."""
    from transformers.models.glm5_next.video_processing_glm5_next import smart_resize

    vp = video_processor
    indices = np.asarray(vp.sample_frames(metadata=metadata, fps=vp.fps), dtype=np.int64)
    n = len(indices)
    if n == 0:
        raise DataError(f"a video of {metadata.duration:.2f} s ({metadata.total_num_frames} frame(s) at "
                        f"{metadata.fps:g} fps) gives no frame at the video processor's {vp.fps:g} fps (too short)")
    rh, rw = smart_resize(num_frames=n, height=metadata.height, width=metadata.width,
                          factor=vp.patch_size * vp.merge_size * vp.patch_expand_factor,
                          temporal_factor=vp.temporal_patch_size, min_pixels=vp.min_image_tokens,
                          max_pixels=vp.max_image_tokens)
    return indices, [math.ceil(n / vp.temporal_patch_size), rh // vp.patch_size, rw // vp.patch_size]


@dataclass
class VideoPlan:
    ref: VideoRef
    metadata: object  # transformers VideoMetadata with frames_indices set
    grid: List[int]


# ------------------------------------------------------------------------------------------------ documents
@dataclass
class ChatDocument:
    """One planned document: ``tokens`` int64 [L], ``targets`` bool [L] (loss mask: label ``tokens[j+1]`` is a
    target), ``images`` [(ImageRef, grid)] and ``videos`` [VideoPlan] in placeholder order, ``modality_tokens``
    int64 [3] (text, image, video tokens)."""

    tokens: np.ndarray
    targets: np.ndarray
    images: list
    videos: List[VideoPlan]
    modality_tokens: np.ndarray


class ChatDocuments:
    """The tokenized documents of a list of conversations (see the module docstring).

    Per document ``d``: ``tokens[d]`` int64 [L], ``targets[d]`` bool [L] (loss mask: label ``tokens[j+1]`` is a
    target), ``images[d]`` [(ImageRef, grid)], ``videos[d]`` [VideoPlan] in placeholder order, and
    ``modality_tokens[d]`` int64 [3] (text, image, video tokens).
    """

    def __init__(self, conversations: Sequence[Conversation], processor, model_config, eod: int,
                 loss: str = "assistant"):
        from transformers.utils.chat_template_utils import render_jinja_template

        if loss not in LOSS_MODES:
            raise ValueError(f"loss must be one of {LOSS_MODES}, got {loss!r}")
        self.processor = processor
        self.image_processor = processor.image_processor
        self.video_processor = processor.video_processor
        tok = processor.tokenizer
        template = processor.chat_template
        self.tagged = re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None
        self._render_kwargs = dict(tok.special_tokens_map)
        self._render = render_jinja_template
        self._template = template
        special = {i: t.content for i, t in tok.added_tokens_decoder.items() if t.special}
        self._special_ids = set(special)
        self._special_re = re.compile("|".join(re.escape(s) for s in sorted(special.values(), key=len, reverse=True))
                                      ) if special else None
        self._bos = tok.bos_token
        self.vocab = int(model_config.vocab_size)
        self.eod = int(eod)
        self.image_token_id = int(model_config.image_token_id)
        self.media_ids = placeholder_ids(model_config)
        self.loss = loss
        self.tokens: List[np.ndarray] = []
        self.targets: List[np.ndarray] = []
        self.images: List[list] = []
        self.videos: List[List[VideoPlan]] = []
        self.modality_tokens: List[np.ndarray] = []
        for c in conversations:
            d = self.plan(c)
            self.tokens.append(d.tokens)
            self.targets.append(d.targets)
            self.images.append(d.images)
            self.videos.append(d.videos)
            self.modality_tokens.append(d.modality_tokens)
        self.lengths = np.array([len(t) for t in self.tokens], dtype=np.int64)
        if self.tokens and not any(t.any() for t in self.targets):
            raise DataError(f"--data-path: none of the {len(self.tokens)} conversations has a token to train on "
                            f"(loss mode {loss!r}): check the assistant turns and the chat template")

    def __len__(self) -> int:
        return len(self.tokens)

    # ---------------------------------------------------------------- rendering
    def render(self, messages, add_generation_prompt: bool = False, where: str = "") -> str:
        out, _ = render_bounded(self._render, where, conversations=[messages], chat_template=self._template,
                                add_generation_prompt=add_generation_prompt, **self._render_kwargs)
        return out[0]

    def assistant_spans(self, messages, text: str, where: str) -> List[Tuple[int, int]]:
        """Character spans of the assistant turns in ``text`` (the rendering of ``messages``)."""
        if self.tagged:
            _, idx = render_bounded(self._render, where, conversations=[messages], chat_template=self._template,
                                    return_assistant_tokens_mask=True, **self._render_kwargs)
            return [tuple(s) for s in idx[0]]
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True, where=where) if i else ""
            upto = self.render(messages[:i + 1], where=where)
            if not (text.startswith(upto) and upto.startswith(before)):
                raise DataError(f"{where}: the chat template does not render this conversation prefix-consistently "
                                f"(turn {i}), so its assistant turns cannot be found; mark them with "
                                f"{{% generation %}} ... {{% endgeneration %}} in the template")
            spans.append((len(before), len(upto)))
        return spans

    # ---------------------------------------------------------------- one document
    def _check_text(self, messages, where: str) -> None:
        if self._special_re is None:
            return
        for m in messages:
            parts = [m["content"]] if isinstance(m["content"], str) else [
                it["text"] for it in m["content"] if it["type"] == "text"]
            for p in parts:
                hit = self._special_re.search(p)
                if hit:
                    raise DataError(f"{where}: message text holds the special token {hit.group(0)!r} (it would be "
                                    f"read as that control token, not text)")

    def document(self, d: int) -> ChatDocument:
        return ChatDocument(self.tokens[d], self.targets[d], self.images[d], self.videos[d], self.modality_tokens[d])

    def plan(self, c: Conversation) -> ChatDocument:
        """The document of ``c``: token ids, loss mask and media plans (image / video headers read, no pixels)."""
        proc, where = self.processor, c.where
        self._check_text(c.messages, where)
        images, videos = [], []
        for ref in c.media:
            if isinstance(ref, VideoRef):
                meta = ref.probe()
                try:
                    indices, grid = video_plan(self.video_processor, meta)
                except DataError as e:
                    raise DataError(f"{ref.name}: {e}") from None
                except Exception as e:  # noqa: BLE001 - transformers' sampling raises for videos it cannot take
                    raise DataError(f"{ref.name}: the video processor cannot sample this video of "
                                    f"{meta.total_num_frames} frame(s) at {meta.fps:g} fps ({one_line(e, 200)})"
                                    ) from None
                meta.frames_indices = indices.tolist()
                videos.append(VideoPlan(ref, meta, grid))
            else:
                w, h = ref.image_size()
                images.append((ref, image_grid(self.image_processor, h, w)))
        text = self.render(c.messages, where=where)
        for token, n, what in ((proc.image_token, len(images), "image"), (proc.video_token, len(videos), "video")):
            if text.count(token) != n:
                raise DataError(f"{where}: the chat template rendered {text.count(token)} {token} placeholder(s) "
                                f"for {n} {what}(s)")
        spans = self.assistant_spans(c.messages, text, where)
        if self.loss == "last":
            spans = spans[-1:]
        img_repl = [proc.replace_image_token({"image_grid_thw": torch.tensor([g for _, g in images])}, k)
                    for k in range(len(images))]
        vid_inputs = {"video_grid_thw": torch.tensor([v.grid for v in videos]),
                      "video_metadata": [v.metadata for v in videos]}
        vid_repl = [proc.replace_video_token(vid_inputs, k) for k in range(len(videos))]
        expanded, offsets = proc.get_text_with_replacements([text], img_repl, vid_repl)
        add_special = not (self._bos is not None and text.startswith(self._bos))
        enc = proc.tokenizer(expanded[0], add_special_tokens=add_special, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        if not ids:
            raise DataError(f"{where}: the chat template renders this conversation as no tokens")
        offs = list(enc["offset_mapping"])
        trimmed = [(a, a + len(text[a:b].rstrip())) for a, b in spans]
        masked = proc._adjust_assistant_masks_indices(
            {"input_ids": [ids], "offset_mapping": [offs], "text_replacement_offsets": offsets or [[]]},
            [trimmed])["assistant_masks"][0]
        is_target = np.asarray(masked, dtype=bool)
        if ids[-1] != self.eod:
            ids.append(self.eod)
            offs.append((len(expanded[0]), len(expanded[0])))
            is_target = np.append(is_target, False)
        toks = np.asarray(ids, dtype=np.int64)
        in_media = np.zeros(len(toks), dtype=bool)
        starts, stops = np.asarray(offs, dtype=np.int64).reshape(-1, 2).T
        for r in (offsets[0] if offsets else []):
            a, b = r["new_span"]
            in_media |= (starts >= a) & (stops <= b) & (stops > starts)
        in_media |= np.isin(toks, list(self.media_ids))
        if self.loss == "all":
            is_target = np.ones(len(toks), dtype=bool)
        else:  # each turn's closing token, when the turn does not end in a special token of its own
            ends = np.flatnonzero(is_target[:-1] & ~is_target[1:])
            for k in ends:
                if int(toks[k]) not in self._special_ids:
                    is_target[k + 1] = True
            reps = offsets[0] if offsets else []
            placeholder_ends = [r["span"][1] for r in reps]
            gained = [0] + [r["new_span"][1] - r["span"][1] for r in reps]
            for (_, end), (a, b) in zip(spans, trimmed):  # an empty turn: its closing token is its one target
                if b > a:
                    continue
                pos = end + gained[bisect.bisect_right(placeholder_ends, end)]  # in the expanded text
                after = np.flatnonzero((starts >= pos) & (stops > starts))
                is_target[int(after[0]) if len(after) else len(toks) - 1] = True
        is_target &= ~in_media
        bad = toks[(toks < 0) | (toks >= self.vocab)]
        if len(bad):
            raise DataError(f"{where}: the text tokenizes to id {int(bad[0])}, outside the model vocabulary "
                            f"({self.vocab}): the tokenizer does not fit the model config")
        n_img = sum(int(np.prod(g)) for _, g in images) // self.image_processor.merge_size ** 2
        n_vid = sum(int(np.prod(v.grid)) for v in videos) // self.video_processor.merge_size ** 2
        if int((toks == self.image_token_id).sum()) != n_img + n_vid:
            raise DataError(f"{where}: the rendered conversation holds {int((toks == self.image_token_id).sum())} "
                            f"image tokens, the media plan {n_img + n_vid}")
        tgt = np.zeros(len(toks), dtype=bool)
        tgt[:-1] = is_target[1:]
        n_media = int(in_media.sum())
        return ChatDocument(toks, tgt, images, videos, np.array([len(toks) - n_media, n_img, n_vid], dtype=np.int64))


# ------------------------------------------------------------------------------------------------ dataset
class PackedChatDataset(PackedVQADataset):
    """Map-style packed rows of one split of :class:`ChatDocuments` (packing as :class:`PackedVQADataset`).

    ``ds[i]``: ``tokens`` / ``labels`` [s] int64, ``loss_mask`` [s] float32, ``cu_seqlens`` [n_docs + 1] int32,
    with images ``pixel_values`` [patches, C*T*P*P] float32 and ``image_grid_thw`` [k, 3] int64, with videos
    ``pixel_values_videos`` [video_patches, C*T*P*P] float32 and ``video_grid_thw`` [v, 3] int64 (each in placeholder
    order over the row), ``skipped_documents`` [1] int64 (documents whose image or video could not be decoded when the
    row was read: they become padding, with a notice line naming the file) and ``modality_tokens`` [3] int64 (text,
    image and video tokens of the row's documents).
    """

    def summary(self) -> str:
        counts = sum((self.documents.modality_tokens[d] for r in self.rows for d in r), np.zeros(3, np.int64))
        return (super().summary().replace("packed VQA", "packed chat")
                + f"; tokens text {int(counts[0])}, image {int(counts[1])}, video {int(counts[2])}")

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        docs: ChatDocuments = self.documents
        return packed_row([docs.document(d) for d in self.rows[idx]], self.seq_length, self.pad_id,
                          docs.image_processor, docs.video_processor)


def packed_row(documents: Sequence[ChatDocument], seq_length: int, pad_id: int, image_processor, video_processor,
               skipped_before: int = 0) -> Dict[str, torch.Tensor]:
    """One packed row of ``documents`` (see :class:`PackedChatDataset` for the keys): their media decoded and
    processed by the image / video processors, grids checked against the plans. A document whose media cannot be
    decoded becomes padding (loss 0) with a notice line; ``skipped_documents`` counts them plus ``skipped_before``
    (documents a streamed source dropped before this row)."""
    from megatron_glm5.data.pack import assemble_row

    images: Dict[int, list] = {}
    videos: Dict[int, list] = {}
    skipped = set()
    for k, doc in enumerate(documents):
        try:
            images[k] = [ref.load() for ref, _ in doc.images]
            videos[k] = [v.ref.decode(v.metadata.frames_indices, v.metadata.width, v.metadata.height)
                         for v in doc.videos]
        except DataError as e:  # damaged media found mid-run: the document becomes padding, counted
            print(f"notice: {one_line(e)}: document skipped", flush=True)
            skipped.add(k)
    tokens = [np.full(len(doc.tokens), pad_id, np.int64) if k in skipped else doc.tokens
              for k, doc in enumerate(documents)]
    targets = [np.zeros(len(doc.tokens), bool) if k in skipped else doc.targets for k, doc in enumerate(documents)]
    out = assemble_row(tokens, targets, seq_length, pad_id)
    kept = [k for k in range(len(documents)) if k not in skipped]
    pil = [im for k in kept for im in images[k]]
    if pil:
        feats = image_processor(images=pil, return_tensors="pt")
        want = torch.tensor([g for k in kept for _, g in documents[k].images], dtype=torch.int64)
        grid = feats["image_grid_thw"].to(torch.int64)
        if not torch.equal(grid, want):
            raise DataError(f"the image processor made grids {grid.tolist()}, the plan {want.tolist()}")
        out["pixel_values"] = feats["pixel_values"].to(torch.float32)
        out["image_grid_thw"] = grid
    frames = [v for k in kept for v in videos[k]]
    if frames:
        metas = [v.metadata for k in kept for v in documents[k].videos]
        feats = video_processor(videos=frames, video_metadata=metas, do_sample_frames=False, return_tensors="pt")
        want = torch.tensor([v.grid for k in kept for v in documents[k].videos], dtype=torch.int64)
        grid = feats["video_grid_thw"].to(torch.int64)
        if not torch.equal(grid, want):
            raise DataError(f"the video processor made grids {grid.tolist()}, the plan {want.tolist()}")
        out["pixel_values_videos"] = feats["pixel_values_videos"].to(torch.float32)
        out["video_grid_thw"] = grid
    out["skipped_documents"] = torch.tensor([len(skipped) + int(skipped_before)], dtype=torch.int64)
    counts = sum((documents[k].modality_tokens for k in kept), np.zeros(3, np.int64))
    out["modality_tokens"] = torch.from_numpy(counts.astype(np.int64))
    return out
