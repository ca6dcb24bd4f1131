#!/usr/bin/env python
"""Write a tiny generated data set for CPU runs, examples and tests (no download):

    python tools/make_tiny_data.py --out DIR [--text-docs N] [--vqa-docs N] [--vocab-size V] [--seed S]

DIR/tokenizer.json      a byte-level BPE tokenizer (GLM special tokens <|endoftext|> <|user|> <|assistant|>)
DIR/text.jsonl          N {"text": ...} documents, and DIR/text_text_document.bin/.idx (tools/preprocess_data.py)
DIR/vqa/vqa.jsonl       N {"image", "question", "answer"} records with PNGs under DIR/vqa/images/
DIR/vqa.tar             the same samples as a WebDataset tar (NNNN.png + NNNN.json)

Then e.g. ``--tokenizer-model DIR --data-path DIR/text_text_document`` (text) or
``--dataset-type vqa --data-path DIR/vqa/vqa.jsonl`` (packed image+text). Keep --vocab-size below the model's first
image/video special id (250 in the tiny preset).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # preprocess_data

from megatron_glm5.cli import OneLineArgumentParser  # noqa: E402

PROG = "make_tiny_data"


def main(argv=None) -> int:
    p = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--text-docs", type=int, default=200, help="text documents (default 200)")
    p.add_argument("--vqa-docs", type=int, default=32, help="VQA records (default 32)")
    p.add_argument("--vocab-size", type=int, default=200, help="tokenizer vocabulary (default 200)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.text_docs < 1 or args.vqa_docs < 1:
        p.error("--text-docs and --vqa-docs must be >= 1")

    import preprocess_data
    from megatron_glm5.data.tiny_data import make_text_jsonl, make_tiny_tokenizer, make_vqa_jsonl, make_vqa_webdataset

    os.makedirs(args.out, exist_ok=True)
    try:
        tok = make_tiny_tokenizer(args.out, vocab_size=args.vocab_size, seed=args.seed)
    except ValueError as e:
        p.error(f"--vocab-size: {e}")
    text = make_text_jsonl(os.path.join(args.out, "text.jsonl"), args.text_docs, seed=args.seed)
    rc = preprocess_data.main(["--input", text, "--tokenizer-model", tok, "--output-prefix",
                               os.path.join(args.out, "text"), "--append-eod", "--log-interval", "0"])
    if rc:
        return rc
    make_vqa_jsonl(os.path.join(args.out, "vqa"), args.vqa_docs, seed=args.seed)
    make_vqa_webdataset(os.path.join(args.out, "vqa.tar"), args.vqa_docs, seed=args.seed)
    print(f"{PROG}: wrote {tok}, {args.text_docs} text documents ({os.path.join(args.out, 'text_text_document')}) "
          f"and {args.vqa_docs} VQA records ({os.path.join(args.out, 'vqa', 'vqa.jsonl')}, "
          f"{os.path.join(args.out, 'vqa.tar')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
