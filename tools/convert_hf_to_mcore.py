#!/usr/bin/env python
"""Convert an HF GLM-5.3 checkpoint (FP8 or BF16 safetensors) into a megatron-core torch_dist checkpoint.

    python tools/convert_hf_to_mcore.py --hf-dir DIR --out DIR [--tp N --pp N --ep N] [--dtype bf16|fp32]
        [--pipeline-model-parallel-layout STR | --decoder-first-pipeline-num-layers N
         --decoder-last-pipeline-num-layers N] [--workers N] [--overwrite] [--no-progress]

The model is built on the meta device and every tensor is read, dequantised (FP8), fused (gate/up), cast and
written one at a time, so memory stays at a few tensors. The output loads with
``megatron.core.dist_checkpointing.load(model.sharded_state_dict(), OUT)`` at any TP/PP/EP; --tp/--pp/--ep are
validated against the config (before any tensor is read) and recorded in OUT/conversion_info.json, with the
pipeline layout flags (Megatron-LM's names: uneven stages, e.g. the released 45 decoder layers + MTP at --pp 2
with --pipeline-model-parallel-layout 'Et*23|t*22mL'). OUT also holds hf_config.json (the HF config the exporter
writes back). OUT appears only once the checkpoint is complete.
On bad input (missing / unexpected / mis-shaped keys, a config.json that does not match the weights, a layout that
does not divide, NaN/inf after FP8 dequantisation) it prints one ``convert_hf_to_mcore: error: ...`` line and exits 2.
"""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_glm5.cli import OneLineArgumentParser, one_line  # noqa: E402

PROG = "convert_hf_to_mcore"


def main(argv=None) -> int:
    p = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--out", required=True, help="output torch_dist checkpoint directory (must not exist)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size to validate for (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size to validate for (default 1)")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size to validate for (default 1)")
    p.add_argument("--pipeline-model-parallel-layout", default=None, metavar="STR",
                   help="megatron pipeline layout to validate for, e.g. 'Ettt|ttmL' (E embedding, t decoder layer, "
                        "m MTP layer, L loss, | between stages)")
    p.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None, metavar="N",
                   help="decoder layers on the first pipeline stage (the rest split evenly)")
    p.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None, metavar="N",
                   help="decoder layers on the last pipeline stage (the rest split evenly)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                   help="dtype of the written tensors (fp32 islands stay fp32); default bf16")
    p.add_argument("--workers", type=int, default=1, help="conversion processes (default 1)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists (only once complete)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    # megatron-core's import- and config-time notices (no Transformer Engine / Apex, deprecations) are noise here
    warnings.filterwarnings("ignore", module=r"megatron\.")
    from megatron_glm5.checkpoint.mcore_writer import INPUT_ERRORS, convert_hf_to_mcore

    try:
        info = convert_hf_to_mcore(args.hf_dir, args.out, dtype=args.dtype, tp=args.tp, pp=args.pp, ep=args.ep,
                                   workers=args.workers, progress=not args.no_progress, overwrite=args.overwrite,
                                   pipeline_layout=args.pipeline_model_parallel_layout,
                                   first_stage_layers=args.decoder_first_pipeline_num_layers,
                                   last_stage_layers=args.decoder_last_pipeline_num_layers)
    except INPUT_ERRORS as e:
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return 2
    gb = info["checkpoint_bytes"] / 1e9
    rate = info["tensor_bytes"] / 1e6 / max(info["seconds"], 1e-9)
    print(f"{PROG}: wrote {info['num_tensors']} tensors ({gb:.2f} GB, {info['dtype']}) to {args.out} in "
          f"{info['seconds']:.1f} s ({rate:.0f} MB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
