"""Command-line arguments of ``pretrain_glm5_vlm.py``: Megatron-LM's own parser (``megatron.training.arguments``)
plus the GLM-5.3 flags of :func:`add_glm5_arguments`, handed to it as its ``extra_args_provider``.

Every Megatron-LM flag keeps Megatron-LM's name, meaning and default. The architecture flags Megatron-LM requires
(``--num-layers``, ``--hidden-size``, ``--num-attention-heads``, ``--num-experts``, ``--mtp-num-layers``, ...) default
to the values of the ``--hf-config`` / ``--model-preset`` architecture (:func:`architecture_defaults`, passed as
Megatron-LM's ``args_defaults``); giving one that contradicts the architecture is refused. A bad value or
combination ends the program before any work with one line ``<prog>: error: <reason>`` and exit status 2
(:func:`parse_args`), Megatron-LM's own checks included.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import sys
from typing import Dict, List, NamedTuple, NoReturn, Optional

from megatron_glm5.errors import ArgumentError, one_line

PROG = "pretrain_glm5_vlm.py"
MODEL_PRESETS = ("glm5-flash", "glm5-tiny")


def print_line(line: str) -> None:
    """Write ``line`` to stderr as one line; characters stderr cannot encode (a lone surrogate from a file name or
    a config value) are written as backslash escapes."""
    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
    sys.stderr.write(line.encode(encoding, "backslashreplace").decode(encoding) + "\n")
    sys.stderr.flush()


# how long a rank other than 0 waits for rank 0 to report an error that every rank hit, before reporting it itself
RANK0_GRACE_S = 30.0


def exit_with_line(line: str, code: int, every_rank_hit_it: bool = False) -> NoReturn:
    """End this process with exit status ``code`` and ``line`` on stderr, said once for all ranks of a run.

    Rank 0 (``$RANK``; a process outside a launcher is rank 0) prints the line, immune to the launcher's SIGTERM and a
    second Ctrl-C meanwhile. Another rank stays silent: at once when ``every_rank_hit_it`` (Ctrl-C reaches them all);
    otherwise it waits up to :data:`RANK0_GRACE_S` seconds, in which a launcher ends it once rank 0 has exited
    (torchrun stops every rank when one fails), and one still running after that hit the error on its own and prints
    the line itself."""
    import signal
    import time

    rank0 = os.environ.get("RANK", "0") == "0"
    saved = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            saved[sig] = signal.signal(sig, signal.SIG_IGN if rank0 else signal.SIG_DFL)
        except ValueError:  # not the main thread
            pass
    if not rank0:
        if every_rank_hit_it:
            raise SystemExit(code)
        time.sleep(RANK0_GRACE_S)
    print_line(line)
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    raise SystemExit(code)


def fail(message: str, prog: str = PROG) -> NoReturn:
    """One error line (from rank 0) and exit 2: what every argument error of the training entry does."""
    exit_with_line(f"{prog}: error: {one_line(message)}", 2)


def _require(cond: bool, flag: str, reason: str) -> None:
    if not cond:
        raise ArgumentError(flag, reason)


# ---------------------------------------------------------------------------- numeric flags
class Bound(NamedTuple):
    """The values a numeric flag accepts: ``lo`` / ``hi`` (None: unbounded), each inclusive unless ``*_open``."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False

    def admits(self, v: float) -> bool:
        return ((self.lo is None or (v > self.lo if self.lo_open else v >= self.lo))
                and (self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)))

    def __str__(self) -> str:
        lo, hi = (f"{v:g}" if isinstance(v, float) else v for v in (self.lo, self.hi))
        if self.hi is None:
            return f"must be {'>' if self.lo_open else '>='} {lo}"
        return f"must lie in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"


_POSITIVE = Bound(1)
_NON_NEGATIVE = Bound(0)
_ABOVE_ZERO = Bound(0, lo_open=True)
_FRACTION = Bound(0, 1)
_BETA = Bound(0, 1, hi_open=True)

# Megatron-LM's parser takes any value its flag's type reads; a run then fails on some (a modulo by a zero interval,
# a seed out of numpy's range, a negative worker count, dropout > 1) or misreads them (NaN / inf). The bounds every
# numeric flag gets (:func:`flag_bound`): a float is finite; an int is >= 0 (>= 1 for an ``*_interval`` flag) unless
# its Megatron-LM default is below that (0 or -1: off); the flags below are held to tighter bounds.
_BOUNDS = {
    **dict.fromkeys((
        "micro_batch_size", "global_batch_size", "eval_micro_batch_size", "eval_global_batch_size", "train_iters",
        "train_samples", "lr_decay_iters", "lr_decay_samples", "lr_wsd_decay_iters", "lr_wsd_decay_samples",
        "seq_length", "encoder_seq_length", "decoder_seq_length", "max_position_embeddings", "num_layers",
        "encoder_num_layers", "decoder_num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
        "num_query_groups", "kv_channels", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
        "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
        "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
        "microbatch_group_size_per_virtual_pipeline_stage", "recompute_num_layers", "exit_duration_in_mins",
        "dist_ckpt_workers", "num_dataset_builder_threads", "tensorboard_queue_size", "make_vocab_size_divisible_by",
        "distributed_timeout_minutes", "num_distributed_optimizer_instances", "ddp_num_buckets", "ddp_bucket_size",
        "vocab_size", "padded_vocab_size", "hysteresis", "fp8_interval", "fp8_amax_history_len",
        "max_consecutive_skipped_iterations", "energon_packing_buffer"), _POSITIVE),
    "seed": Bound(1, 2**31 - 1),  # > 0 (Megatron-LM), + 100 x PP rank + 10 x DP rank within numpy's 2**32
    **dict.fromkeys((
        "lr", "min_lr", "decoupled_lr", "decoupled_min_lr", "weight_decay", "start_weight_decay", "end_weight_decay",
        "clip_grad", "init_method_std", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate",
        "moe_input_jitter_eps", "mtp_loss_scaling_factor", "lr_warmup_init", "sgd_momentum"), _NON_NEGATIVE),
    **dict.fromkeys(("adam_eps", "norm_epsilon", "initial_loss_scale", "min_loss_scale", "loss_scale",
                     "loss_scale_window", "moe_expert_capacity_factor"), _ABOVE_ZERO),
    **dict.fromkeys(("hidden_dropout", "attention_dropout", "lr_warmup_fraction", "optimizer_offload_fraction",
                     "activation_offload_fraction"), _FRACTION),
    **dict.fromkeys(("adam_beta1", "adam_beta2", "lion_beta1", "lion_beta2", "muon_momentum"), _BETA),
    "rotary_percent": Bound(0, 1, lo_open=True),
}


def flag_bound(action: argparse.Action) -> Optional[Bound]:
    """The bound of a numeric flag (an int / float ``type``), or None for a flag of another type."""
    if action.type not in (int, float):
        return None
    if action.dest in _BOUNDS:
        return _BOUNDS[action.dest]
    if action.type is float:
        return Bound()
    low = 1 if action.dest.endswith("_interval") else 0
    defaults = action.default if isinstance(action.default, list) else [action.default]
    low = min([low] + [d for d in defaults if isinstance(d, int)])
    return Bound(low)


def check_numeric_flags(args: argparse.Namespace, actions: List[argparse.Action]) -> None:
    """Every numeric flag within its bound (:func:`flag_bound`), floats finite; raises :class:`ArgumentError`
    naming the first flag that is not."""
    for action in actions:
        bound = flag_bound(action)
        value = getattr(args, action.dest, None)
        if bound is None or value is None or not action.option_strings:
            continue
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is None:
                continue
            if not math.isfinite(v):
                raise ArgumentError(action.option_strings[0], f"{v} is not a finite number")
            if not bound.admits(v):
                raise ArgumentError(action.option_strings[0], f"{bound} (got {v})")


# Megatron-LM reads --split with ``re.findall(r"[.0-9]+", split)`` (parse_and_normalize_split): any other character
# separates numbers, so '2e1,80' is read as 2,1,80 and 'inf,1,0' as 1,0. Accepted here: exactly what it reads as
# written, up to three comma-separated non-negative decimals, not all zero.
_SPLIT = re.compile(r"\s*[.0-9]+(\s*,\s*[.0-9]+){0,2}\s*")


def check_split(split: Optional[str], train: bool) -> None:
    """``--split`` in the form whose reading by megatron-core's ``parse_and_normalize_split`` is the written one;
    ``train``: the run trains (the training weight must not be 0). Raises :class:`ArgumentError`."""
    if split is None:
        return
    usage = "expected up to three comma-separated non-negative decimal weights (train,valid,test), e.g. 969,30,1"
    _require(_SPLIT.fullmatch(split) is not None, "--split", f"{split!r}: {usage}")
    try:
        weights = [float(w) for w in split.split(",")]
    except ValueError:
        raise ArgumentError("--split", f"{split!r}: {usage}") from None
    _require(all(math.isfinite(w) for w in weights) and sum(weights) > 0, "--split",
             f"{split!r}: the weights must not all be 0")
    if train:
        _require(weights[0] > 0, "--split", f"{split!r}: the training weight is 0")


# ---------------------------------------------------------------------------- the GLM flags
def add_glm5_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM ``extra_args_provider``: the GLM-5.3 flags, and the defaults this model needs where Megatron-LM's
    would pick a path it does not have (no Transformer Engine layers; gloo without CUDA)."""
    import torch

    add_glm5_flags(parser)
    machine = machine_defaults(torch.cuda.is_available())
    parser.set_defaults(**{k: v for k, v in machine.items() if _has_dest(parser, k)})
    return parser


def add_glm5_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The GLM-5.3 flags and this model's defaults for Megatron-LM's flags (:data:`GLM5_DEFAULTS`), without the
    machine's (:func:`machine_defaults`)."""
    from megatron_glm5.config import DSA_BACKENDS, KDA_BACKENDS, MOE_EXPERTS_BACKENDS

    g = parser.add_argument_group("GLM-5.3 model")
    g.add_argument("--hf-config", help="HF checkpoint dir or config.json giving the architecture")
    g.add_argument("--model-preset", choices=MODEL_PRESETS, help="built-in architecture instead of --hf-config")
    g.add_argument("--kda-backend", choices=KDA_BACKENDS,
                   help="KDA kernel (default, the execution plan's: fla_fused on CUDA with flash-linear-attention in bf16, "
                        "torch otherwise, fp32 included)")
    g.add_argument("--dsa-backend", choices=DSA_BACKENDS,
                   help="sparse-attention kernel (default: fused on CUDA with triton, torch otherwise)")
    g.add_argument("--moe-experts-backend", choices=MOE_EXPERTS_BACKENDS,
                   help="routed experts (default: grouped on CUDA in bf16, sequential otherwise)")
    g.add_argument("--moe-cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="run the MoE layers as replayed CUDA graphs where eligible (default: on with CUDA; they "
                        "run eagerly under EP/TP/CP > 1, the global aux loss, sinkhorn routing, token dropping or recompute)")
    g.add_argument("--kda-save-intermediates", action=argparse.BooleanOptionalAction, default=None,
                   help="fla_fused KDA: keep chunk_kda's forward intermediates for the backward instead of recomputing "
                        "them (default: on with fla_fused; ~0.57 GiB more per KDA layer per 4K tokens)")
    g.add_argument("--freeze-vision", action="store_true", help="do not train the vision tower")
    g.add_argument("--dsa-indexer-warmup", type=int, default=0, metavar="N",
                   help="the KPool indexers' dense warm-up (DeepSeek-V3.2): iterations 1..N attend densely, train "
                        "only the indexers, by --dsa-indexer-loss-coeff's loss alone, and end the run at iteration N "
                        "(saved with --save); a resume past N runs the sparse stage (docs/indexer_training.md)")

    g = parser.add_argument_group("GLM-5.3 data")
    g.add_argument("--dataset-type", choices=("gpt", "vqa", "chat"), default="gpt",
                   help="gpt: indexed text (--data-path PREFIX ...) or --mock-data; vqa: packed image+text SFT rows "
                        "from JSONL / WebDataset tar {image, question, answer} records (--data-path FILE|DIR ...) in "
                        "a fixed simple format; chat: packed conversations (messages JSONL with images / videos, the "
                        "vqa sources too, or a prepared Energon dataset) rendered by the checkpoint's chat template "
                        "(or Megatron-LM's --chat-template: a Jinja FILE, or the template text)")
    g.add_argument("--energon-packing-buffer", type=int, default=64,
                   help="--dataset-type chat with an Energon source: documents first-fit packed together into rows")
    g.add_argument("--energon-shuffle-buffer", type=int, default=0,
                   help="--dataset-type chat with an Energon source: Energon's sample shuffle buffer (0: off)")
    turns = g.add_mutually_exclusive_group()
    turns.add_argument("--loss-on-all-turns", action="store_true",
                       help="--dataset-type chat: train on every token of the conversation (system and user turns "
                            "too; never image / video tokens) instead of the assistant turns only")
    turns.add_argument("--loss-on-last-turn-only", action="store_true",
                       help="--dataset-type chat: train on the last assistant turn of each conversation only")

    g = parser.add_argument_group("GLM-5.3 training")
    g.add_argument("--max-consecutive-skipped-iterations", type=int, default=5,
                   help="stop (exit 1) after this many iterations in a row whose loss or grad norm is NaN/inf; such "
                        "an iteration is skipped (no update) and counted in 'number of skipped iterations'")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_true",
                   help="hand a NaN/inf loss or gradient to Megatron-LM's rerun state machine (--rerun-mode: "
                        "validate_results reruns the step, then saves and exits 16) instead of skipping the step; "
                        "off by default for this model (--max-consecutive-skipped-iterations)")
    g.add_argument("--inject-nan-at-iteration", type=int, nargs="*", default=[],
                   help="testing aid: make the loss NaN at these iterations (they must be skipped)")
    g.add_argument("--test-kill-during-save", type=int, default=None, help=argparse.SUPPRESS)  # fault injection
    g.add_argument("--trust-unverified-checkpoint", action="store_true",
                   help="load a --load / --pretrained-checkpoint folder that has no manifest (megatron-core's "
                        "integrity.json, the converter's checksums.sha256) as it is; without it such a folder is "
                        "refused (its files cannot be verified)")
    g.add_argument("--torch-fused-adam", action="store_true",
                   help="megatron-core without Transformer Engine or Apex falls back to torch's Adam in its foreach "
                        "form: run torch's fused Adam kernel instead (one pass over weights, gradients and moments); "
                        "the default where CUDA is available")
    g.add_argument("--no-torch-fused-adam", dest="torch_fused_adam", action="store_false",
                   help="keep torch's foreach Adam (megatron-core's fallback as it is)")
    g.add_argument("--fused-optimizer-step", action="store_true",
                   help="the distributed optimizer on torch's Adam / AdamW fallback: apply the --clip-grad "
                        "coefficient, the Adam update and the write of the model's bf16 weight in one pass per main "
                        "weight (a Triton kernel on CUDA) instead of megatron-core's three; the default where CUDA "
                        "is available (param groups it takes are not switched by --torch-fused-adam)")
    g.add_argument("--no-fused-optimizer-step", dest="fused_optimizer_step", action="store_false",
                   help="keep megatron-core's optimizer step (clip, Adam, copy to the model weights)")

    parser.set_defaults(**{k: v for k, v in GLM5_DEFAULTS.items() if _has_dest(parser, k)})
    return parser


# this model's layers are megatron-core's local modules and its own (no Transformer Engine spec) and carry no position
# embedding (KDA, NoPE sparse attention); a non-finite step is skipped and counted (megatron_hooks), not handed to the
# rerun state machine unless asked
GLM5_DEFAULTS = dict(transformer_impl="local", position_embedding_type="none", check_for_nan_in_loss_and_grad=False)


def machine_defaults(cuda: bool) -> dict:
    """The defaults that depend on the machine: with CUDA torch's fused Adam runs, without it the process groups are
    gloo's and CUDA-only fusions are off (gradient-accumulation fusion is not one: megatron_glm5's mcore_extensions
    runs it on CPU tensors too, so the CPU runs take the GPU's gradient path)."""
    if cuda:
        return dict(torch_fused_adam=True, fused_optimizer_step=True)
    return dict(distributed_backend="gloo", bias_gelu_fusion=False, bias_swiglu_fusion=False,
                bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
                apply_rope_fusion=False, cross_entropy_loss_fusion=False,
                attention_backend=_attention_backend("unfused"))


def _attention_backend(name: str):
    from megatron.core.transformer.enums import AttnBackend

    return AttnBackend[name]


def _has_dest(parser: argparse.ArgumentParser, dest: str) -> bool:
    return any(a.dest == dest for a in parser._actions)


# ---------------------------------------------------------------------------- architecture
def _preparse(argv: List[str]) -> argparse.Namespace:
    """The flags that name the architecture, read before Megatron-LM's parser runs."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--hf-config")
    p.add_argument("--model-preset", choices=MODEL_PRESETS)
    p.add_argument("--num-layers", type=int)
    known, _ = p.parse_known_args(argv)
    return known


def hf_config_dict(hf_config: Optional[str], model_preset: Optional[str], num_layers: Optional[int] = None) -> dict:
    """The HF config.json dict of the architecture the flags name (``num_layers`` keeps a prefix of the layer
    schedules)."""
    from megatron_glm5.config import glm5_flash_hf_config, tiny_hf_config

    if model_preset == "glm5-flash":
        hf = glm5_flash_hf_config()
    elif model_preset == "glm5-tiny":
        hf = tiny_hf_config(mtp=True)
    else:
        path = os.path.join(hf_config, "config.json") if os.path.isdir(hf_config) else hf_config
        with open(path, encoding="utf-8") as fh:
            hf = json.load(fh)
        if not isinstance(hf, dict):
            raise ArgumentError("--hf-config", f"{path} holds a JSON {type(hf).__name__}, not an object")
    if num_layers is not None:
        text = dict(hf.get("text_config", hf))
        for key in ("layer_types", "mlp_layer_types", "indexer_types", "index_topk_pattern"):
            if isinstance(text.get(key), list):
                text[key] = text[key][:num_layers]
        text["num_hidden_layers"] = num_layers
        hf = {**hf, "text_config": text} if "text_config" in hf else text
    return hf


def check_architecture_flags(argv: List[str]) -> argparse.Namespace:
    """The flags that name the architecture (:func:`_preparse`), checked without reading the config (no torch);
    raises :class:`ArgumentError`."""
    pre = _preparse(argv)
    _require(bool(pre.hf_config) != bool(pre.model_preset), "--hf-config",
             "give exactly one of --hf-config DIR and --model-preset")
    if pre.hf_config:
        path = os.path.join(pre.hf_config, "config.json") if os.path.isdir(pre.hf_config) else pre.hf_config
        _require(os.path.isfile(path), "--hf-config", f"no config.json at {pre.hf_config}")
    if pre.num_layers is not None:
        _require(pre.num_layers >= 1, "--num-layers", "must be >= 1")
    return pre


def _architecture(argv: List[str]):
    """(HF config dict, Glm5Config of the bare architecture) of the flags in ``argv``."""
    from megatron_glm5.config import Glm5Config, Glm5ConfigError

    pre = check_architecture_flags(argv)
    try:
        hf = hf_config_dict(pre.hf_config, pre.model_preset, pre.num_layers)
        return hf, Glm5Config.from_hf(hf, use_cpu_initialization=True)
    except ArgumentError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArgumentError("--hf-config", f"cannot read the config: {one_line(e)}") from None
    except RecursionError:
        raise ArgumentError("--hf-config", "cannot read the config: JSON nested too deeply") from None
    except (Glm5ConfigError, ValueError, TypeError, KeyError) as e:
        raise ArgumentError("--hf-config", one_line(e)) from None


def architecture_defaults(config, hf: dict) -> dict:
    """Megatron-LM's ``args_defaults`` for this architecture: the values its parser needs and its logging, MoE / MTP
    loss trackers and checkpoint checks read."""
    text = hf.get("text_config", hf)
    defaults = dict(
        num_layers=config.num_layers, hidden_size=config.hidden_size, ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads, kv_channels=config.kv_channels,
        max_position_embeddings=int(text.get("max_position_embeddings", 0) or 0) or None,
        vocab_size=int(text["vocab_size"]), init_method_std=config.init_method_std,
        norm_epsilon=config.layernorm_epsilon,
    )
    if config.num_moe_experts:
        defaults.update(num_experts=config.num_moe_experts, moe_router_topk=config.moe_router_topk,
                        moe_ffn_hidden_size=config.moe_ffn_hidden_size,
                        moe_layer_freq=[1 if t == "sparse" else 0 for t in config.mlp_layer_types])
        if getattr(config, "moe_shared_expert_intermediate_size", None):
            defaults["moe_shared_expert_intermediate_size"] = config.moe_shared_expert_intermediate_size
    if config.mtp_num_layers:
        defaults["mtp_num_layers"] = config.mtp_num_layers
    return {k: v for k, v in defaults.items() if v is not None}


# the Megatron-LM flags that describe the architecture: given, they must agree with it
_ARCHITECTURE_FLAGS = ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_experts", "moe_router_topk",
                       "moe_ffn_hidden_size", "moe_layer_freq", "moe_shared_expert_intermediate_size", "vocab_size")


def _check_checkpoints(args: argparse.Namespace, hf: dict) -> None:
    """--load / --pretrained-checkpoint: Megatron-LM's layout, this architecture
    (:mod:`megatron_glm5.training.checkpoint_checks`); --load may hold no checkpoint yet."""
    from megatron_glm5.training.checkpoint_checks import (
        CheckpointDirError,
        check_architecture,
        check_checkpoint_folder,
        check_resume_layout,
        checkpoint_in,
    )

    for flag in ("load", "pretrained_checkpoint"):
        path, name = getattr(args, flag), "--" + flag.replace("_", "-")
        if not path or (flag == "load" and not os.path.exists(path)):
            continue
        _require(os.path.isdir(path), name, f"no checkpoint directory at {path}")
        try:
            ckpt = checkpoint_in(path)
            hf_checkpoint = ckpt is None and os.path.isfile(os.path.join(path, "config.json")) and any(
                n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in os.listdir(path))
            if ckpt is None and flag == "load" and hf_checkpoint:  # Megatron-LM would start from random weights
                raise CheckpointDirError(f"{path} holds an HF checkpoint (config.json, safetensors), not a Megatron-LM "
                                         "one: convert it with tools/convert_hf_to_mcore.py and give the converter's "
                                         "--out to --pretrained-checkpoint")
            if ckpt is None and flag == "pretrained_checkpoint":
                hint = ""
                if os.path.isfile(os.path.join(path, "config.json")):  # what a user passes most by mistake
                    hint = ("; it holds an HF checkpoint: convert it with tools/convert_hf_to_mcore.py and give "
                            "the converter's --out")
                raise CheckpointDirError(f"no checkpoint in {path} (no latest_checkpointed_iteration.txt){hint}")
            if ckpt is not None:
                check_architecture(ckpt, hf)
                check_checkpoint_folder(ckpt)
                if flag == "load":
                    check_resume_layout(ckpt, args)
        except CheckpointDirError as e:
            raise ArgumentError(name, str(e)) from None


def given_options(argv: List[str], actions: List[argparse.Action]) -> Dict[str, str]:
    """``{dest: option}`` of the options written in ``argv`` (``--flag`` or ``--flag=value``), through the parser's
    ``actions``; a dest written twice keeps its first spelling."""
    by_option = {o: a.dest for a in actions for o in a.option_strings}
    given = {}
    for token in argv:
        option = token.split("=", 1)[0]
        if option.startswith("--") and option in by_option:
            given.setdefault(by_option[option], option)
    return given


def validate_glm5_args(args: argparse.Namespace, arch_defaults: dict, hf: dict, given: Dict[str, str]) -> None:
    """The checks Megatron-LM's ``validate_args`` does not make for this model; raises :class:`ArgumentError`.
    ``given``: :func:`given_options` of the command line. The flags' own first (:func:`check_data_and_output_flags`,
    which the front parser runs too), then the architecture's, the outputs' and the checkpoints'."""
    check_data_and_output_flags(args)
    for flag in _ARCHITECTURE_FLAGS:
        want = arch_defaults.get(flag)
        if want is None:
            continue
        if flag in given and getattr(args, flag, None) != want:
            raise ArgumentError(given[flag], f"{getattr(args, flag)} contradicts the architecture of "
                                             f"{args.hf_config or args.model_preset} ({want}); leave it out")
        setattr(args, flag, want)  # over a Megatron-LM default (--moe-router-topk 2)
    from megatron_glm5.training.save_guard import check_save_target, existing_folder  # --save loses nothing

    check_save_target(args)  # before the --load checks: a --save that would lose data is named first
    _check_indexer_training(args)  # the stage this run is in, which the --load checks read
    _check_checkpoints(args, hf)
    for flag in ("--tensorboard-dir", "--wandb-save-dir", "--data-cache-path"):  # folders Megatron-LM creates
        path = getattr(args, flag[2:].replace("-", "_"), None)
        if path:
            _, blocked = existing_folder(path)
            _require(blocked is None, flag, f"{path}: {blocked} exists and is not a folder")


def check_data_and_output_flags(args: argparse.Namespace) -> None:
    """The data, tokenizer, checkpoint-format and validation flags against each other and the files they name: no
    torch, no model config (the flag table's front parser runs them before torch is imported,
    :func:`check_layout_without_torch`). Sets ``args.eval_interval`` when validation is off."""
    files = [f for f in (args.data_path or []) if not _is_number(f)]
    numbers = [_is_number(f) for f in (args.data_path or [])]
    if any(numbers) and args.dataset_type == "gpt":  # megatron-core's get_blend_from_list reads the rest as prefixes
        _require(len(numbers) % 2 == 0 and all(numbers[0::2]) and not any(numbers[1::2]), "--data-path",
                 f"expected PREFIX [PREFIX ...] or WEIGHT PREFIX [WEIGHT PREFIX ...], got {' '.join(args.data_path)}")
    for w in (args.data_path or []):
        if _is_number(w):
            _require(math.isfinite(float(w)) and float(w) > 0, "--data-path",
                     f"a weight must be a finite number > 0 (got {w})")
    weights = [w for w in (args.data_path or []) if _is_number(w)]
    _require(math.isfinite(sum(float(w) for w in weights)), "--data-path",  # megatron-core divides by the sum
             f"the weights sum to more than a float holds ({' '.join(weights)})")
    check_split(args.split, train=bool(files))
    _require(args.mock_data or files, "--data-path", "give --data-path or --mock-data")
    _require(not (args.mock_data and files), "--mock-data", "give either --mock-data or --data-path, not both")
    _require(not (args.mock_data and args.dataset_type != "gpt"), "--mock-data",
             f"mock data is text: leave out --dataset-type {args.dataset_type}")
    if args.dataset_type != "chat":
        for flag in ("chat_template", "loss_on_all_turns", "loss_on_last_turn_only"):  # read by chat only
            _require(not getattr(args, flag), "--" + flag.replace("_", "-"), "only --dataset-type chat reads it")
    if args.chat_template and "{" not in args.chat_template:  # Megatron-LM's flag: the Jinja text, or here a FILE
        _require(os.path.isfile(args.chat_template), "--chat-template",
                 f"{args.chat_template} is neither a file nor a Jinja template")
    for f in files:
        if args.dataset_type == "gpt":
            if os.path.isdir(f) and not os.path.isfile(f + ".idx"):
                found = sorted(n[:-len(".idx")] for n in os.listdir(f) if n.endswith(".idx"))[:3]
                raise ArgumentError("--data-path", f"{f} is a folder; give the prefix of its PREFIX.bin / PREFIX.idx"
                                    + (f", e.g. {os.path.join(f, found[0])}" if found else
                                       " (it holds no .idx; write them with tools/preprocess_data.py)"))
            for ext in (".bin", ".idx"):
                _require(os.path.isfile(f + ext), "--data-path", f"missing data file {f + ext}")
        else:
            _require(os.path.exists(f), "--data-path", f"missing data file {f}")
    if files:
        _require(bool(args.tokenizer_model), "--tokenizer-model", "required with --data-path")
    if args.tokenizer_model:
        tok = args.tokenizer_model
        tok_file = os.path.join(tok, "tokenizer.json") if os.path.isdir(tok) else tok
        _require(os.path.isfile(tok_file), "--tokenizer-model", f"no tokenizer.json at {tok}")
    if args.dataset_type in ("vqa", "chat"):
        _require(args.dataloader_type in (None, "external"), "--dataloader-type",
                 "packed image+text rows come from the project's own loader: leave it out (external)")
    if args.save or args.load or args.pretrained_checkpoint:  # the only format the checks and manifests cover
        _require(getattr(args, "ckpt_format", "torch_dist") == "torch_dist", "--ckpt-format",
                 f"{args.ckpt_format}: this trainer writes and reads torch_dist checkpoints only (Megatron-LM's "
                 "default; verified on load without unpickling code): leave --ckpt-format out")
    if args.save and os.path.exists(args.save):
        _require(os.path.isdir(args.save), "--save", f"{args.save} exists and is not a directory")
    if args.eval_interval is None:
        _require(args.eval_iters == 0, "--eval-interval",
                 f"required with --eval-iters {args.eval_iters} (--eval-iters 0 turns validation off)")
        args.eval_interval = args.train_iters  # no validation: Megatron-LM still sizes the valid split with it


def _check_indexer_training(args: argparse.Namespace) -> None:
    """--dsa-indexer-loss-coeff / --dsa-indexer-use-sparse-loss / --dsa-indexer-warmup; sets
    ``args.dsa_indexer_warmup_stage`` (this run is the warm-up: it starts before iteration N) and, in it, ends the run
    at iteration N (``--exit-interval N``)."""
    coeff = args.dsa_indexer_loss_coeff
    _require(coeff is None or (math.isfinite(coeff) and coeff >= 0), "--dsa-indexer-loss-coeff",
             f"must be a finite number >= 0, got {coeff}")
    _require(args.dsa_indexer_warmup >= 0, "--dsa-indexer-warmup", f"must be >= 0, got {args.dsa_indexer_warmup}")
    if args.dsa_indexer_use_sparse_loss:
        _require((coeff or 0) > 0, "--dsa-indexer-use-sparse-loss", "needs --dsa-indexer-loss-coeff > 0")
    args.dsa_indexer_warmup_stage = False
    if args.dsa_indexer_warmup:
        _require((coeff or 0) > 0, "--dsa-indexer-warmup",
                 "needs --dsa-indexer-loss-coeff > 0 (the warm-up trains the indexers by their loss alone)")
        from megatron_glm5.checkpoint.tracker import start_iteration

        args.dsa_indexer_warmup_stage = start_iteration(args) < args.dsa_indexer_warmup
        if args.dsa_indexer_warmup_stage:
            _require(args.exit_interval is None, "--exit-interval",
                     f"the warm-up stage ends at iteration {args.dsa_indexer_warmup} (--dsa-indexer-warmup) by "
                     "itself: leave --exit-interval out")
            args.exit_interval = args.dsa_indexer_warmup


def _check_warmup_stages(args: argparse.Namespace, config) -> None:
    """The warm-up trains only the indexers: every (virtual) pipeline stage must hold one, else its output needs no
    gradient and its optimizer has nothing to step (the pipeline would wait on it)."""
    if not getattr(args, "dsa_indexer_warmup_stage", False) or config.pipeline_model_parallel_size == 1:
        return
    from megatron_glm5.config import INDEXED_ATTENTION
    from megatron_glm5.config.parallelism import mtp_on_stage, stage_layer_ranges

    mtp_dsa = (config.hf_text_config.get("mtp_layer_types") or [INDEXED_ATTENTION])[0] == INDEXED_ATTENTION
    for (rank, vp), layers in sorted(stage_layer_ranges(config).items()):
        has = any(config.layer_types[i] == INDEXED_ATTENTION and config.indexer_types[i] == "full" for i in layers)
        vp_stage = vp if config.virtual_pipeline_model_parallel_size else None
        has = has or (mtp_dsa and mtp_on_stage(config, rank, vp_stage))
        where = f"pipeline stage {rank}" + (f" (virtual stage {vp})" if vp_stage is not None else "")
        _require(has, "--dsa-indexer-warmup", f"{where} holds no DSA layer with an indexer (decoder layers "
                 f"{layers.start + 1}-{layers.stop}): the warm-up trains only the indexers, so every stage needs one; "
                 "move the stage boundaries (--decoder-first-pipeline-num-layers, --pipeline-model-parallel-layout)")


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _glm5_args_defaults(args_defaults: dict, argv: List[str]) -> dict:
    """Megatron-LM's defaults that depend on the run: the tokenizer type, the loader of packed rows, the position
    limit of a config without one."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--tokenizer-model")
    pre.add_argument("--dataset-type", default="gpt")
    pre.add_argument("--seq-length", type=int)
    known, _ = pre.parse_known_args(argv)
    out = dict(args_defaults)
    if out.get("max_position_embeddings") is None and known.seq_length:  # no limit in the config: the rows' length
        out["max_position_embeddings"] = known.seq_length
    out["tokenizer_type"] = "HuggingFaceTokenizer" if known.tokenizer_model else "NullTokenizer"
    if known.dataset_type in ("vqa", "chat"):
        out["dataloader_type"] = "external"
    return out


@contextlib.contextmanager
def _argv(argv: List[str], prog: str):
    saved = sys.argv
    sys.argv = [prog] + list(argv)
    try:
        yield
    finally:
        sys.argv = saved


def escape_help_percents(parser: argparse.ArgumentParser, prog: str) -> None:
    """A literal '%' in a Megatron-LM help text makes --help raise: escaped as '%%'."""
    for action in parser._actions:
        if action.help and "%" in action.help:
            try:
                action.help % dict(vars(action), prog=prog)
            except (ValueError, TypeError, KeyError):
                action.help = action.help.replace("%", "%%")


def read_enum_choices_by_name(parser: argparse.ArgumentParser) -> None:
    """A flag whose choices are an enum's members reads its value by member name
    (``megatron.training.argument_utils``): a value that names no member is argparse's invalid-choice error, not a
    KeyError traceback."""
    import enum

    for action in parser._actions:
        if action.type is not None and action.choices and all(isinstance(c, enum.Enum) for c in action.choices):
            action.type = _member_by_name(action.type, [c.name for c in action.choices])


def _member_by_name(read, names: List[str]):
    def read_member(text: str):
        if text not in names:
            raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(map(repr, names))})")
        return read(text)

    return read_member


_UNRECOGNIZED = "unrecognized arguments: "


def suggest_flag(message: str, options) -> str:
    """argparse's error ``message``, an unknown flag followed by the closest of ``options`` (the parser's option
    strings): 'unrecognized arguments: --lr-decay-stlye cosine (did you mean --lr-decay-style?)'."""
    import difflib

    if not message.startswith(_UNRECOGNIZED):
        return message
    for token in message[len(_UNRECOGNIZED):].split():
        flag = token.split("=", 1)[0]
        if flag.startswith("--"):
            close = difflib.get_close_matches(flag, [o for o in options if o.startswith("--")], n=1, cutoff=0.75)
            if close:
                return f"{message} (did you mean {close[0]}?)"
    return message


def _one_line_parser_errors(prog: str):
    """The extra-args provider, with the parser's own errors (unknown flag, bad choice or type) as one line; the
    parser it was given is kept as ``provider.parser``."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        provider.parser = parser
        parser.prog = prog
        parser.error = lambda message: fail(suggest_flag(message, parser._option_string_actions), prog)
        escape_help_percents(parser, prog)
        read_enum_choices_by_name(parser)
        return add_glm5_arguments(parser)

    return provider


def check_layout_and_schedule(args: argparse.Namespace, config) -> None:
    """The flags Megatron-LM checks with a bare ``assert`` (or not at all) that a user gets wrong most: checked first,
    naming the flag, then :func:`check_unsupported_features`. ``config``: the architecture's Glm5Config, read by the
    last check only (the MoE layers' sequence parallelism); None leaves that check to the full parse (the flag
    table's front parser runs these checks before torch is imported, :func:`check_layout_without_torch`)."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    _require(args.micro_batch_size is not None, "--micro-batch-size", "required")  # >= 1: check_numeric_flags
    _require(args.world_size % (tp * pp * cp) == 0, "--tensor-model-parallel-size",
             f"world size {args.world_size} is not divisible by TP {tp} x PP {pp} x CP {cp}")
    dp = args.world_size // (tp * pp * cp)
    etp = args.expert_tensor_parallel_size or tp
    _require(args.world_size % (etp * args.expert_model_parallel_size * pp) == 0, "--expert-model-parallel-size",
             f"world size {args.world_size} is not divisible by ETP {etp} x EP {args.expert_model_parallel_size} x "
             f"PP {pp}")
    if args.global_batch_size is not None:
        _require(args.global_batch_size >= 1 and args.global_batch_size % (args.micro_batch_size * dp) == 0,
                 "--global-batch-size", f"{args.global_batch_size} is not divisible by micro batch "
                 f"{args.micro_batch_size} x data parallel {dp}")
    _require(args.seq_length is not None and args.seq_length >= 2, "--seq-length", "required, >= 2")
    _require((args.train_iters or 0) >= 1 or (args.train_samples or 0) >= 1, "--train-iters",
             "required, >= 1 (or --train-samples)")
    _require(not (args.train_iters and args.train_samples), "--train-samples",
             "give either --train-iters or --train-samples, not both")
    _require(args.lr is not None, "--lr", "required")
    _require(0 <= args.min_lr <= args.lr, "--min-lr", f"must lie in [0, --lr={args.lr}]")
    if args.train_iters and args.lr_warmup_fraction is None:
        decay = args.lr_decay_iters or args.train_iters
        _require(args.lr_warmup_iters < decay, "--lr-warmup-iters",
                 f"{args.lr_warmup_iters} must be below the decay iterations ({decay}; --lr-decay-iters defaults to "
                 f"--train-iters)")
    if args.recompute_method is not None:
        _require(args.recompute_granularity == "full", "--recompute-method", "needs --recompute-granularity full")
    if args.save_interval is not None:
        _require(bool(args.save), "--save-interval", "needs --save")
    if args.save:
        _require(args.save_interval is not None, "--save-interval",
                 "required with --save (Megatron-LM also saves the last iteration)")
    if args.finetune:
        _require(bool(args.load or args.pretrained_checkpoint), "--finetune", "needs --load or --pretrained-checkpoint")
    if args.num_layers_per_virtual_pipeline_stage is not None:
        _require(pp > 1, "--num-layers-per-virtual-pipeline-stage", "needs --pipeline-model-parallel-size > 1")
    _require(not (args.pipeline_model_parallel_layout and (args.decoder_first_pipeline_num_layers is not None
                                                           or args.decoder_last_pipeline_num_layers is not None)),
             "--pipeline-model-parallel-layout", "give either a layout or --decoder-first/last-pipeline-num-layers")
    check_unsupported_features(args)
    if config is not None and config.num_moe_experts and tp > 1 and not args.sequence_parallel:
        raise ArgumentError("--sequence-parallel", f"required with --tensor-model-parallel-size {tp} on this MoE "
                            "model (megatron-core's MoE layers need it)")


def check_layout_without_torch(args: argparse.Namespace) -> None:
    """:func:`check_layout_and_schedule` (no torch, no model config: all but its last check) and
    :func:`check_data_and_output_flags` on the flag table's front parse, for a world of ``$WORLD_SIZE`` as
    Megatron-LM's parser sets it; with ``--yaml-cfg`` (the flags replaced by a file) or a ``$WORLD_SIZE`` that is no
    integer (the launcher check says so) the full parse checks."""
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    if getattr(args, "yaml_cfg", None) is None:
        args.world_size = world_size
        check_layout_and_schedule(args, None)
        check_data_and_output_flags(args)


def check_unsupported_features(args: argparse.Namespace) -> None:
    """Megatron-LM features this model's layers do not carry (docs/design.md, the decoder section): refused in one
    line rather than ignored."""
    graphs = args.cuda_graph_impl  # and Megatron-LM's deprecated spellings of it
    if args.enable_cuda_graph or args.external_cuda_graph:
        graphs = "local" if args.enable_cuda_graph else "transformer_engine"
    _require(graphs in (None, "none"), "--cuda-graph-impl",
             f"{graphs}: megatron-core's layer CUDA graphs do not capture this model's layers (they read the packed "
             "row's document boundaries on the host); its MoE layers are graphed by --moe-cuda-graph (on by default "
             "on CUDA)")
    _require(not args.fine_grained_activation_offloading, "--fine-grained-activation-offloading",
             "not supported by this model's layers (megatron-core's offloading hooks live in TransformerLayer's own "
             "forward, which this model's layer replaces)")
    _require(not args.distribute_saved_activations, "--distribute-saved-activations",
             "not supported by this model's decoder (megatron-core also refuses it with --sequence-parallel, "
             "which the MoE layers need under tensor parallelism)")


def is_dry_run() -> bool:
    """Whether this is the examples' ``DRY_RUN`` (``MEGATRON_GLM5_CHECK_ARGS=1``): the flags checked for a world of
    ``$WORLD_SIZE`` on the machines the job would run on, no process group, no work."""
    return os.environ.get("MEGATRON_GLM5_CHECK_ARGS") == "1"


def check_machine_support(args: argparse.Namespace) -> None:
    """Megatron-LM features this machine's install cannot run (CUDA, Transformer Engine): refused in one line;
    nothing in a dry run (:func:`is_dry_run`: the job runs on other machines). Kept apart from
    :func:`check_unsupported_features`, which holds what the model never carries and marks ``--help`` (the flag
    table is the same on every machine)."""
    if is_dry_run():
        return
    if args.use_precision_aware_optimizer and not args.optimizer_cpu_offload:
        _require(_have_te_fused_adam(), "--use-precision-aware-optimizer",
                 "needs Transformer Engine's FusedAdam (megatron-core keeps 16-bit optimizer state only there), "
                 "which is not installed; this project's fused Adam step keeps fp32 state")
    if args.optimizer_cpu_offload:
        import torch

        _require(torch.cuda.is_available(), "--optimizer-cpu-offload",
                 "needs CUDA (megatron-core's HybridDeviceOptimizer copies over CUDA streams)")
    if args.use_megatron_fsdp:
        import torch

        _require(torch.cuda.is_available(), "--use-megatron-fsdp",
                 "needs CUDA (megatron-core 0.19.2's Megatron-FSDP places its buffers on cuda:<current device> and "
                 "overlaps its all-gathers on CUDA streams; docs/parallelism.md)")


def check_precision(args: argparse.Namespace) -> None:
    """The model config carries bf16 or fp32 only (megatron-core's Float16Module refused an fp16 model with a
    traceback)."""
    _require(not args.fp16, "--fp16", "this model trains in bf16 (--bf16) or fp32, not fp16")


def _have_te_fused_adam() -> bool:
    """Whether Transformer Engine's FusedAdam (megatron-core's precision-aware optimizer) imports."""
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam  # noqa: F401
    except ImportError:
        return False
    return True


# config fields that a message may name, and the flags that set them
_FIELD_FLAGS = {
    "num_layers_in_first_pipeline_stage": "--decoder-first-pipeline-num-layers",
    "num_layers_in_last_pipeline_stage": "--decoder-last-pipeline-num-layers",
    "num_layers_per_virtual_pipeline_stage": "--num-layers-per-virtual-pipeline-stage",
    "pipeline_model_parallel_layout": "--pipeline-model-parallel-layout",
}


def _flag_names(message: str) -> str:
    """``message`` with the config fields that flags set named as those flags."""
    for field_name, flag in _FIELD_FLAGS.items():
        message = message.replace(field_name, flag)
    return message


def _megatron_check(e: BaseException) -> str:
    """One line for a check of Megatron-LM's argument validation that failed: its message, or (a bare ``assert``)
    the failed condition and where it is."""
    import traceback

    if str(e).strip():
        return one_line(e)
    frame = traceback.extract_tb(e.__traceback__)[-1]
    where = "/".join(frame.filename.split(os.sep)[-3:])
    return f"Megatron-LM's check failed: {frame.line} ({where}:{frame.lineno})"


def parse_args(argv: Optional[List[str]] = None, prog: str = PROG, world_size: Optional[int] = None
               ) -> argparse.Namespace:
    """Megatron-LM's argument handling (``parse_args`` -> ``validate_args`` -> ``set_global_variables``, what its
    ``parse_and_validate_args`` runs) with the GLM flags and this architecture's defaults, our checks first. Sets
    Megatron-LM's global args (its tokenizer, TensorBoard writer, timers, microbatch calculator). Any error — an
    unknown flag, a value refused by our checks or by Megatron-LM's — is one line and exit 2. ``world_size``:
    instead of ``$WORLD_SIZE`` (argument checks without a launcher)."""
    from megatron.training.arguments import parse_args as megatron_parse_args
    from megatron.training.arguments import validate_args
    from megatron.training.global_vars import _build_tokenizer, set_global_variables, unset_global_variables

    from megatron_glm5.training.model_args import deferred_args_dump, print_args, set_args_as_built

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        with _argv(argv, prog):
            megatron_parse_args(extra_args_provider=_one_line_parser_errors(prog))  # prints the help, exits 0
    try:
        hf, config = _architecture(argv)
        arch = architecture_defaults(config, hf)
        defaults = _glm5_args_defaults(arch, argv)
    except ArgumentError as e:
        fail(str(e), prog)
    megatron_noise = io.StringIO()
    try:
        provider = _one_line_parser_errors(prog)
        with _argv(argv, prog):
            args = megatron_parse_args(extra_args_provider=provider)
        if world_size is not None:
            args.world_size = world_size
        check_numeric_flags(args, provider.parser._actions)
        for key, value in defaults.items():  # what validate_args does with its defaults, first: our checks read them
            if getattr(args, key, None) is None:
                setattr(args, key, value)
        check_layout_and_schedule(args, config)
        check_machine_support(args)
        given = given_options(argv, provider.parser._actions)
        validate_glm5_args(args, arch, hf, given)
        args.hf_config_dict = hf
        try:  # the parallel layout against the model (heads, experts, layers per stage)
            model_config = model_config_from_args(args, "cpu")
        except (ValueError, TypeError, AssertionError) as e:
            raise ArgumentError("model config", _flag_names(one_line(e))) from None
        _check_warmup_stages(args, model_config)
        with contextlib.redirect_stdout(megatron_noise):
            # (only the defaults a flag overrides: Megatron-LM warns about every default already set, equal or not)
            with deferred_args_dump():  # printed below, once the arguments are set as the model is built
                validate_args(args, {k: v for k, v in defaults.items() if getattr(args, k, None) != v})
            # after Megatron-LM's own checks (--fp16 with --bf16 is theirs): the model config carries bf16 or fp32
            # only, and megatron-core's Float16Module refused an fp16 model with a traceback
            check_precision(args)
            check_flags_reach_the_model(args, model_config, given)
            set_args_as_built(args, model_config)
            print_args(args)
            unset_global_variables()  # a second parse in one process (tests) replaces the first
            set_global_variables(args, build_tokenizer=False)
            try:  # Megatron-LM's own tokenizer build, its failure named by the flag
                _build_tokenizer(args)
            except (OSError, ValueError, RuntimeError, TypeError, KeyError) as e:
                raise ArgumentError("--tokenizer-model" if args.tokenizer_model else "--tokenizer-type",
                                    one_line(e)) from None
    except ArgumentError as e:
        fail(str(e), prog)
    except (AssertionError, ValueError, RuntimeError) as e:
        fail(_megatron_check(e), prog)
    sys.stdout.write(megatron_noise.getvalue())
    return args


MOE_TRAINING_FLAGS = ("moe_z_loss_coeff", "moe_input_jitter_eps", "moe_expert_capacity_factor",
                      "moe_pad_expert_input_to_capacity", "moe_token_drop_policy", "moe_router_force_load_balancing",
                      "moe_per_layer_logging")
"""Megatron-LM's MoE training flags that :func:`model_config_from_args` hands to the model config as given (the
router's z-loss and input jitter, the dispatcher's capacity and token dropping, forced balancing, per-layer
logging)."""


_MODEL_FLAG_INSTEAD = {"moe_grouped_gemm": "--moe-experts-backend grouped runs the experts as grouped GEMMs",
                       "attention_backend": "--dsa-backend / --kda-backend pick the attention kernels"}
"""What to give instead of a Megatron-LM flag that :func:`check_flags_reach_the_model` refuses, where there is one."""


_FLAGS_READ_BY_THE_TRAINER = frozenset({"dsa_indexer_warmup"})
"""Flags whose namesake config field holds something else: ``--dsa-indexer-warmup N`` is the trainer's step count
(the config's ``dsa_indexer_warmup`` says whether this run is in the warm-up stage)."""


def _same_setting(a, b) -> bool:
    """A flag's value and a config field's as one setting: a one-element list is its element (megatron-core keeps
    ``moe_aux_loss_coeff`` as a float or a list), an enum its name, an object built from the flag's text (the
    pipeline layout) that text."""
    def norm(v):
        v = list(v) if isinstance(v, (list, tuple)) else [v]
        return [getattr(x, "name", x) for x in v]
    return norm(a) == norm(b) or [str(x) for x in norm(a)] == [str(x) for x in norm(b)]


def check_flags_reach_the_model(args: argparse.Namespace, model_config, given: Dict[str, str]) -> None:
    """Every flag given (:func:`given_options`) that sets a field of the model config must have set it: a
    Megatron-LM flag that this model takes from its architecture instead (``--hidden-dropout 0.1``, ``--kv-channels
    64``) or does not read (``--attention-backend flash``) raises :class:`ArgumentError` naming the flag, rather than
    training without it. The fields the indexer warm-up stage holds (``Glm5Config.WARMUP_HOLDS``) take their flag's
    value after that stage."""
    from megatron_glm5.config.schema import Glm5Config

    held = Glm5Config.WARMUP_HOLDS if getattr(model_config, "dsa_indexer_warmup", False) else {}
    for dest, option in given.items():
        if dest in _FLAGS_READ_BY_THE_TRAINER or dest in held or not hasattr(model_config, dest) \
                or not hasattr(args, dest):
            continue
        want, got = getattr(args, dest), getattr(model_config, dest)
        if _same_setting(want, got):
            continue
        shown = [repr(getattr(v, "name", v)) for v in (want, got)]
        instead = _MODEL_FLAG_INSTEAD.get(dest, "leave it out")
        raise ArgumentError(option, f"{shown[0]} does not reach this model: its {dest} is {shown[1]}, set by "
                                    f"{args.hf_config or args.model_preset} or by this trainer; {instead}")


def model_config_from_args(args, device: str):
    """The Glm5Config of this run: architecture from --hf-config / --model-preset, everything else from Megatron-LM's
    flags (:func:`model_config_overrides`)."""
    from megatron_glm5.config import Glm5Config

    return Glm5Config.from_hf(args.hf_config_dict, **model_config_overrides(args, device))


def model_config_overrides(args, device: str) -> dict:
    """The model config fields the flags set, over the architecture's: ``{field: value}``."""
    import torch

    overrides = dict(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size or args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        bf16=args.bf16,
        # Megatron-LM's --no-gradient-accumulation-fusion; the fused GEMM is megatron_glm5.mcore_extensions'
        gradient_accumulation_fusion=bool(getattr(args, "gradient_accumulation_fusion", False)),
        params_dtype=torch.float32,
        pipeline_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_cpu_initialization=(device == "cpu") or args.use_cpu_initialization,
        perform_initialization=True,
        calculate_per_token_loss=args.calculate_per_token_loss,
        dsa_indexer_loss_coeff=args.dsa_indexer_loss_coeff,
        dsa_indexer_use_sparse_loss=args.dsa_indexer_use_sparse_loss,
        dsa_indexer_warmup=bool(getattr(args, "dsa_indexer_warmup_stage", False)),
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        recompute_modules=args.recompute_modules,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        # megatron-core's router and token dispatcher read these training switches themselves
        **{name: getattr(args, name) for name in MOE_TRAINING_FLAGS},
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        mtp_num_layers=args.mtp_num_layers or None,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        init_method_std=args.init_method_std,
        # the backend flags as given: None leaves the choice to the execution plan (resolve_execution_plan)
        kda_backend=args.kda_backend,
        dsa_backend=args.dsa_backend,
        moe_experts_backend=args.moe_experts_backend,
        moe_cuda_graph=args.moe_cuda_graph,
        kda_save_intermediates=args.kda_save_intermediates,
    )
    if args.num_layers_per_virtual_pipeline_stage is not None:
        overrides["num_layers_per_virtual_pipeline_stage"] = args.num_layers_per_virtual_pipeline_stage
    if args.pipeline_model_parallel_layout:
        overrides["pipeline_model_parallel_layout"] = str(args.pipeline_model_parallel_layout)
    if args.decoder_first_pipeline_num_layers is not None:
        overrides["num_layers_in_first_pipeline_stage"] = args.decoder_first_pipeline_num_layers
    if args.decoder_last_pipeline_num_layers is not None:
        overrides["num_layers_in_last_pipeline_stage"] = args.decoder_last_pipeline_num_layers
    return overrides
