"""Write a tiny generated data set for CPU runs, examples and tests (no download):

    python tools/make_tiny_data.py --out DIR [--text-docs N] [--vqa-docs N] [--vocab-size V] [--seed S]

DIR/tokenizer.json      a byte-level BPE tokenizer (GLM special tokens <|endoftext|> <|user|> <|assistant|>)
DIR/text.jsonl          N {"text": ...} documents, and DIR/text_text_document.bin/.idx (tools/preprocess_data.py)
DIR/vqa/vqa.jsonl       N {"image", "question", "answer"} records with PNGs under DIR/vqa/images/
DIR/vqa.tar             the same samples as a WebDataset tar (NNNN.png + NNNN.json)
DIR/hf/                 the tiny preset's tokenizer with GLM's chat and multimodal tokens, a GLM-style
                        chat_template.jinja and the processor configs (--tokenizer-model for conversations)
DIR/chat/chat.jsonl     N conversations (messages form) with PNG images and mp4 / webm videos under DIR/chat/

DIR is written whole or not at all: everything goes into a temporary folder beside it, renamed to DIR when complete
(megatron_glm5.checkpoint.atomic). An existing DIR is refused unless it is an empty folder or --overwrite is given
(then it is replaced only once the new one is complete); errors are one ``make_tiny_data: error: ...`` line.

Then e.g. ``--tokenizer-model DIR --data-path DIR/text_text_document`` (text) or
``--dataset-type vqa --data-path DIR/vqa/vqa.jsonl`` (packed image+text) or ``--dataset-type chat --tokenizer-model
DIR/hf --data-path DIR/chat/chat.jsonl`` (conversations with images and videos, tiny preset). Keep --vocab-size
below the model's first image/video special id (250 in the tiny preset).
"""

from __future__ import annotations

import os
import sys

from megatron_glm5.cli import OneLineArgumentParser

PROG = "make_tiny_data"


def main(argv=None) -> int:
    p = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--text-docs", type=int, default=200, help="text documents (default 200)")
    p.add_argument("--vqa-docs", type=int, default=32, help="VQA records (default 32)")
    p.add_argument("--chat-docs", type=int, default=16, help="conversations (default 16)")
    p.add_argument("--vocab-size", type=int, default=200, help="tokenizer vocabulary (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace an existing DIR (once the new one is complete)")
    args = p.parse_args(argv)
    if args.text_docs < 1 or args.vqa_docs < 1 or args.chat_docs < 1:
        p.error("--text-docs, --vqa-docs and --chat-docs must be >= 1")
    if args.vocab_size < 1:
        p.error(f"--vocab-size must be positive, got {args.vocab_size}")
    if not 0 <= args.seed < 2**63:  # numpy's default_rng
        p.error(f"--seed must lie in [0, 2**63), got {args.seed}")
    from megatron_glm5.cli.common import quiet_library_warnings, run_cli

    quiet_library_warnings()
    return run_cli(PROG, lambda: _write(p, args), lean=True)  # no model code


def _write(p, args) -> int:
    from megatron_glm5.checkpoint.atomic import atomic_output_dir
    from megatron_glm5.cli import preprocess_data
    from megatron_glm5.config import tiny_hf_config
    from megatron_glm5.data.tiny_data import (make_chat_jsonl, make_text_jsonl, make_tiny_tokenizer, make_vqa_jsonl,
                                              make_vqa_webdataset, write_tiny_hf_assets)

    empty_dir = os.path.isdir(args.out) and not os.path.islink(args.out) and not os.listdir(args.out)
    with atomic_output_dir(args.out, overwrite=args.overwrite or empty_dir,
                           log=lambda m: print(f"{PROG}: {m}", file=sys.stderr)) as tmp:
        try:
            tok = make_tiny_tokenizer(tmp, vocab_size=args.vocab_size, seed=args.seed)
        except ValueError as e:
            p.error(f"--vocab-size: {e}")
        text = make_text_jsonl(os.path.join(tmp, "text.jsonl"), args.text_docs, seed=args.seed)
        rc = preprocess_data.main(["--input", text, "--tokenizer-model", tok, "--output-prefix",
                                   os.path.join(tmp, "text"), "--append-eod", "--log-interval", "0"],
                                  report=False)  # it names the temporary folder; the line below names the output
        if rc:
            raise SystemExit(rc)
        make_vqa_jsonl(os.path.join(tmp, "vqa"), args.vqa_docs, seed=args.seed)
        make_vqa_webdataset(os.path.join(tmp, "vqa.tar"), args.vqa_docs, seed=args.seed)
        os.makedirs(os.path.join(tmp, "hf"))
        write_tiny_hf_assets(os.path.join(tmp, "hf"), tiny_hf_config())
        make_chat_jsonl(os.path.join(tmp, "chat"), args.chat_docs, seed=args.seed)
    out = args.out
    print(f"{PROG}: wrote {os.path.join(out, 'tokenizer.json')}, {args.text_docs} text documents "
          f"({os.path.join(out, 'text_text_document')}) and {args.vqa_docs} VQA records "
          f"({os.path.join(out, 'vqa', 'vqa.jsonl')}, {os.path.join(out, 'vqa.tar')}), {args.chat_docs} "
          f"conversations ({os.path.join(out, 'chat', 'chat.jsonl')}, tokenizer and chat template in "
          f"{os.path.join(out, 'hf')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
