"""Convert an HF GLM-5.3 checkpoint (FP8 or BF16 safetensors) into a megatron-core torch_dist checkpoint.

The model is never materialised: a TP=PP=EP=1 model on the meta device gives the checkpoint structure
(:mod:`lazy_sources`), every tensor is read (mmap), dequantised, checked, fused, cast and written by parallel writer
threads (:mod:`dcp_save`), optionally in several processes (:mod:`workers`). Everything is validated before a
tensor is read (arguments, config, layout, every key, shape, dtype and FP8 scale grid, the tokenizer and processor
files); bad input raises a :class:`CheckpointError` (or ``Glm5ConfigError``) of one line.

Output, in Megatron-LM's layout of converted weights (what ``--pretrained-checkpoint OUT --finetune`` loads)::

    OUT/latest_checkpointed_iteration.txt   release
    OUT/release/                            .metadata + __*_*.distcp (torch DCP, megatron's common state included),
                                            metadata.json (megatron), hf_config.json (read by the exporter and the
                                            trainer's architecture check), conversion_info.json (its ``source`` is
                                            the HF folder), the HF folder's tokenizer / chat template / processor
                                            files (:mod:`hf_assets`), checksums.sha256 (covers them all)

OUT is published as a whole, atomically, under a lock (:mod:`atomic`).

A checkpoint whose config.json declares an MTP layer but which holds no MTP weights (what transformers'
``save_pretrained`` writes) converts without the MTP layer, with one notice; ``mtp_init=True`` instead starts a
freshly initialised MTP layer for training.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import time
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from megatron_glm5.checkpoint.atomic import atomic_output_dir
from megatron_glm5.checkpoint.checksums import write_manifest
from megatron_glm5.checkpoint.cpus import usable_cpus
from megatron_glm5.checkpoint.dcp_save import save_streaming
from megatron_glm5.errors import CheckpointError
from megatron_glm5.checkpoint.hf_assets import read_hf_assets, write_hf_assets
from megatron_glm5.checkpoint.hf_io import HFCheckpointReader, mtp_notice, validate_hf_checkpoint
from megatron_glm5.checkpoint.conversion_target import validate_layout
from megatron_glm5.checkpoint.lazy_sources import DTYPES, MTP_INIT_SEED, conversion_sources  # noqa: F401
from megatron_glm5.checkpoint.tracker import RELEASE, write_release_tracker
from megatron_glm5.checkpoint.workers import run_workers
from megatron_glm5.config import Glm5Config

HF_CONFIG_FNAME = "hf_config.json"
INFO_FNAME = "conversion_info.json"


class ConversionInputError(CheckpointError):
    """A bad argument detected before any tensor is read."""


def mtp_plan(cfg: Glm5Config, reader: HFCheckpointReader, mtp_init: bool) -> bool:
    """Whether the converted model has its MTP layer. Raises for ``mtp_init`` where it makes no sense."""
    declared = bool(cfg.mtp_num_layers)
    present = reader.has_mtp_weights(cfg.num_layers)
    if mtp_init and not declared:
        raise ConversionInputError("--mtp-init: config.json declares no MTP layer (num_nextn_predict_layers)")
    if mtp_init and present:
        raise ConversionInputError("--mtp-init: the checkpoint already holds MTP weights "
                                   f"(model.language_model.layers.{cfg.num_layers}.*)")
    return declared and (present or mtp_init)


def convert_hf_to_mcore(hf_dir: str, out_dir: str, dtype: str = "bf16", tp: int = 1, pp: int = 1, ep: int = 1,
                        workers: int = 1, progress: bool = True, overwrite: bool = False, threads: int = 2,
                        mtp_init: bool = False, log: Optional[Callable[[str], None]] = None,
                        pipeline_layout: Optional[str] = None, first_stage_layers: Optional[int] = None,
                        last_stage_layers: Optional[int] = None) -> Dict:
    """Convert ``hf_dir`` into a torch_dist checkpoint in Megatron-LM's release layout at ``out_dir``
    (``out_dir/latest_checkpointed_iteration.txt`` naming ``out_dir/release``); returns the ``conversion_info.json``
    dict.

    ``threads``: writer threads (files) per process. ``log``: where notices go (one line each)."""
    t0 = time.time()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if dtype not in DTYPES:
        raise ConversionInputError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    for name, v in (("workers", workers), ("threads", threads)):
        if not isinstance(v, int) or v < 1:
            raise ConversionInputError(f"--{name} must be a positive integer, got {v!r}")
    if not os.path.isdir(hf_dir):
        raise ConversionInputError(f"--hf-dir {hf_dir} is not a directory")
    if dist.is_initialized() and dist.get_world_size() != 1:
        raise ConversionInputError(f"the converter runs in one process (world size {dist.get_world_size()}); use "
                                   "--workers N for parallel conversion")
    out_dir = os.path.abspath(out_dir)
    torch_dtype = DTYPES[dtype]

    final_dir = os.path.join(out_dir, RELEASE)
    with atomic_output_dir(out_dir, inputs=[hf_dir], overwrite=overwrite, log=log) as root:
        validate_layout(hf_dir, tp, pp, ep, pipeline_layout, first_stage_layers, last_stage_layers)
        assets = read_hf_assets(hf_dir)
        tmp = os.path.join(root, RELEASE)
        os.mkdir(tmp)
        reader = HFCheckpointReader(hf_dir)
        try:
            cfg0 = Glm5Config.from_hf(hf_dir)
            mtp = mtp_plan(cfg0, reader, mtp_init)
            notice = mtp_notice(hf_dir, cfg0, reader, fresh=mtp_init)
            if notice and log is not None:
                log(notice + ("" if mtp_init else " (pass --mtp-init to start a fresh MTP layer for training)"))
            cfg, model, sources = conversion_sources(hf_dir, torch_dtype, mtp, mtp_init)
            report = validate_hf_checkpoint(hf_dir, reader, model, {k: s for k, s in sources.items()
                                                                    if s.fresh is None})
            total = sum(s.nbytes for s in sources.values())
            bar = None
            if progress:
                from tqdm import tqdm

                bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc="convert",
                           dynamic_ncols=True, smoothing=0.1)
            # the writer threads are the parallelism: torch's intra-op pool on top of them only oversubscribes
            intra = torch.get_num_threads()
            torch.set_num_threads(max(1, usable_cpus() // threads))
            try:
                if workers == 1:
                    stats = save_streaming(model, sources, reader, tmp, on_bytes=bar.update if bar else None,
                                           final_dir=final_dir, threads=threads)
                else:
                    del model
                    gc.collect()
                    stats = run_workers(workers, hf_dir, tmp, dtype, bar.update if bar else None, final_dir, mtp,
                                        mtp_init, threads)
            finally:
                torch.set_num_threads(intra)
                if bar is not None:
                    bar.close()
        finally:
            reader.close()
        with open(os.path.join(tmp, HF_CONFIG_FNAME), "w") as fh:
            json.dump(cfg.to_hf_dict(), fh, indent=2)
        asset_names = write_hf_assets(assets, tmp)
        disk = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
        info = {
            "source": os.path.abspath(hf_dir), "format": "torch_dist", "dtype": dtype,
            "layout": {"tp": tp, "pp": pp, "ep": ep, **{k: v for k, v in (
                ("pipeline_layout", pipeline_layout), ("first_stage_layers", first_stage_layers),
                ("last_stage_layers", last_stage_layers)) if v is not None}},
            "workers": workers, "threads": threads, "started": started,
            "seconds": round(time.time() - t0, 3),
            "write_seconds": round(stats["write_span"][1] - stats["write_span"][0], 3),
            "tensor_bytes": stats["bytes"], "checkpoint_bytes": disk,
            "num_tensors": len(sources), "hf_keys_skipped": report["skipped"], "mtp": mtp,
            "mtp_initialised": bool(mtp_init), "hf_assets": asset_names,
            "versions": {"torch": torch.__version__, "megatron_core": _mcore_version()},
        }
        with open(os.path.join(tmp, INFO_FNAME), "w") as fh:
            json.dump(info, fh, indent=2)
        write_manifest(tmp, known=stats["digests"])
        write_release_tracker(root)
    return info


def _mcore_version() -> str:
    try:
        from megatron.core import package_info

        return package_info.__version__
    except Exception:  # noqa: BLE001
        return "unknown"
