"""Tokenize a JSONL file into megatron-core indexed datasets (``PREFIX_KEY_document.bin`` / ``.idx``).

    python tools/preprocess_data.py --input IN.jsonl --json-keys text --tokenizer-model tokenizer.json \
        --output-prefix OUT/corpus [--append-eod] [--workers N] [--log-interval N]

Megatron-LM's flag names. Every line of IN.jsonl is one JSON object; the string under each ``--json-keys`` key is
one document, tokenized with the HF ``tokenizer.json`` (no BOS; ``--append-eod`` appends the tokenizer's
end-of-document id). A document that tokenizes to nothing (and has no EOD) is skipped and counted. The files are
written through megatron-core's ``IndexedDatasetBuilder`` (uint16 tokens when the tokenizer's largest id, its
end-of-document id included, is < 65499, int32 otherwise; ids need not be dense, so the entry count does not
decide) under temporary names beside them (``.NAME.bin.tmp-*``) and renamed into place only once
complete, the ``.idx`` last, under a lock on the prefix (a second run writing the same prefix is refused); the
temporaries of a killed run are removed by the next one. Existing outputs are never overwritten: the run is
refused before any work.
On bad input (missing file, a line that is not a JSON object, bad UTF-8, a lone surrogate, JSON nested too deeply,
a missing or non-string key, an unusable tokenizer, an existing output) it prints one
``preprocess_data: error: ...`` line, leaves no output behind and exits 2.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

from megatron_glm5.cli import OneLineArgumentParser, one_line

PROG = "preprocess_data"


class _Encoder:
    """Per-process tokenizer; ``encode((lineno, line))`` -> (lineno, {key: ids} or None, error or None, n bytes)."""

    def __init__(self, args):
        self.args = args

    def initializer(self):
        from megatron_glm5.data.tokenizer import build_tokenizer

        _Encoder.tokenizer = build_tokenizer(self.args.tokenizer_model)

    def encode(self, item):
        from megatron_glm5.data import DataError
        from megatron_glm5.data.jsonl import parse_json, text_field

        lineno, line = item
        where = f"{self.args.input}:{lineno}"
        if not line.strip():
            return lineno, None, f"{where}: empty line (expected a JSON object)", len(line)
        try:
            record = parse_json(line, where)
            texts = {key: text_field(record, key, where, " (--json-keys)") for key in self.args.json_keys}
        except DataError as e:
            return lineno, None, str(e), len(line)
        out = {}
        for key, text in texts.items():
            ids = _Encoder.tokenizer.tokenize(text)
            if self.args.append_eod:
                ids.append(_Encoder.tokenizer.eod)
            out[key] = ids
        return lineno, out, None, len(line)


def _lines(path):
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            yield lineno, line


def _output_paths(args) -> dict:
    return {k: f"{args.output_prefix}_{k}_document" for k in args.json_keys}


def _refuse_existing(args, final: dict) -> None:
    from megatron_glm5.checkpoint.atomic import check_output_path
    from megatron_glm5.data import DataError

    for p in final.values():
        for ext in (".bin", ".idx"):
            if os.path.lexists(p + ext):
                raise DataError(f"--output-prefix: {p + ext} already exists; remove it or choose another "
                                f"--output-prefix (outputs are never overwritten)")
            check_output_path(p + ext, [args.input, args.tokenizer_model], flag="--output-prefix", is_dir=False)


def preprocess(args) -> dict:
    """Write the indexed datasets; returns counts. Raises DataError on bad input (nothing written)."""
    import tempfile

    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from megatron_glm5.checkpoint.atomic import TMP_TAG, fsync_dir, output_lock, remove_stale_temporaries
    from megatron_glm5.data import DataError
    from megatron_glm5.data.tokenizer import build_tokenizer

    if not os.path.isfile(args.input):
        raise DataError(f"--input: {args.input} not found")
    if not os.path.basename(args.output_prefix):  # 'DIR/' would write DIR/_text_document.bin
        raise DataError(f"--output-prefix: {args.output_prefix} names a folder, not a file name prefix: give e.g. "
                        f"{os.path.join(args.output_prefix, 'corpus')}")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise DataError(f"--output-prefix: directory {out_dir} does not exist")
    if args.workers < 1:
        raise DataError(f"--workers must be >= 1, got {args.workers}")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise DataError(f"--json-keys: {' '.join(args.json_keys)} names a key twice")
    final = _output_paths(args)
    _refuse_existing(args, final)
    tokenizer = build_tokenizer(args.tokenizer_model)  # fails here, in the main process, with one line
    dtype = DType.optimal_dtype(max(tokenizer.max_id, tokenizer.eod) + 1)
    top = int(numpy.iinfo(dtype).max)  # every id written is checked against it: never a wrapped id

    builders = {}
    tmp = {}
    encoder = _Encoder(args)
    pool = None
    counts = {"documents": 0, "skipped_empty": 0, "tokens": 0, "bytes": 0}
    t0 = time.time()
    mask = os.umask(0o022)
    os.umask(mask)
    with output_lock(args.output_prefix, flag="--output-prefix"):
        _refuse_existing(args, final)  # again, under the lock
        for p in final.values():  # what a killed run of this prefix left
            for ext in (".bin", ".idx"):
                remove_stale_temporaries(p + ext, log=lambda m: print(f"{PROG}: {m}", file=sys.stderr))
        try:
            for k, p in final.items():
                for ext in (".bin", ".idx"):
                    fd, tmp[k + ext] = tempfile.mkstemp(prefix=f".{os.path.basename(p + ext)}{TMP_TAG}", dir=out_dir)
                    os.close(fd)
            builders = {k: IndexedDatasetBuilder(tmp[k + ".bin"], dtype=dtype) for k in args.json_keys}
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
                    if max(ids) > top or min(ids) < 0:
                        bad = max(ids) if max(ids) > top else min(ids)
                        raise DataError(f"{args.input}:{lineno}: token id {bad} does not fit the "
                                        f"{numpy.dtype(dtype).name} chosen from the tokenizer's largest id "
                                        f"{tokenizer.max_id}")
                    builders[key].add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
                    counts["tokens"] += len(ids)
                counts["documents"] += 1
                if args.log_interval > 0 and counts["documents"] % args.log_interval == 0:
                    dt = max(time.time() - t0, 1e-9)
                    print(f"{PROG}: processed {counts['documents']} documents ({counts['documents'] / dt:.0f} "
                          f"docs/s, {counts['bytes'] / dt / 1e6:.2f} MB/s)", file=sys.stderr, flush=True)
            if counts["documents"] == 0:
                raise DataError(f"--input: {args.input} holds no documents")
            for k, b in builders.items():
                b.finalize(tmp[k + ".idx"])
            for k in args.json_keys:  # the .idx last: a .bin without its .idx is never read
                for ext in (".bin", ".idx"):
                    with open(tmp[k + ext], "rb+") as f:
                        os.fsync(f.fileno())
                    os.chmod(tmp[k + ext], 0o666 & ~mask)
                    os.replace(tmp.pop(k + ext), final[k] + ext)
            fsync_dir(out_dir)
        except UnicodeDecodeError as e:
            raise DataError(f"--input: {args.input} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        finally:
            if pool is not None:
                pool.terminate()
            for k, b in builders.items():
                if not b.data_file.closed:
                    b.data_file.close()
            for path in tmp.values():
                if os.path.exists(path):
                    os.remove(path)
    counts["seconds"] = time.time() - t0
    counts["outputs"] = [final[k] for k in args.json_keys]
    counts["dtype"] = numpy.dtype(dtype).name
    return counts


def main(argv=None, report: bool = True) -> int:
    """The command line; returns the exit status. ``report=False``: no closing "wrote ..." line (a caller that
    writes into a temporary folder and renames it says what it wrote itself)."""
    p = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (default: text)")
    p.add_argument("--tokenizer-model", required=True, help="HF tokenizer.json (or a directory holding one)")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_KEY_document.bin/.idx")
    p.add_argument("--append-eod", action="store_true", help="append the end-of-document id to every document")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    p.add_argument("--log-interval", type=int, default=10000, help="progress line every N documents (0: none)")
    args = p.parse_args(argv)

    from megatron_glm5.cli.common import quiet_library_warnings

    quiet_library_warnings()  # no Transformer Engine / Apex / CUDA notices
    from megatron_glm5.errors import CheckpointError
    from megatron_glm5.cli.common import TRACEBACK_ENV
    from megatron_glm5.data import DataError

    try:
        c = preprocess(args)
    except (DataError, CheckpointError, OSError) as e:
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: error: interrupted (nothing written)", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - never a traceback on the console
        if os.environ.get(TRACEBACK_ENV):
            raise
        print(f"{PROG}: error: internal error: {type(e).__name__}: {one_line(e)} (set {TRACEBACK_ENV}=1 for the "
              f"traceback)", file=sys.stderr)
        return 1
    if not report:
        return 0
    print(f"{PROG}: wrote {c['documents']} documents ({c['tokens']} tokens, {c['dtype']}"
          + (f", {c['skipped_empty']} empty skipped" if c["skipped_empty"] else "")
          + f") to {', '.join(o + '.bin/.idx' for o in c['outputs'])} in {c['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
