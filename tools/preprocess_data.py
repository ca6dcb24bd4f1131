#!/usr/bin/env python
"""Tokenize a JSONL file into megatron-core indexed datasets (``PREFIX_KEY_document.bin`` / ``.idx``).

    python tools/preprocess_data.py --input IN.jsonl --json-keys text --tokenizer-model tokenizer.json \
        --output-prefix OUT/corpus [--append-eod] [--workers N] [--log-interval N]

Megatron-LM's flag names. Every line of IN.jsonl is one JSON object; the string under each ``--json-keys`` key is
one document, tokenized with the HF ``tokenizer.json`` (no BOS; ``--append-eod`` appends the tokenizer's
end-of-document id). A document that tokenizes to nothing (and has no EOD) is skipped and counted. The files are
written through megatron-core's ``IndexedDatasetBuilder`` (uint16 tokens when the vocabulary has < 65500 ids,
int32 otherwise) under temporary names and renamed only once complete.
On bad input (missing file, a line that is not a JSON object, a missing or non-string key, an unusable tokenizer)
it prints one ``preprocess_data: error: ...`` line, leaves no output behind and exits 2.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROG = "preprocess_data"


from megatron_glm5.cli import OneLineArgumentParser, one_line  # noqa: E402


class _Encoder:
    """Per-process tokenizer; ``encode((lineno, line))`` -> (lineno, {key: ids} or None, error or None, n bytes)."""

    def __init__(self, args):
        self.args = args

    def initializer(self):
        from megatron_glm5.data.tokenizer import build_tokenizer

        _Encoder.tokenizer = build_tokenizer(self.args.tokenizer_model)

    def encode(self, item):
        lineno, line = item
        where = f"{self.args.input}:{lineno}"
        if not line.strip():
            return lineno, None, f"{where}: empty line (expected a JSON object)", len(line)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            return lineno, None, f"{where}: bad JSON ({e.msg} at column {e.colno})", len(line)
        if not isinstance(record, dict):
            return lineno, None, f"{where}: expected a JSON object, got {type(record).__name__}", len(line)
        out = {}
        for key in self.args.json_keys:
            if key not in record:
                return lineno, None, f"{where}: missing key {key!r} (--json-keys)", len(line)
            if not isinstance(record[key], str):
                return lineno, None, f"{where}: {key!r} must be a string, got {type(record[key]).__name__}", len(line)
            ids = _Encoder.tokenizer.tokenize(record[key])
            if self.args.append_eod:
                ids.append(_Encoder.tokenizer.eod)
            out[key] = ids
        return lineno, out, None, len(line)


def _lines(path):
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            yield lineno, line


def preprocess(args) -> dict:
    """Write the indexed datasets; returns counts. Raises DataError on bad input (outputs removed)."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from megatron_glm5.data import DataError
    from megatron_glm5.data.tokenizer import build_tokenizer

    if not os.path.isfile(args.input):
        raise DataError(f"--input: {args.input} not found")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise DataError(f"--output-prefix: directory {out_dir} does not exist")
    if args.workers < 1:
        raise DataError(f"--workers must be >= 1, got {args.workers}")
    tokenizer = build_tokenizer(args.tokenizer_model)  # fails here, in the main process, with one line
    dtype = DType.optimal_dtype(tokenizer.vocab_size)

    final = {k: f"{args.output_prefix}_{k}_document" for k in args.json_keys}
    tmp = {k: f"{p}.tmp{os.getpid()}" for k, p in final.items()}
    builders = {}
    encoder = _Encoder(args)
    pool = None
    counts = {"documents": 0, "skipped_empty": 0, "tokens": 0, "bytes": 0}
    t0 = time.time()
    try:
        builders = {k: IndexedDatasetBuilder(tmp[k] + ".bin", dtype=dtype) for k in args.json_keys}
        if args.workers > 1:
            pool = multiprocessing.get_context("fork").Pool(args.workers, initializer=encoder.initializer)
            results = pool.imap(encoder.encode, _lines(args.input), chunksize=32)
        else:
            encoder.initializer()
            results = map(encoder.encode, _lines(args.input))
        for lineno, docs, err, nbytes in results:
            if err is not None:
                raise DataError(err)
            counts["bytes"] += nbytes
            for key, ids in docs.items():
                if not ids:
                    counts["skipped_empty"] += 1
                    continue
                builders[key].add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
                counts["tokens"] += len(ids)
            counts["documents"] += 1
            if args.log_interval > 0 and counts["documents"] % args.log_interval == 0:
                dt = max(time.time() - t0, 1e-9)
                print(f"{PROG}: processed {counts['documents']} documents ({counts['documents'] / dt:.0f} docs/s, "
                      f"{counts['bytes'] / dt / 1e6:.2f} MB/s)", file=sys.stderr, flush=True)
        if counts["documents"] == 0:
            raise DataError(f"--input: {args.input} holds no documents")
        for k, b in builders.items():
            b.finalize(tmp[k] + ".idx")
        for k in args.json_keys:
            for ext in (".bin", ".idx"):
                os.replace(tmp[k] + ext, final[k] + ext)
    except UnicodeDecodeError as e:
        raise DataError(f"--input: {args.input} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    finally:
        if pool is not None:
            pool.terminate()
        for k, b in builders.items():
            if not b.data_file.closed:
                b.data_file.close()
            for ext in (".bin", ".idx"):
                if os.path.exists(tmp[k] + ext):
                    os.remove(tmp[k] + ext)
    counts["seconds"] = time.time() - t0
    counts["outputs"] = [final[k] for k in args.json_keys]
    counts["dtype"] = numpy.dtype(dtype).name
    return counts


def main(argv=None) -> int:
    p = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (default: text)")
    p.add_argument("--tokenizer-model", required=True, help="HF tokenizer.json (or a directory holding one)")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_KEY_document.bin/.idx")
    p.add_argument("--append-eod", action="store_true", help="append the end-of-document id to every document")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    p.add_argument("--log-interval", type=int, default=10000, help="progress line every N documents (0: none)")
    args = p.parse_args(argv)

    import warnings

    warnings.filterwarnings("ignore", module=r"megatron\.")  # no Transformer Engine / Apex notices
    from megatron_glm5.data import DataError

    try:
        c = preprocess(args)
    except (DataError, OSError) as e:
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return 2
    print(f"{PROG}: wrote {c['documents']} documents ({c['tokens']} tokens, {c['dtype']}"
          + (f", {c['skipped_empty']} empty skipped" if c["skipped_empty"] else "")
          + f") to {', '.join(o + '.bin/.idx' for o in c['outputs'])} in {c['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
