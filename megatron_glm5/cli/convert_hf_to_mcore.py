"""Convert an HF GLM-5.3 checkpoint (FP8 or BF16 safetensors) into a megatron-core torch_dist checkpoint.

    python tools/convert_hf_to_mcore.py --hf-dir DIR --out DIR [--tp N --pp N --ep N] [--dtype bf16|fp32]
        [--pipeline-model-parallel-layout STR | --decoder-first-pipeline-num-layers N
         --decoder-last-pipeline-num-layers N] [--workers N] [--threads N] [--mtp-init] [--overwrite] [--no-progress]

The model is built on the meta device and every tensor is read (mmap), dequantised (FP8), checked (finite, scales
positive), fused (gate/up), cast and written by parallel writer threads, so memory stays at a few tensors. OUT is
in Megatron-LM's layout of converted weights: OUT/latest_checkpointed_iteration.txt says ``release`` and
OUT/release is the torch_dist checkpoint, so ``pretrain_glm5_vlm.py --pretrained-checkpoint OUT --finetune`` loads
it, as does ``megatron.core.dist_checkpointing.load(model.sharded_state_dict(), OUT/release)``, at any TP/PP/EP;
--tp/--pp/--ep are validated against the config (before any tensor is read) and recorded in
OUT/release/conversion_info.json (with the source folder). OUT/release also holds hf_config.json (the HF config the
exporter writes back), the source's tokenizer, chat template and processor files (checked, then copied; the
exporter carries them into the HF export) and checksums.sha256 (verified by every reader). OUT appears only once
complete; --overwrite replaces an existing OUT only then and never an input. A checkpoint whose config declares an
MTP layer but which holds no MTP weights (what transformers' save_pretrained writes) converts without MTP, with one
notice; --mtp-init starts a fresh MTP layer instead. Bad input prints one ``convert_hf_to_mcore: error: ...`` line and exits 2.
"""

from __future__ import annotations

import gc
import sys

from megatron_glm5.cli.common import OneLineArgumentParser, quiet_library_warnings, run_cli, stderr_line

PROG = "convert_hf_to_mcore"
# Writer threads by default: one per CPU up to this many (16-core host, realistic tensors, output in memory: 4 / 8 / 16
# threads wrote 845 / 1339 / 1455 MB/s of FP8 input; docs/performance.md).
MAX_DEFAULT_THREADS = 16


def default_writer_threads() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one), at most ``MAX_DEFAULT_THREADS``."""
    from megatron_glm5.checkpoint.cpus import usable_cpus

    return min(MAX_DEFAULT_THREADS, usable_cpus())


def parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--out", required=True, help="output Megatron-LM save folder (tracker + release/; must not exist)")
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
    threads = default_writer_threads()
    p.add_argument("--threads", type=int, default=threads,
                   help="writer threads (files) per process (default: the CPU count, at most "
                        f"{MAX_DEFAULT_THREADS}; here {threads})")
    p.add_argument("--mtp-init", action="store_true",
                   help="the checkpoint has no MTP weights but config.json declares MTP: write a freshly "
                        "initialised MTP layer (for training) instead of dropping it")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists (only once complete)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    quiet_library_warnings()
    from megatron_glm5.lean_import import import_megatron_without_compile

    if import_megatron_without_compile():  # first (run_cli imports megatron): no model code runs, 2 s less start-up
        gc.freeze()  # a fresh process: the imported objects are never garbage; full collections skip them (0.5 s)

    def body():
        from megatron_glm5.checkpoint.hf_to_mcore import convert_hf_to_mcore

        info = convert_hf_to_mcore(args.hf_dir, args.out, dtype=args.dtype, tp=args.tp, pp=args.pp, ep=args.ep,
                                   workers=args.workers, threads=args.threads, progress=not args.no_progress,
                                   overwrite=args.overwrite, mtp_init=args.mtp_init, log=stderr_line,
                                   pipeline_layout=args.pipeline_model_parallel_layout,
                                   first_stage_layers=args.decoder_first_pipeline_num_layers,
                                   last_stage_layers=args.decoder_last_pipeline_num_layers)
        gb = info["checkpoint_bytes"] / 1e9
        rate = info["tensor_bytes"] / 1e6 / max(info["seconds"], 1e-9)
        print(f"{PROG}: wrote {info['num_tensors']} tensors ({gb:.2f} GB, {info['dtype']}) to {args.out} in "
              f"{info['seconds']:.1f} s ({rate:.0f} MB/s)")

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
