"""Command-line arguments of ``pretrain_glm5_vlm.py``, with Megatron-LM's flag names and meanings.

``parse_args`` parses and validates; a bad value or combination ends the program before any work with one line
``<prog>: error: --flag: reason`` on stderr and exit status 2. ``model_config_from_args`` turns the model flags
(``--hf-config DIR`` or ``--model-preset``) plus the parallel / precision / recompute / MoE / MTP flags into a
:class:`~megatron_glm5.config.Glm5Config`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from megatron_glm5.cli import OneLineArgumentParser, one_line

PROG = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "pretrain_glm5_vlm.py"
MODEL_PRESETS = ("glm5-flash", "glm5-tiny")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")


class ArgumentError(ValueError):
    """A bad flag value or combination: ``flag`` names the flag, the message says why."""

    def __init__(self, flag: str, reason: str):
        super().__init__(f"{flag}: {reason}")
        self.flag = flag


def fail(message: str, prog: str = PROG) -> None:
    """Print one error line and exit 2 (what every user-facing failure of the training entry does)."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    raise SystemExit(2)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog=prog, description="Pretrain / fine-tune GLM-5.3-Flash (text and image+text) on megatron-core.",
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    g = p.add_argument_group("model")
    g.add_argument("--hf-config", help="HF checkpoint dir or config.json giving the architecture")
    g.add_argument("--model-preset", choices=MODEL_PRESETS, help="built-in architecture instead of --hf-config")
    g.add_argument("--num-layers", type=int, help="override the number of decoder layers (a prefix of the schedule)")
    from megatron_glm5.config import DSA_BACKENDS, KDA_BACKENDS, MOE_EXPERTS_BACKENDS

    g.add_argument("--kda-backend", choices=KDA_BACKENDS,
                   help="KDA kernel (default: fla_fused on CUDA with flash-linear-attention, torch otherwise)")
    g.add_argument("--dsa-backend", choices=DSA_BACKENDS,
                   help="sparse-attention kernel (default: fused on CUDA with triton, torch otherwise)")
    g.add_argument("--moe-experts-backend", choices=MOE_EXPERTS_BACKENDS,
                   help="routed experts (default: grouped on CUDA, sequential on CPU)")
    g.add_argument("--moe-cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="run the MoE layers as replayed CUDA graphs where eligible (default: on with CUDA; they "
                        "run eagerly under EP/TP/CP > 1, aux or z-loss, token dropping or recompute)")
    g.add_argument("--kda-save-intermediates", action=argparse.BooleanOptionalAction, default=None,
                   help="fla_fused KDA: keep chunk_kda's forward intermediates for the backward instead of recomputing "
                        "them (default: on with fla_fused; ~0.57 GiB more per KDA layer per 4K tokens)")
    g.add_argument("--freeze-vision", action="store_true", help="do not train the vision tower")
    g.add_argument("--init-method-std", type=float, default=None,
                   help="std of the random init (default: the config's initializer_range)")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--pipeline-model-parallel-layout", type=str, default=None,
                   help="megatron-core layout string, e.g. 'Et*3|t*2L' (E=embedding, t=layer, m=MTP, L=loss)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="default: the tensor-model-parallel size")
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x data parallel")
    g.add_argument("--seq-length", type=int, default=None, help="tokens per sample (required)")
    g.add_argument("--train-iters", type=int, default=None, help="optimizer steps (required)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true", help="bf16 model under megatron's Float16Module, fp32 master")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="average the loss over all loss tokens of the global batch (not per micro batch)")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--max-consecutive-skipped-iterations", type=int, default=5,
                   help="stop after this many iterations in a row with a NaN/inf loss or grad norm")
    g.add_argument("--inject-nan-at-iteration", type=int, nargs="*", default=[],
                   help="testing aid: make the loss NaN at these iterations (they must be skipped)")

    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (required)")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="cosine")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-style", choices=("exponential", "linear", "cosine", "minus_sqrt"),
                   default="exponential")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--torch-fused-adam", action="store_true",
                   help="megatron-core without Transformer Engine or Apex falls back to torch's Adam in its foreach "
                        "form (a pass over the fp32 master weights and moments per operation): run torch's fused "
                        "Adam kernel instead (one pass)")

    g = p.add_argument_group("MoE and MTP")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="coefficient of the sequence-level load-balancing loss (0: none)")
    g.add_argument("--moe-router-load-balancing-type", choices=("seq_aux_loss", "aux_loss", "none"), default=None,
                   help="default: seq_aux_loss when --moe-aux-loss-coeff > 0, else none")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="aux-loss-free expert-bias update rate (once per optimizer step; 0 disables)")
    g.add_argument("--mtp-num-layers", type=int, default=None, help="default: the config's num_nextn_predict_layers")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1)

    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true", help="synthetic token data (smoke runs)")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="[weight] prefix ... of indexed datasets (.bin/.idx), or JSONL / WebDataset tar files with "
                        "--dataset-type vqa")
    g.add_argument("--dataset-type", choices=("gpt", "vqa"), default="gpt",
                   help="gpt: indexed text; vqa: packed image+text SFT from {image, question, answer} records")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--tokenizer-model", help="tokenizer.json (or a dir holding it)")
    g.add_argument("--num-workers", type=int, default=0, help="data-loader worker processes")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", help="checkpoint directory to write (iter_XXXXXXX/ + latest_checkpointed_iteration.txt)")
    g.add_argument("--load", help="checkpoint directory to resume from")
    g.add_argument("--pretrained-checkpoint", help="weights to start from when --load holds no checkpoint")
    g.add_argument("--finetune", action="store_true",
                   help="load model weights only (iteration 0, fresh optimizer, scheduler and data position)")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--test-kill-during-save", type=int, default=None, help=argparse.SUPPRESS)  # fault injection

    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=0)
    g.add_argument("--exit-interval", type=int, default=None, help="exit after this iteration (saving first)")
    return p


def _require(cond: bool, flag: str, reason: str) -> None:
    if not cond:
        raise ArgumentError(flag, reason)


def _data_files(args) -> List[str]:
    """The paths of --data-path without blend weights."""
    out = []
    for item in args.data_path or []:
        try:
            float(item)
        except ValueError:
            out.append(item)
    return out


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Fill derived values (data-parallel size, default global batch, ...) and check every combination; raises
    :class:`ArgumentError` naming the flag."""
    _require(bool(args.hf_config) != bool(args.model_preset), "--hf-config",
             "give exactly one of --hf-config DIR and --model-preset")
    if args.hf_config:
        path = args.hf_config
        cfg = os.path.join(path, "config.json") if os.path.isdir(path) else path
        _require(os.path.isfile(cfg), "--hf-config", f"no config.json at {path}")
    for flag in ("micro_batch_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "expert_model_parallel_size", "context_parallel_size", "log_interval"):
        _require(getattr(args, flag) >= 1, "--" + flag.replace("_", "-"), "must be >= 1")
    _require(args.seq_length is not None and args.seq_length >= 2, "--seq-length", "required, >= 2")
    _require(args.train_iters is not None and args.train_iters >= 1, "--train-iters", "required, >= 1")
    _require(args.lr is not None and args.lr >= 0, "--lr", "required, >= 0")
    _require(0 <= args.min_lr <= args.lr, "--min-lr", f"must lie in [0, --lr={args.lr}]")
    _require(args.lr_warmup_iters >= 0, "--lr-warmup-iters", "must be >= 0")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    _require(args.lr_warmup_iters < args.lr_decay_iters, "--lr-warmup-iters",
             f"{args.lr_warmup_iters} must be below the decay iterations ({args.lr_decay_iters}; --lr-decay-iters "
             f"defaults to --train-iters)")
    if args.lr_decay_style == "WSD":
        _require(args.lr_wsd_decay_iters is not None, "--lr-wsd-decay-iters", "required with --lr-decay-style WSD")
    _require(0.0 <= args.adam_beta1 < 1.0, "--adam-beta1", "must lie in [0, 1)")
    _require(0.0 <= args.adam_beta2 < 1.0, "--adam-beta2", "must lie in [0, 1)")
    _require(args.clip_grad >= 0.0, "--clip-grad", "must be >= 0")
    _require(args.weight_decay >= 0.0, "--weight-decay", "must be >= 0")
    _require(args.max_consecutive_skipped_iterations >= 1, "--max-consecutive-skipped-iterations", "must be >= 1")

    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    _require(world_size % (tp * pp * cp) == 0, "--tensor-model-parallel-size",
             f"world size {world_size} is not divisible by TP {tp} x PP {pp} x CP {cp}")
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * pp * cp)
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    _require(world_size % (etp * ep * pp) == 0, "--expert-model-parallel-size",
             f"world size {world_size} is not divisible by ETP {etp} x EP {ep} x PP {pp}")
    if tp == 1 and args.sequence_parallel:
        args.sequence_parallel = False  # Megatron-LM: sequence parallelism needs TP > 1
    if args.num_layers_per_virtual_pipeline_stage is not None:
        _require(pp > 1, "--num-layers-per-virtual-pipeline-stage", "needs --pipeline-model-parallel-size > 1")
    _require(not (args.pipeline_model_parallel_layout and (args.decoder_first_pipeline_num_layers is not None
                                                           or args.decoder_last_pipeline_num_layers is not None)),
             "--pipeline-model-parallel-layout", "give either a layout or --decoder-first/last-pipeline-num-layers")

    # megatron-core 0.16.1's non-distributed bf16 optimizer pairs fp32 master weights with the wrong parameters in
    # its checkpoints when the model has fp32 parameters (the fp32 islands); the distributed optimizer is right
    _require(not args.bf16 or args.use_distributed_optimizer, "--bf16",
             "needs --use-distributed-optimizer (fp32 master weights of a model with fp32 islands)")
    dp, mbs = args.data_parallel_size, args.micro_batch_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    _require(args.global_batch_size >= 1 and args.global_batch_size % (mbs * dp) == 0, "--global-batch-size",
             f"{args.global_batch_size} is not divisible by micro batch {mbs} x data parallel {dp}")

    # data
    files = _data_files(args)
    _require(args.mock_data or files, "--data-path", "give --data-path or --mock-data")
    _require(not (args.mock_data and files), "--mock-data", "give either --mock-data or --data-path, not both")
    if files:
        for f in files:
            if args.dataset_type == "gpt":
                for ext in (".bin", ".idx"):
                    _require(os.path.isfile(f + ext), "--data-path", f"missing data file {f + ext}")
            else:
                _require(os.path.exists(f), "--data-path", f"missing data file {f}")
        _require(bool(args.tokenizer_model), "--tokenizer-model", "required with --data-path")
    if args.tokenizer_model:
        tok = args.tokenizer_model
        tok_file = os.path.join(tok, "tokenizer.json") if os.path.isdir(tok) else tok
        _require(os.path.isfile(tok_file), "--tokenizer-model", f"no tokenizer.json at {tok}")
    split = [s for s in args.split.replace("/", ",").split(",") if s.strip()]
    try:
        split_vals = [float(s) for s in split]
    except ValueError:
        split_vals = []
    _require(1 <= len(split_vals) <= 3 and all(v >= 0 for v in split_vals) and sum(split_vals) > 0, "--split",
             f"expected up to three non-negative weights like 969,30,1, got {args.split!r}")

    # evaluation / checkpoints
    if args.eval_interval is not None:
        _require(args.eval_interval >= 1, "--eval-interval", "must be >= 1")
        _require(args.eval_iters >= 1, "--eval-iters", "must be >= 1 with --eval-interval")
    if args.save_interval is not None:
        _require(args.save_interval >= 1, "--save-interval", "must be >= 1")
        _require(bool(args.save), "--save-interval", "needs --save")
    if args.finetune:
        _require(bool(args.load or args.pretrained_checkpoint), "--finetune", "needs --load or --pretrained-checkpoint")
    for flag in ("load", "pretrained_checkpoint"):
        path = getattr(args, flag)
        if path:
            _require(os.path.isdir(path), "--" + flag.replace("_", "-"), f"no checkpoint directory at {path}")
    if args.save and os.path.exists(args.save):
        _require(os.path.isdir(args.save), "--save", f"{args.save} exists and is not a directory")
    _check_checkpoints(args)
    _require(args.moe_aux_loss_coeff >= 0, "--moe-aux-loss-coeff", "must be >= 0")
    _require(args.moe_router_bias_update_rate >= 0, "--moe-router-bias-update-rate", "must be >= 0")
    if args.mtp_num_layers is not None:
        _require(args.mtp_num_layers >= 0, "--mtp-num-layers", "must be >= 0")
    if args.moe_router_load_balancing_type is None:
        args.moe_router_load_balancing_type = "seq_aux_loss" if args.moe_aux_loss_coeff > 0 else "none"
    if args.moe_router_load_balancing_type != "none":
        _require(args.moe_aux_loss_coeff > 0, "--moe-aux-loss-coeff",
                 f"must be > 0 with --moe-router-load-balancing-type {args.moe_router_load_balancing_type}")
    if args.recompute_method is not None:
        _require(args.recompute_granularity == "full", "--recompute-method", "needs --recompute-granularity full")
        _require(args.recompute_num_layers is not None and args.recompute_num_layers >= 1, "--recompute-num-layers",
                 "required (>= 1) with --recompute-method")


def _check_checkpoints(args) -> None:
    """--load / --pretrained-checkpoint: a readable checkpoint (or none yet, for --load) of this architecture."""
    from megatron_glm5.training.checkpointing import CheckpointError, check_architecture, resolve_load_dir

    for flag in ("load", "pretrained_checkpoint"):
        root = getattr(args, flag)
        if not root:
            continue
        name = "--" + flag.replace("_", "-")
        try:
            ckpt, _ = resolve_load_dir(root)
            if ckpt is None and flag == "pretrained_checkpoint":
                raise CheckpointError(f"no checkpoint in {root}")
            if ckpt is not None:
                check_architecture(ckpt, hf_config_dict(args))
        except CheckpointError as e:
            raise ArgumentError(name, str(e)) from None


def hf_config_dict(args) -> dict:
    """The HF config.json dict of the architecture the flags name (``--num-layers`` keeps a prefix of the layer
    schedules)."""
    from megatron_glm5.config import glm5_flash_hf_config, tiny_hf_config

    if args.model_preset == "glm5-flash":
        hf = glm5_flash_hf_config()
    elif args.model_preset == "glm5-tiny":
        hf = tiny_hf_config(mtp=True)
    else:
        path = args.hf_config
        with open(os.path.join(path, "config.json") if os.path.isdir(path) else path) as fh:
            hf = json.load(fh)
    if args.num_layers is not None:
        text = dict(hf.get("text_config", hf))
        for key in ("layer_types", "mlp_layer_types", "indexer_types", "index_topk_pattern"):
            if isinstance(text.get(key), list):
                text[key] = text[key][:args.num_layers]
        text["num_hidden_layers"] = args.num_layers
        hf = {**hf, "text_config": text} if "text_config" in hf else text
    return hf


def model_config_from_args(args, device: str):
    """The Glm5Config of this run: architecture from --hf-config / --model-preset, everything else from flags."""
    import torch

    from megatron_glm5.config import Glm5Config
    from megatron_glm5.models.builder import default_backends

    hf = hf_config_dict(args)
    text = hf.get("text_config", hf)
    mtp_layers = args.mtp_num_layers
    if mtp_layers is None:
        mtp_layers = int(text.get("num_nextn_predict_layers", 0) or 0)
    backends = default_backends(device)
    overrides = dict(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        bf16=args.bf16,
        params_dtype=torch.float32,
        pipeline_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_cpu_initialization=(device == "cpu"),
        perform_initialization=True,
        calculate_per_token_loss=args.calculate_per_token_loss,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        mtp_num_layers=mtp_layers or None,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        kda_backend=args.kda_backend or backends["kda_backend"],
        dsa_backend=args.dsa_backend or backends["dsa_backend"],
        moe_experts_backend=args.moe_experts_backend or backends["moe_experts_backend"],
        moe_cuda_graph=backends["moe_cuda_graph"] if args.moe_cuda_graph is None else args.moe_cuda_graph,
        kda_save_intermediates=(backends.get("kda_save_intermediates", False) if args.kda_save_intermediates is None
                                else args.kda_save_intermediates),
    )
    if args.num_layers_per_virtual_pipeline_stage is not None:
        overrides["num_layers_per_virtual_pipeline_stage"] = args.num_layers_per_virtual_pipeline_stage
    if args.pipeline_model_parallel_layout:
        overrides["pipeline_model_parallel_layout"] = args.pipeline_model_parallel_layout
    if args.decoder_first_pipeline_num_layers is not None:
        overrides["num_layers_in_first_pipeline_stage"] = args.decoder_first_pipeline_num_layers
    if args.decoder_last_pipeline_num_layers is not None:
        overrides["num_layers_in_last_pipeline_stage"] = args.decoder_last_pipeline_num_layers
    std = args.init_method_std if args.init_method_std is not None else text.get("initializer_range")
    if std is not None:
        overrides["init_method_std"] = float(std)
    return Glm5Config.from_hf(hf, **overrides)


def parse_args(argv: Optional[List[str]] = None, world_size: Optional[int] = None,
               prog: str = PROG) -> argparse.Namespace:
    """Parse and validate; on a bad flag print one line and exit 2."""
    args = build_parser(prog).parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        validate_args(args, world_size)
    except ArgumentError as e:
        fail(str(e), prog)
    return args
