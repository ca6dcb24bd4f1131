"""Read a megatron-core ``dist_checkpointing`` (torch_dist) checkpoint of Glm5Model tensor by tensor, under HF names.

The checkpoint holds megatron's global tensors (decoder layers under their global index, SwiGLU ``linear_fc1`` as
[gate; up], routed experts stacked on a leading expert axis), whatever TP/PP/EP layout wrote it. The reader builds
the model on the meta device at TP=PP=EP=1 (no memory) and takes its ``sharded_state_dict()`` as the map of what
is where: each model tensor is one or more megatron ShardedTensors (storage key, global offset, shape; factories
such as the fused SwiGLU fc1 are built and merged with megatron's own build/merge functions). Loading reads just
those regions through torch DCP (the torch_dist storage layer) into CPU tensors allocated for them, so memory is
bounded by what one call asks for and one expert of a stacked expert tensor costs one expert. (megatron's
``dist_checkpointing.load`` cannot read part of a tensor's shards in one process: it expects every shard of a key.)
Names go through the key table (:mod:`megatron_glm5.checkpoint.hf_keys`); fused gate/up tensors are split back
into their two HF keys.

    reader = McoreCheckpointReader(load_dir)              # a save root (its tracker names the checkpoint folder:
                                                          # release or iter_NNNNNNN) or a checkpoint folder;
                                                          # reads hf_config.json from that folder
    for hf_key, tensor in reader.iter_hf_tensors():       # bf16, fp32 islands in fp32
        ...

The checkpoint is validated up front against the config (every tensor present with its global shape, no model
tensor in the checkpoint the config does not know); failures raise :class:`McoreCheckpointError` with one line.
Needs a single-process megatron parallel state at TP=PP=EP=1 (initialised on first use when there is none).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_glm5.checkpoint.checksums import verify_manifest
from megatron_glm5.errors import CheckpointError
from megatron_glm5.checkpoint.hf_keys import canonical_name, is_fp32_island_hf, is_non_persistent, mcore_to_hf
from megatron_glm5.checkpoint.tracker import resolve_checkpoint_dir
from megatron_glm5.checkpoint.safe_load import SafeFileSystemReader
from megatron_glm5.checkpoint.safetensors_io import nbytes

HF_CONFIG_FILE = "hf_config.json"
# top-level module names of Glm5Model: checkpoint tensors under these must all be known to the config
MODEL_PREFIXES = ("embedding.", "vision_model.", "decoder.", "final_layernorm.", "output_layer.", "mtp.")


class McoreCheckpointError(CheckpointError):
    """A directory that is not a readable torch_dist checkpoint of the configured model (message is one line)."""


# ---------------------------------------------------------------------------------------------------- directory
def check_torch_dist(load_dir: str) -> None:
    """Raise unless ``load_dir`` is a dist_checkpointing checkpoint in the torch_dist format."""
    meta = os.path.join(load_dir, "metadata.json")
    if not os.path.exists(meta):
        raise McoreCheckpointError(f"{load_dir}: not a megatron dist checkpoint (metadata.json not found)")
    try:
        with open(meta) as fh:
            backend = json.load(fh).get("sharded_backend")
    except (ValueError, AttributeError) as e:
        raise McoreCheckpointError(f"{meta}: unreadable ({_one_line(e)})") from None
    if backend != "torch_dist":
        raise McoreCheckpointError(f"{load_dir}: sharded_backend is {backend!r}; only 'torch_dist' is supported")
    if not os.path.exists(os.path.join(load_dir, ".metadata")):
        raise McoreCheckpointError(f"{load_dir}: torch_dist checkpoint without its .metadata file")


def find_hf_config(load_dir: str) -> Optional[str]:
    """``hf_config.json`` in the checkpoint folder ``load_dir`` (the converter writes it into ``release``, every
    training save into its ``iter_NNNNNNN``), None when there is none."""
    p = os.path.join(load_dir, HF_CONFIG_FILE)
    return p if os.path.exists(p) else None


def read_hf_config(load_dir: str, hf_config_path: Optional[str] = None) -> dict:
    path = hf_config_path or find_hf_config(load_dir)
    if path is None:
        raise McoreCheckpointError(f"{load_dir}: {HF_CONFIG_FILE} not found (pass --hf-config PATH)")
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as e:
        raise McoreCheckpointError(f"{path}: unreadable HF config ({_one_line(e)})") from None
    if not isinstance(cfg, dict):
        raise McoreCheckpointError(f"{path}: not a JSON object")
    return cfg


def text_config(hf_config: dict) -> dict:
    return hf_config.get("text_config") or {k: v for k, v in hf_config.items() if k != "vision_config"}


def hf_dtype(hf_key: str, dtype: torch.dtype = torch.bfloat16) -> torch.dtype:
    """The dtype an HF checkpoint stores ``hf_key`` in: fp32 for the fp32 islands, ``dtype`` otherwise."""
    return torch.float32 if is_fp32_island_hf(hf_key) else dtype


def _one_line(e: BaseException) -> str:
    msg = str(e).strip() or type(e).__name__
    return msg.splitlines()[0][:500]


def _root_cause(e: BaseException) -> str:
    """One line for an exception, looking inside torch DCP's per-rank CheckpointException wrappers."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        if isinstance(inner, tuple) and inner:  # torch DCP wraps (exception, stack summary)
            inner = inner[0]
        if isinstance(inner, BaseException):
            e = inner
    while e.__cause__ is not None:
        e = e.__cause__
    msg = str(e).strip()
    return f"{type(e).__name__}: {_one_line(e)}" if msg else type(e).__name__


# ---------------------------------------------------------------------------------------------------- entries
@dataclasses.dataclass
class McoreTensor:
    """One model tensor: its canonical megatron name, the HF key(s) it becomes and how it is stored."""

    name: str
    hf_keys: List[str]
    shape: Tuple[int, ...]
    ckpt_dtype: torch.dtype
    sharded: object  # ShardedTensor or ShardedTensorFactory on the meta device

    @property
    def hf_shapes(self) -> List[Tuple[int, ...]]:
        n = len(self.hf_keys)
        return [(self.shape[0] // n,) + tuple(self.shape[1:])] * n

    def split(self, t: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
        """The full tensor -> [(hf_key, part)]; fused [gate; up] split on dim 0."""
        if len(self.hf_keys) == 1:
            return [(self.hf_keys[0], t)]
        return list(zip(self.hf_keys, t.chunk(len(self.hf_keys), dim=0)))


class McoreCheckpointReader:
    """Index of a torch_dist Glm5Model checkpoint by HF key; loads chosen tensors on demand (CPU)."""

    def __init__(self, load_dir: str, hf_config: Union[None, dict, str] = None):
        self.load_dir = resolve_checkpoint_dir(load_dir)
        check_torch_dist(self.load_dir)
        verify_manifest(self.load_dir)  # a flipped byte anywhere is an error, not wrong weights
        if hf_config is None or isinstance(hf_config, str):
            hf_config = read_hf_config(self.load_dir, hf_config)
        elif not isinstance(hf_config, dict):  # a Glm5Config
            hf_config = hf_config.to_hf_dict()
        self.hf_config = hf_config
        self.text_config = text_config(hf_config)
        self.config, self.model = self._build_meta_model(hf_config)
        self._reader = None
        self._ckpt_md = self._read_ckpt_metadata()
        self.tensors: List[McoreTensor] = self._collect()
        self._by_name = {t.name: t for t in self.tensors}
        self._by_hf = {k: t for t in self.tensors for k in t.hf_keys}
        self._validate()

    # -------------------------------------------------------------------------------------------- setup
    @staticmethod
    def _build_meta_model(hf_config: dict):
        from megatron_glm5.errors import Glm5ConfigError
        from megatron_glm5.models.builder import build_meta_model

        try:
            model = build_meta_model(hf_config, torch.bfloat16, parallel_output=False)
        except (Glm5ConfigError, TypeError, ValueError, KeyError) as e:
            raise McoreCheckpointError(f"invalid HF config: {_one_line(e)}") from None
        return model.config, model

    def _read_ckpt_metadata(self):
        try:
            md = self._storage_reader().read_metadata()
        except CheckpointError as e:
            raise McoreCheckpointError(f"cannot read the torch_dist .metadata: {e}") from None
        return md.state_dict_metadata

    def _collect(self) -> List[McoreTensor]:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        names = {id(t): local for local, t in self.model.state_dict(keep_vars=True).items()}
        out = []
        num_layers = self.config.num_layers
        for dict_key, sh in self.model.sharded_state_dict().items():
            if not isinstance(sh, (ShardedTensor, ShardedTensorFactory)):
                continue  # ShardedObjects (_extra_state)
            local = names.get(id(sh.data), dict_key)
            if is_non_persistent(local):
                continue
            name = canonical_name(local, self.model)
            hf_keys = mcore_to_hf(name, num_layers)
            out.append(McoreTensor(name=name, hf_keys=hf_keys, shape=tuple(sh.data.shape), ckpt_dtype=sh.data.dtype,
                                   sharded=sh))
        return out

    def _validate(self):
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

        md = self._ckpt_md
        missing, mismatched, known = [], [], set()
        for t in self.tensors:
            subs = t.sharded.build() if isinstance(t.sharded, ShardedTensorFactory) else t.sharded
            subs = _flat_values(subs)
            for sub in subs:
                known.add(sub.key)
                m = md.get(sub.key)
                if not isinstance(m, TensorStorageMetadata):
                    missing.append(sub.key)
                elif tuple(m.size) != tuple(sub.global_shape):
                    mismatched.append(f"{sub.key} checkpoint {tuple(m.size)} vs config {tuple(sub.global_shape)}")
                else:
                    t.ckpt_dtype = m.properties.dtype
        unexpected = sorted(k for k, m in md.items() if isinstance(m, TensorStorageMetadata)
                            and k.startswith(MODEL_PREFIXES) and k not in known and not is_non_persistent(k))
        problems = []
        for what, items in (("shape mismatches", sorted(set(mismatched))), ("tensors missing from the checkpoint",
                                                                              sorted(set(missing))),
                            ("checkpoint tensors the config does not have", unexpected)):
            if items:
                more = f" (+{len(items) - 3} more)" if len(items) > 3 else ""
                problems.append(f"{len(items)} {what}: {'; '.join(items[:3])}{more}")
        if problems:
            raise McoreCheckpointError(f"{self.load_dir} does not match the HF config: " + " | ".join(problems))

    # -------------------------------------------------------------------------------------------- queries
    def hf_keys(self) -> List[str]:
        """Every HF key of the model, in model order."""
        return [k for t in self.tensors for k in t.hf_keys]

    def tensor_for(self, hf_key: str) -> McoreTensor:
        return self._by_hf[hf_key]

    def hf_shape(self, hf_key: str) -> Tuple[int, ...]:
        t = self._by_hf[hf_key]
        return t.hf_shapes[t.hf_keys.index(hf_key)]

    # -------------------------------------------------------------------------------------------- loading
    def load(self, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        """Canonical megatron names -> full CPU tensors in the checkpoint's dtype, read in one torch DCP pass.

        Each tensor is located in the checkpoint by its megatron ShardedTensor(s) (storage key, global offset,
        shape); factories (fused SwiGLU fc1) are built on the freshly allocated tensor and merged back with their
        own ``merge_fn``. Only the requested regions are read (e.g. one expert out of a stacked expert tensor)."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

        entries = [self._by_name[n] for n in names]
        if not entries:
            return {}
        regions: Dict[str, list] = {}
        built = []
        for t in entries:
            real = torch.empty(t.shape, dtype=t.ckpt_dtype, device="cpu")
            if isinstance(t.sharded, ShardedTensorFactory):
                tree = dataclasses.replace(t.sharded, data=real).build()
            else:
                extra = {"dtype": real.dtype} if "dtype" in {f.name for f in dataclasses.fields(t.sharded)} else {}
                tree = dataclasses.replace(t.sharded, data=real, **extra)
            for sh in _flat_values(tree):
                if getattr(sh, "flattened_range", None) is not None:
                    raise McoreCheckpointError(f"{t.name}: flattened ShardedTensors are not supported")
                target = sh.data
                for _ in range(sh.prepend_axis_num):  # e.g. the expert axis of stacked expert weights
                    target = target.unsqueeze(0)
                if target.dim() != len(sh.global_shape):
                    raise McoreCheckpointError(f"{sh.key}: region of rank {target.dim()} in a tensor of rank "
                                               f"{len(sh.global_shape)}")
                regions.setdefault(sh.key, []).append((tuple(sh.global_offset), target))
            built.append((t, real, tree))
        planner = _RegionLoadPlanner(regions)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp_load({}, storage_reader=self._storage_reader(), planner=planner, no_dist=True)
        except (McoreCheckpointError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - unreadable / truncated data (DCP's CheckpointException is a
            # BaseException)
            more = f" and {len(entries) - 1} more" if len(entries) > 1 else ""
            raise McoreCheckpointError(f"{self.load_dir}: failed reading {entries[0].name}{more} "
                                       f"({_root_cause(e)})") from None
        missing = planner.unfilled()
        if missing:
            raise McoreCheckpointError(f"{self.load_dir}: checkpoint data does not cover {missing[0]}"
                                       f"{' (+%d more)' % (len(missing) - 1) if len(missing) > 1 else ''}")
        out = {}
        for t, real, tree in built:
            if isinstance(t.sharded, ShardedTensorFactory):
                real = t.sharded.merge_fn(_map_tree(tree, lambda sh: sh.data))
            if tuple(real.shape) != t.shape:
                raise McoreCheckpointError(f"{t.name}: loaded shape {tuple(real.shape)} != expected {t.shape}")
            out[t.name] = real
        return out

    def _storage_reader(self):
        if self._reader is None:
            self._reader = SafeFileSystemReader(self.load_dir)
        return self._reader

    def iter_hf_tensors(self, keys: Optional[Sequence[str]] = None, dtype: Optional[torch.dtype] = torch.bfloat16,
                        max_bytes: int = 2 << 30) -> Iterator[Tuple[str, torch.Tensor]]:
        """Yield (hf_key, tensor) for ``keys`` (default: all, model order), reading at most ``max_bytes`` of
        checkpoint tensors per load. ``dtype``: output dtype except fp32 islands (fp32); None keeps the
        checkpoint's dtype. Fused gate/up parts come out as contiguous row blocks of the loaded tensor."""
        want = None if keys is None else set(keys)
        if want is not None:
            unknown = sorted(want - set(self._by_hf))
            if unknown:
                raise KeyError(f"not HF keys of this model: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        todo = [t for t in self.tensors if want is None or any(k in want for k in t.hf_keys)]
        for batch in batch_by_bytes(todo, max_bytes):
            loaded = self.load([t.name for t in batch])
            for t in batch:
                full = loaded.pop(t.name)
                for k, part in t.split(full):
                    if want is not None and k not in want:
                        continue
                    if dtype is not None:
                        part = part.to(hf_dtype(k, dtype))
                    yield k, part.contiguous()
                del full


class _RegionLoadPlanner(LoadPlanner):
    """torch DCP load planner that reads given regions of checkpoint tensors into given CPU tensors.

    ``regions``: storage key -> [(global offset, target tensor with the region's shape)]. DCP's resharding helper
    turns each region into reads of the stored chunks that overlap it; nothing else is read."""

    def __init__(self, regions: Dict[str, list]):
        self.regions = regions
        self.targets: Dict[tuple, torch.Tensor] = {}
        self.filled: Dict[tuple, int] = {}
        self.metadata = None

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, regs in self.regions.items():
            md = self.metadata.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise McoreCheckpointError(f"{key}: not a tensor in the checkpoint")
            chunks = []
            for offset, target in regs:
                ident = (key, torch.Size(offset))
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(offset), sizes=target.shape))
                self.targets[ident] = target
                self.filled[ident] = 0
            items.extend(create_read_items_for_chunk_list(key, md, chunks))
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value):
        raise McoreCheckpointError(f"{read_item.dest_index.fqn}: unexpected bytes item")

    def resolve_tensor(self, read_item):
        idx = read_item.dest_index
        target = self.targets[(idx.fqn, torch.Size(idx.offset))]
        for dim, (off, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(dim, off, length)
        return target

    def commit_tensor(self, read_item, tensor):
        idx = read_item.dest_index
        self.filled[(idx.fqn, torch.Size(idx.offset))] += tensor.numel()

    def unfilled(self) -> List[str]:
        """Regions the checkpoint's stored chunks did not cover."""
        return [f"{k[0]} at offset {tuple(k[1])}" for k, n in self.filled.items() if n < self.targets[k].numel()]


def _map_tree(x, fn):
    if isinstance(x, dict):
        return {k: _map_tree(v, fn) for k, v in x.items()}
    if isinstance(x, list):
        return [_map_tree(v, fn) for v in x]
    if isinstance(x, tuple):
        return tuple(_map_tree(v, fn) for v in x)
    return fn(x)


def _flat_values(x) -> list:
    if isinstance(x, dict):
        return [v for val in x.values() for v in _flat_values(val)]
    if isinstance(x, (list, tuple)):
        return [v for val in x for v in _flat_values(val)]
    return [x]


def batch_by_bytes(tensors: List[McoreTensor], max_bytes: int) -> Iterator[List[McoreTensor]]:
    cur, size = [], 0
    for t in tensors:
        b = nbytes(t.shape, t.ckpt_dtype)
        if cur and size + b > max_bytes:
            yield cur
            cur, size = [], 0
        cur.append(t)
        size += b
    if cur:
        yield cur


def iter_hf_tensors(load_dir: str, cfg: Union[None, dict, str, object] = None, keys: Optional[Sequence[str]] = None,
                    dtype: Optional[torch.dtype] = torch.bfloat16, max_bytes: int = 2 << 30
                    ) -> Iterator[Tuple[str, torch.Tensor]]:
    """(hf_key, tensor) of a torch_dist checkpoint in bounded memory. ``cfg``: HF config dict, a path to one,
    a Glm5Config, or None for ``load_dir/hf_config.json``."""
    reader = McoreCheckpointReader(load_dir, cfg)
    yield from reader.iter_hf_tensors(keys, dtype=dtype, max_bytes=max_bytes)
