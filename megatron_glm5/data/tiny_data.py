"""Small generated data for tests, examples and the quickstart (no hub is reachable): a tiny tokenizer, a text
JSONL corpus and a VQA set (PNG images + JSONL, and the same samples as a WebDataset tar).

Everything is deterministic in ``seed``. The VQA images are solid-colour canvases of a few sizes with a smaller
square of another colour; the question asks for the square's colour, so a model can learn the answers.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from typing import List, Tuple

import numpy as np

from megatron_glm5.data.tokenizer import train_tiny_tokenizer

WORDS = ("the", "a", "scan", "shows", "lesion", "in", "left", "right", "lung", "liver", "brain", "kidney", "normal",
         "mass", "of", "with", "no", "signs", "small", "large", "image", "patient", "chest", "is", "there")
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40),
           "white": (250, 250, 250), "black": (5, 5, 5)}
IMAGE_SIZES = ((40, 56), (64, 64), (90, 48), (30, 120))  # (height, width)


def tiny_texts(n: int, seed: int = 0, min_words: int = 4, max_words: int = 24) -> List[str]:
    """``n`` sentences of the :data:`WORDS` vocabulary."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(min_words, max_words + 1)))) + "."
            for _ in range(n)]


def vqa_samples(n: int, seed: int = 0) -> List[Tuple[np.ndarray, str, str]]:
    """``n`` (uint8 image [h, w, 3], question, answer) triples."""
    rng = np.random.default_rng(seed)
    names = list(COLOURS)
    out = []
    for i in range(n):
        h, w = IMAGE_SIZES[i % len(IMAGE_SIZES)]
        bg, fg = rng.choice(len(names), size=2, replace=False)
        img = np.empty((h, w, 3), dtype=np.uint8)
        img[:] = COLOURS[names[bg]]
        side = max(4, min(h, w) // 2)
        y, x = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
        img[y:y + side, x:x + side] = COLOURS[names[fg]]
        img = np.clip(img.astype(np.int16) + rng.integers(-8, 9, size=img.shape), 0, 255).astype(np.uint8)
        out.append((img, "what colour is the square in the image?", f"the square is {names[fg]}."))
    return out


def _png(img: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def make_tiny_tokenizer(out_dir: str, vocab_size: int = 200, seed: int = 0) -> str:
    """Train the tiny tokenizer on the text and VQA vocabularies; returns the tokenizer.json path."""
    texts = tiny_texts(200, seed) + [q + " " + a for _, q, a in vqa_samples(24, seed)]
    return train_tiny_tokenizer(texts, os.path.join(out_dir, "tokenizer.json"), vocab_size)


GLM_CHAT_TOKENS = ("[gMASK]", "<sop>", "<|system|>", "<|observation|>")
"""GLM's chat special tokens the tiny tokenizer of :func:`write_tiny_hf_assets` adds (``<|user|>`` and
``<|assistant|>`` are in :data:`~megatron_glm5.data.tokenizer.TINY_SPECIAL_TOKENS`)."""

GLM_CHAT_TEMPLATE = (
    "{%- macro visible_text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for item in content -%}"
    "{%- if item.type == 'video' or 'video' in item -%}<|begin_of_video|><|video|><|end_of_video|>"
    "{%- elif item.type == 'image' or 'image' in item -%}<|begin_of_image|><|image|><|end_of_image|>"
    "{%- elif item.type == 'text' -%}{{ item.text }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "[gMASK]<sop>"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|system|>\n{{ visible_text(m.content) }}"
    "{%- elif m.role == 'user' -%}<|user|>\n{{ visible_text(m.content) }}"
    "{%- elif m.role == 'assistant' -%}<|assistant|>\n{{ visible_text(m.content) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>\n{% endif %}")
"""A chat template in the style of GLM's released ones (``[gMASK]<sop>``, ``<|system|>`` / ``<|user|>`` /
``<|assistant|>`` turns with no end-of-turn token, images as ``<|begin_of_image|><|image|><|end_of_image|>``,
videos as ``<|begin_of_video|><|video|><|end_of_video|>``), for the tiny checkpoint and data (no hub is reachable)."""

# GLM-5.3's multimodal special tokens and the config fields holding their ids
MULTIMODAL_TOKENS = (("<|image|>", "image_token_id"), ("<|video|>", "video_token_id"),
                     ("<|begin_of_image|>", "image_start_token_id"), ("<|end_of_image|>", "image_end_token_id"),
                     ("<|begin_of_video|>", "video_start_token_id"), ("<|end_of_video|>", "video_end_token_id"))


def write_tiny_hf_assets(hf_dir: str, hf_config: dict) -> str:
    """What a released HF checkpoint ships beside its weights, for a tiny config: the generated tokenizer padded with
    reserved tokens up to the first multimodal id and GLM's multimodal tokens at the config's ids, its tokenizer
    config, a chat template and the image processor's config. Returns ``hf_dir``."""
    import json

    from tokenizers import AddedToken, Tokenizer

    ids = [int(hf_config[field]) for _, field in MULTIMODAL_TOKENS]
    if ids != list(range(ids[0], ids[0] + len(ids))):
        raise ValueError(f"the multimodal token ids {ids} are not consecutive")
    path = make_tiny_tokenizer(hf_dir, vocab_size=ids[0] - len(GLM_CHAT_TOKENS))
    tok = Tokenizer.from_file(path)
    n = tok.get_vocab_size(with_added_tokens=True)
    extra = [t for t in GLM_CHAT_TOKENS if tok.token_to_id(t) is None]
    if n + len(extra) > ids[0]:
        raise ValueError(f"no room for GLM's chat tokens below the first multimodal id {ids[0]}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra]
                           + [AddedToken(f"<|reserved_{i}|>", special=True, normalized=False)
                              for i in range(n + len(extra), ids[0])]
                           + [AddedToken(t, special=True, normalized=False) for t, _ in MULTIMODAL_TOKENS])
    tok.save(path)
    if [tok.token_to_id(t) for t, _ in MULTIMODAL_TOKENS] != ids:
        raise ValueError("the tiny tokenizer's multimodal tokens do not land on the config's ids")
    vision = hf_config.get("vision_config") or {}
    files = {
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                                  "pad_token": "<|endoftext|>"},
        "special_tokens_map.json": {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
        "preprocessor_config.json": {"image_processor_type": "Glm5NextImageProcessor",
                                     "processor_class": "Glm5NextProcessor",
                                     "patch_size": vision.get("patch_size", 14),
                                     "temporal_patch_size": vision.get("temporal_patch_size", 2),
                                     "merge_size": vision.get("spatial_merge_size", 2)},
        "processor_config.json": {"processor_class": "Glm5NextProcessor"},
    }
    for name, obj in files.items():
        with open(os.path.join(hf_dir, name), "w", encoding="utf-8") as fh:
            json.dump(obj, fh, indent=2)
    with open(os.path.join(hf_dir, "chat_template.jinja"), "w", encoding="utf-8") as fh:
        fh.write(GLM_CHAT_TEMPLATE)
    return hf_dir


def make_text_jsonl(path: str, n: int, seed: int = 0) -> str:
    """A JSONL of ``n`` ``{"text": ...}`` documents."""
    with open(path, "w", encoding="utf-8") as f:
        for t in tiny_texts(n, seed):
            f.write(json.dumps({"text": t}) + "\n")
    return path


def make_vqa_jsonl(out_dir: str, n: int, seed: int = 0) -> str:
    """``out_dir/vqa.jsonl`` + ``out_dir/images/NNNN.png`` (image paths relative to the JSONL)."""
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    path = os.path.join(out_dir, "vqa.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for i, (img, q, a) in enumerate(vqa_samples(n, seed)):
            rel = f"images/{i:04d}.png"
            with open(os.path.join(out_dir, rel), "wb") as g:
                g.write(_png(img))
            f.write(json.dumps({"image": rel, "question": q, "answer": a}) + "\n")
    return path


def make_vqa_webdataset(path: str, n: int, seed: int = 0, key_prefix: str = "sample") -> str:
    """A WebDataset tar of ``n`` samples ``{key_prefix}NNNN.png`` + ``{key_prefix}NNNN.json`` ({question, answer})."""
    with tarfile.open(path, "w") as tf:
        for i, (img, q, a) in enumerate(vqa_samples(n, seed)):
            for name, data in ((f"{key_prefix}{i:04d}.png", _png(img)),
                               (f"{key_prefix}{i:04d}.json", json.dumps({"question": q, "answer": a}).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


VIDEO_SIZES = ((48, 64), (56, 56))  # (height, width); even, as yuv420p needs


def video_samples(n: int, seed: int = 0, frames: int = 8) -> List[Tuple[np.ndarray, str, str]]:
    """``n`` (uint8 video [frames, h, w, 3], question, answer) triples: a solid background with a square of another
    colour moving left to right."""
    rng = np.random.default_rng([seed, 1])
    names = list(COLOURS)
    out = []
    for i in range(n):
        h, w = VIDEO_SIZES[i % len(VIDEO_SIZES)]
        bg, fg = rng.choice(len(names), size=2, replace=False)
        side = min(h, w) // 2
        y = int(rng.integers(0, h - side + 1))
        video = np.empty((frames, h, w, 3), dtype=np.uint8)
        video[:] = COLOURS[names[bg]]
        for t in range(frames):
            x = (w - side) * t // max(frames - 1, 1)
            video[t, y:y + side, x:x + side] = COLOURS[names[fg]]
        out.append((video, "what colour is the moving square?", f"the moving square is {names[fg]}."))
    return out


def write_video(path: str, video: np.ndarray, fps: int = 4) -> str:
    """Encode ``video`` (uint8 [frames, h, w, 3]) with PyAV: MPEG-4 Part 2 in ``.mp4``, VP8 in ``.webm``."""
    import av

    codec = "libvpx" if path.endswith(".webm") else "mpeg4"
    with av.open(path, mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = int(video.shape[2]), int(video.shape[1])
        stream.pix_fmt = "yuv420p"
        if codec == "mpeg4":
            stream.options = {"qscale": "2"}
        for frame in video:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def _encoded_video(video: np.ndarray, ext: str) -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = write_video(os.path.join(d, "v." + ext), video)
        with open(path, "rb") as f:
            return f.read()


def chat_records(n: int, seed: int = 0) -> List[Tuple[list, dict]]:
    """``n`` conversations (messages in the HF / OpenAI form, media items naming a file) and their media (encoded
    bytes by name), cycling through an image question with a follow-up turn, a video question (mp4 or webm), an
    image question with a system prompt, and a text-only exchange."""
    images = vqa_samples(n, seed)
    videos = video_samples(n, seed)
    texts = tiny_texts(n, seed)
    out = []
    for i in range(n):
        kind = i % 4
        if kind in (0, 2):
            img, q, a = images[i]
            name = f"{i:04d}.png"
            media = {name: _png(img)}
            messages = [{"role": "user", "content": [{"type": "image", "image": name}, {"type": "text", "text": q}]},
                        {"role": "assistant", "content": [{"type": "text", "text": a}]}]
            if kind == 0:
                messages += [{"role": "user", "content": "is the image large?"},
                             {"role": "assistant", "content": "no, the image is small."}]
            else:
                messages.insert(0, {"role": "system", "content": "answer with one short sentence."})
        elif kind == 1:
            video, q, a = videos[i]
            ext = "mp4" if i % 8 == 1 else "webm"
            name = f"{i:04d}.{ext}"
            media = {name: _encoded_video(video, ext)}
            messages = [{"role": "user", "content": [{"type": "video", "video": name}, {"type": "text", "text": q}]},
                        {"role": "assistant", "content": a}]
        else:
            media = {}
            messages = [{"role": "user", "content": "say something about a scan."},
                        {"role": "assistant", "content": texts[i]}]
        out.append((messages, media))
    return out


def _renamed(messages: list, names: dict) -> list:
    out = []
    for m in messages:
        c = m["content"]
        if isinstance(c, list):
            c = [dict(it, **{it["type"]: names[it[it["type"]]]}) if it["type"] in ("image", "video") else it
                 for it in c]
        out.append(dict(m, content=c))
    return out


def make_chat_jsonl(out_dir: str, n: int, seed: int = 0) -> str:
    """``out_dir/chat.jsonl``: the ``n`` conversations of :func:`chat_records`, images under ``out_dir/images/``,
    videos under ``out_dir/videos/`` (paths relative to the JSONL)."""
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    os.makedirs(os.path.join(out_dir, "videos"), exist_ok=True)
    path = os.path.join(out_dir, "chat.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for messages, media in chat_records(n, seed):
            names = {}
            for name, data in media.items():
                names[name] = ("images/" if name.endswith(".png") else "videos/") + name
                with open(os.path.join(out_dir, names[name]), "wb") as g:
                    g.write(data)
            f.write(json.dumps({"messages": _renamed(messages, names)}) + "\n")
    return path


def make_chat_webdataset(path: str, n: int, seed: int = 0, key_prefix: str = "chat") -> str:
    """A WebDataset tar of the ``n`` conversations of :func:`chat_records`: per sample ``KEY.json``
    (``{"messages": ...}``, media items naming a part, e.g. ``"0.png"``) and ``KEY.0.png`` / ``KEY.0.mp4`` ...
    (the layout an Energon ``CrudeWebdataset`` of multi-turn conversations holds)."""
    with tarfile.open(path, "w") as tf:
        for i, (messages, media) in enumerate(chat_records(n, seed)):
            key = f"{key_prefix}{i:04d}"
            names = {name: f"{k}.{name.rsplit('.', 1)[-1]}" for k, name in enumerate(media)}
            members = [(f"{key}.json", json.dumps({"messages": _renamed(messages, names)}).encode())]
            members += [(f"{key}.{names[name]}", data) for name, data in media.items()]
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path
