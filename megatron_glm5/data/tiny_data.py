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


def make_vqa_webdataset(path: str, n: int, seed: int = 0) -> str:
    """A WebDataset tar of ``n`` samples ``NNNN.png`` + ``NNNN.json`` ({question, answer})."""
    with tarfile.open(path, "w") as tf:
        for i, (img, q, a) in enumerate(vqa_samples(n, seed)):
            for name, data in ((f"sample{i:04d}.png", _png(img)),
                               (f"sample{i:04d}.json", json.dumps({"question": q, "answer": a}).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path
