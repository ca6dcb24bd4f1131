"""Export a megatron-core torch_dist checkpoint of GLM-5.3 to an HF checkpoint that transformers loads.

    python tools/convert_mcore_to_hf.py --load DIR --out DIR [--hf-config PATH] [--hf-assets DIR] [--fp8]
        [--shard-mb 5000] [--overwrite] [--no-progress]

--load        a ``dist_checkpointing`` (torch_dist) checkpoint of Glm5Model, saved at any TP/PP/EP layout: a
              Megatron-LM save folder (``latest_checkpointed_iteration.txt`` names the checkpoint to read,
              ``iter_NNNNNNN`` or ``release``; the converter's --out is one) or a checkpoint folder itself
--hf-config   the HF config.json of the model (default: ``hf_config.json`` in the checkpoint folder)
--hf-assets   an HF checkpoint folder to copy the tokenizer (tokenizer.json, tokenizer_config.json,
              special_tokens_map.json), chat template (chat_template.jinja / .json) and processor files
              (preprocessor_config.json, video_preprocessor_config.json, processor_config.json) from (default: those
              in the checkpoint folder: the converter's ``release`` carries its source's; a training save's
              ``iter_NNNNNNN`` has none, which is a notice)
--fp8         re-quantise the keys the release stores as block FP8 (e4m3 + 128x128 fp32 ``weight_scale_inv``)
              and add ``quantization_config`` to config.json
--shard-mb    output shard size in MiB (default 5000)

The checkpoint's ``.metadata`` is read with an unpickler that admits only torch's checkpoint-metadata classes, and
its ``checksums.sha256`` (when present) is verified first. The model is built on the meta device at TP=PP=EP=1 (no
memory) to map every checkpoint tensor onto its HF key(s) through the shared key table; then for each output shard
only the tensors it needs are read, checked finite, converted (fused gate/up split, BF16 with the fp32 islands in
fp32, optional FP8) and streamed to ``model-0000i-of-0000N.safetensors``, so memory stays about one output shard.
The tokenizer and processor files are checked (regular files inside their folder, bounded sizes, UTF-8, JSON
objects) and copied as read. The output appears complete or not at all (temporary sibling folder, lock, atomic
rename, its own checksum manifest); --overwrite never replaces an input. Bad input exits 2 with one
``convert_mcore_to_hf: error: ...`` line.
"""

from __future__ import annotations

import os
import sys

from megatron_glm5.cli.common import OneLineArgumentParser, quiet_library_warnings, run_cli, stderr_line

PROG = "convert_mcore_to_hf"


def parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="Megatron-LM save folder (with latest_checkpointed_iteration.txt) "
                   "or torch_dist checkpoint folder (iter_NNNNNNN / release)")
    p.add_argument("--out", required=True, help="output HF directory")
    p.add_argument("--hf-config", default=None, help="HF config.json (default: hf_config.json in the checkpoint "
                   "folder)")
    p.add_argument("--hf-assets", default=None, metavar="DIR",
                   help="HF folder to copy tokenizer / chat template / processor files from (default: the "
                        "checkpoint folder's)")
    p.add_argument("--fp8", action="store_true", help="block-FP8 e4m3 for the keys the release stores in FP8")
    p.add_argument("--shard-mb", type=float, default=5000.0, help="output shard size in MiB (default 5000)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out once the export is done")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _missing_input(a) -> str:
    """Why the inputs the flags name cannot be read ('' when they can)."""
    if not os.path.isdir(a.load):
        return f"--load {a.load}: no such directory"
    if a.hf_config is not None and not os.path.exists(a.hf_config):
        return f"--hf-config {a.hf_config}: not found"
    if a.hf_assets is not None and not os.path.isdir(a.hf_assets):
        return f"--hf-assets {a.hf_assets}: no such directory"
    return ""


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    missing = _missing_input(a)  # before torch is imported
    if missing:
        stderr_line(f"{PROG}: error: {missing}")
        return 2
    quiet_library_warnings()

    def body():
        from megatron_glm5.checkpoint.atomic import check_output_path
        from megatron_glm5.checkpoint.hf_export import ExportError, export_hf_checkpoint
        from megatron_glm5.checkpoint.tracker import resolve_checkpoint_dir
        from megatron_glm5.checkpoint.mcore_reader import check_torch_dist, find_hf_config

        load_dir = resolve_checkpoint_dir(a.load)
        check_output_path(a.out, [a.load, load_dir, a.hf_config, a.hf_assets], a.overwrite)
        check_torch_dist(load_dir)
        if a.hf_config is None and find_hf_config(load_dir) is None:
            raise ExportError(f"{load_dir}: hf_config.json not found (pass --hf-config PATH)")
        export_hf_checkpoint(load_dir, a.out, hf_config=a.hf_config, fp8=a.fp8, shard_mb=a.shard_mb,
                             overwrite=a.overwrite, progress=not a.no_progress, inputs=[a.load], log=stderr_line,
                             hf_assets=a.hf_assets)

    return run_cli(PROG, body, lean=True)  # reads a checkpoint: none of megatron-core's fusions run


if __name__ == "__main__":
    sys.exit(main())
