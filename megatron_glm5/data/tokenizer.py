"""The text tokenizer: an HF ``tokenizer.json`` (the file GLM checkpoints ship) loaded with HF ``tokenizers``.

``build_tokenizer(path)`` returns a :class:`Glm5Tokenizer` with the attributes megatron-core's datasets read
(``vocab_size``, ``eod``, ``pad``, ``unique_identifiers``), ``max_id`` (the largest id of the vocabulary, which
exceeds ``vocab_size - 1`` where ids are not dense) and ``tokenize`` / ``detokenize``.

End-of-document id (``eod``): the first of :data:`EOD_TOKENS` the vocabulary holds (GLM: ``<|endoftext|>``);
a tokenizer with none of them is refused. Padding id (``pad``): the first of :data:`PAD_TOKENS` present, else ``eod``
(megatron-core's GPTDataset then pads with an id that never occurs in the data; packed rows mask padding out).

No hub is reachable in tests, so :func:`train_tiny_tokenizer` trains a small byte-level BPE ``tokenizer.json``
with GLM's special tokens; it covers printable ASCII and newline (other characters are dropped when encoding).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Iterable, List, Sequence

from megatron_glm5.errors import one_line
from megatron_glm5.data import DataError

EOD_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
"""Candidate end-of-document tokens, in order of preference."""

PAD_TOKENS = ("<|pad|>", "<pad>", "[PAD]")
"""Candidate padding tokens, in order of preference (``eod`` when none is present)."""

TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|user|>", "<|assistant|>")
"""Special tokens of the tiny test tokenizer (GLM's names): ids 0, 1, 2."""


def _tokenizer_file(path: str) -> str:
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise DataError(f"--tokenizer-model: {path} not found (expected a tokenizer.json or a directory holding one)")
    return path


class Glm5Tokenizer:
    """An HF ``tokenizers.Tokenizer`` with megatron's tokenizer attributes.

    ``tokenize(text) -> list[int]`` adds no special tokens (no BOS); special-token strings inside ``text``
    (e.g. ``<|user|>``) map to their ids. ``detokenize(ids) -> str`` keeps special tokens.
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.path = _tokenizer_file(path)
        try:
            self._tok = Tokenizer.from_file(self.path)
        except Exception as e:  # tokenizers raises plain Exception subclasses with multi-line text
            raise DataError(f"--tokenizer-model: {self.path} is not a valid tokenizer.json "
                            f"({one_line(e)})") from None
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.max_id: int = max(vocab.values()) if vocab else -1
        """The largest id of the vocabulary (added tokens included): ids need not be dense, so it can exceed
        ``vocab_size - 1``."""
        found = [t for t in EOD_TOKENS if self._tok.token_to_id(t) is not None]
        if not found:
            raise DataError(f"--tokenizer-model: {self.path} has no end-of-document token (looked for "
                            f"{', '.join(EOD_TOKENS)})")
        self.eod_token: str = found[0]
        self.eod: int = self._tok.token_to_id(self.eod_token)
        pads = [t for t in PAD_TOKENS if self._tok.token_to_id(t) is not None]
        self.pad: int = self._tok.token_to_id(pads[0]) if pads else self.eod

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str):
        """The id of ``token`` or None."""
        return self._tok.token_to_id(token)

    @property
    def unique_identifiers(self) -> OrderedDict:
        """What identifies this tokenizer in megatron-core's dataset cache keys."""
        return OrderedDict([("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                            ("tokenizer_path", os.path.abspath(self.path)), ("vocab_size", self.vocab_size)])

    def __getstate__(self):  # DataLoader workers re-load from the file
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])


def build_tokenizer(tokenizer_model: str) -> Glm5Tokenizer:
    """Load ``tokenizer_model`` (a ``tokenizer.json`` or a directory holding one); :class:`DataError` if unusable."""
    return Glm5Tokenizer(tokenizer_model)


def train_tiny_tokenizer(texts: Iterable[str], out_path: str, vocab_size: int) -> str:
    """Train a byte-level BPE tokenizer on ``texts`` and write it as ``out_path`` (a tokenizer.json path).

    The vocabulary holds :data:`TINY_SPECIAL_TOKENS` (ids 0..2), the byte-level symbols of printable ASCII and
    newline, and merges learnt from ``texts`` up to ``vocab_size`` entries. Returns ``out_path``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    alphabet = [byte_level.pre_tokenize_str(chr(c))[0][0] for c in [10] + list(range(32, 127))]
    if vocab_size < len(TINY_SPECIAL_TOKENS) + len(alphabet):
        raise ValueError(f"vocab_size {vocab_size} < {len(TINY_SPECIAL_TOKENS) + len(alphabet)} "
                         f"(special tokens + byte alphabet)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(TINY_SPECIAL_TOKENS),
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(list(texts), trainer)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tok.save(out_path)
    return out_path
