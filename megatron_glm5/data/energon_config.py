"""The YAML of an Energon source, checked before Energon reads it: Energon's config loader imports and calls what a
config names (``__module__`` / ``__class__`` / ``__function__`` anywhere a value may be an object, subflavors and
metadataset entries included) and evaluates ``.nv-meta/*.py`` files named by ``part_filter`` / ``sample_loader``,
so a data set could run code. :func:`check_energon_source` parses every config file Energon will read for a source
with Energon's own parser (``megatron.energon.eyaml.load_yaml``: rapidyaml to plain dicts, lists and scalars,
nothing evaluated: the data checked is the data Energon gets) and accepts only plain keys and the classes this
program reads:

- a dataset's ``.nv-meta/dataset.yaml`` (or the ``dataset_config`` a metadataset names):
  ``__module__: megatron.energon`` + ``__class__: CrudeWebdataset`` (optional ``part_filter``: a list of part
  names), or ``sample_type: {__module__: megatron.energon, __class__: VQASample}`` + ``field_map`` (part names /
  ``json[field]`` strings); ``subflavors`` of plain values in both;
- its split config (``split.yaml`` / ``split.json``) and ``.info.json`` / ``.info.yaml``: parsed (they are read
  without imports), shard names relative and inside the dataset folder;
- a metadataset YAML: ``__module__: megatron.energon``, ``__class__: MetadatasetV2``, ``splits`` of dataset
  references (``path``, ``subflavors``, ``split_part``, ``subset``, ``shuffle_over_epochs_multiplier``,
  ``dataset_config``, ``split_config``), ``blend`` (+ ``weight``) or ``blend_epochized`` (+ ``repetitions``) lists
  of them; a ``path`` is a prepared dataset folder or a nested metadataset YAML (checked the same way). Joins
  (whose ``joiner`` is code) and auxiliary datasets are not read.

Anything else is refused with one line naming the file and the key (:class:`~megatron_glm5.data.DataError`).
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Set

from megatron_glm5.data import DataError
from megatron_glm5.errors import one_line

META = ".nv-meta"
ENERGON_MODULE = "megatron.energon"
OBJECT_KEYS = ("__module__", "__class__", "__function__")
MAX_CONFIG_BYTES = 16 * 1024 * 1024
MAX_NESTING = 16

_REFERENCE_KEYS = {"path", "subflavors", "split_part", "subset", "shuffle_over_epochs_multiplier", "dataset_config",
                   "split_config"}


def load_config_file(path: str, yaml_only: bool = False):
    """``path`` (YAML, or JSON for a ``.json`` name unless ``yaml_only``) as plain Python data, parsed as Energon
    parses it (a dataset config always as YAML)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise DataError(f"{path}: unreadable Energon config ({one_line(e)})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise DataError(f"{path}: an Energon config of more than {MAX_CONFIG_BYTES} bytes")
    if path.endswith(".json") and not yaml_only:
        try:
            return json.loads(data)
        except ValueError as e:
            raise DataError(f"{path}: not parseable JSON ({one_line(e)})") from None
    return _parse_yaml(data, path)


def _parse_yaml(data: bytes, path: str):
    """``data`` parsed by Energon's ``load_yaml``. rapidyaml writes its parse error to the process's stderr (file
    descriptor 2) and raises an exception without text: the parse runs with descriptor 2 going to a temporary file,
    whose ``ERROR`` line becomes the one-line message."""
    import sys
    import tempfile

    from megatron.energon.eyaml import load_yaml

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as err:
        os.dup2(err.fileno(), 2)
        try:
            return load_yaml(data)
        except Exception as e:  # noqa: BLE001 - rapidyaml raises its own error types for text it cannot parse
            err.seek(0)
            lines = [ln.strip() for ln in err.read().decode("utf-8", "replace").splitlines() if "ERROR" in ln]
            why = lines[0] if lines else one_line(e)
            raise DataError(f"{path}: not parseable YAML ({one_line(ValueError(why))})") from None
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _refuse(file: str, key: str, why: str):
    raise DataError(f"{file}: {key}: {why} (Energon configs are read without running code: only plain keys and "
                    f"the classes this program reads are accepted)")


def _mapping(value, file: str, key: str) -> dict:
    if not isinstance(value, dict):
        _refuse(file, key, f"expected a mapping, got {type(value).__name__}")
    return value


def _keys(obj: dict, allowed: Set[str], file: str, where: str) -> None:
    for k in obj:
        if k not in allowed:
            name = f"{where}.{k}" if where else str(k)
            if k in OBJECT_KEYS:
                _refuse(file, name, "names code to import or call")
            _refuse(file, name, f"not a key this program reads (allowed here: {', '.join(sorted(allowed))})")


def _plain(value, file: str, where: str, depth: int = 0) -> None:
    """``value`` holds only strings, numbers, booleans, None, lists and mappings with string keys, none of them a
    ``__...__`` key (Energon would import and call a mapping with ``__module__`` and ``__class__``/``__function__``)."""
    if depth > MAX_NESTING:
        _refuse(file, where, f"nested deeper than {MAX_NESTING} levels")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str) or (k.startswith("__") and k.endswith("__")):
                _refuse(file, f"{where}.{k}", "names code to import or call" if k in OBJECT_KEYS
                        else "not a plain key")
            _plain(v, file, f"{where}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _plain(v, file, f"{where}[{i}]", depth + 1)
    elif not (value is None or isinstance(value, (str, int, float, bool))):
        _refuse(file, where, f"a {type(value).__name__} is not a plain value")


def _energon_class(obj: dict, allowed: List[str], file: str, where: str) -> None:
    """``obj``'s ``__module__`` / ``__class__`` name one of Energon's ``allowed`` classes; no ``__function__``."""
    if "__function__" in obj:
        _refuse(file, f"{where}.__function__" if where else "__function__", "names code to call")
    module, cls = obj.get("__module__"), obj.get("__class__")
    if module != ENERGON_MODULE or cls not in allowed:
        key = f"{where}.__class__" if where else "__class__"
        _refuse(file, key, f"{module}.{cls} is not one of the classes this program reads "
                f"({', '.join(f'{ENERGON_MODULE}.{c}' for c in allowed)})")


def _file_name(value, file: str, key: str) -> str:
    if not isinstance(value, str) or not value or os.path.basename(value) != value or value in (".", ".."):
        _refuse(file, key, f"{value!r} is not a file name in {META}/")
    return value


def check_dataset_folder(folder: str, dataset_config: Optional[str] = None, split_config: Optional[str] = None) -> None:
    """Check a prepared dataset's ``.nv-meta``: its dataset config, split config and info file."""
    meta = os.path.join(folder, META)
    name = dataset_config or "dataset.yaml"
    file = os.path.join(meta, name)
    if not os.path.isfile(file):
        raise DataError(f"{file} not found: not a prepared Energon dataset (energon prepare writes it)")
    cfg = _mapping(load_config_file(file, yaml_only=True), file, "the document")
    if "__module__" in cfg or "__class__" in cfg or "__function__" in cfg:
        _energon_class(cfg, ["CrudeWebdataset"], file, "")
        _keys(cfg, {"__module__", "__class__", "subflavors", "part_filter"}, file, "")
        part_filter = cfg.get("part_filter")
        if part_filter is not None and not (isinstance(part_filter, list)
                                            and all(isinstance(p, str) for p in part_filter)):
            _refuse(file, "part_filter", "only a list of part names is read (a 'module.py:function' string names "
                    "code to run)")
    else:
        _keys(cfg, {"sample_type", "field_map", "subflavors"}, file, "")
        sample_type = _mapping(cfg.get("sample_type"), file, "sample_type")
        _energon_class(sample_type, ["VQASample"], file, "sample_type")
        _keys(sample_type, {"__module__", "__class__"}, file, "sample_type")
        field_map = _mapping(cfg.get("field_map"), file, "field_map")
        for k, v in field_map.items():
            if not isinstance(k, str) or not isinstance(v, str):
                _refuse(file, f"field_map.{k}", "expected a sample field name mapped to a part name string")
    _plain(cfg.get("subflavors"), file, "subflavors")

    info = os.path.join(meta, ".info.json")
    if not os.path.isfile(info):
        info = os.path.join(meta, ".info.yaml")
    shard_names = list(_mapping(load_config_file(info), info, "the document").get("shard_counts") or {})
    split = os.path.join(meta, split_config or "split.yaml")
    if split_config is None and not os.path.isfile(split):
        split = os.path.join(meta, "split.json")
    splits = _mapping(load_config_file(split), split, "the document")
    names = list(shard_names)
    for part in (_mapping(splits.get("split_parts") or {}, split, "split_parts")).values():
        names += part if isinstance(part, list) else [part]
    for n in names:
        if not isinstance(n, str) or os.path.isabs(n) or ".." in n.replace("\\", "/").split("/"):
            raise DataError(f"{split}: shard {n!r} is not a path inside {folder}")


def _check_reference(ref, file: str, where: str, extra: Set[str], seen: Set[str]) -> None:
    ref = _mapping(ref, file, where)
    if "join" in ref or "joiner" in ref:
        _refuse(file, f"{where}.join", "joined datasets are not read (a joiner is code)")
    _keys(ref, _REFERENCE_KEYS | extra, file, where)
    for k in ("subflavors", "subset", "split_part", "shuffle_over_epochs_multiplier", *sorted(extra)):
        _plain(ref.get(k), file, f"{where}.{k}")
    path = ref.get("path")
    if not isinstance(path, str) or not path:
        _refuse(file, f"{where}.path", "expected the path of a dataset folder or metadataset YAML")
    if "://" in path:
        _refuse(file, f"{where}.path", f"{path}: only local paths are read")
    target = os.path.join(os.path.dirname(os.path.abspath(file)), path)
    dataset_config = split_config = None
    if ref.get("dataset_config") is not None:
        dataset_config = _file_name(ref["dataset_config"], file, f"{where}.dataset_config")
    if ref.get("split_config") is not None:
        split_config = _file_name(ref["split_config"], file, f"{where}.split_config")
    if os.path.isfile(target) and target.endswith(".yaml"):
        if dataset_config or split_config:
            _refuse(file, f"{where}.dataset_config", "not read for a nested metadataset")
        check_metadataset(target, seen)
    elif os.path.isdir(os.path.join(target, META)):
        check_dataset_folder(target, dataset_config, split_config)
    else:
        raise DataError(f"{file}: {where}.path: {target} is neither a prepared Energon dataset folder nor a "
                        f"metadataset .yaml")


def check_metadataset(file: str, seen: Optional[Set[str]] = None) -> None:
    """Check a metadataset YAML and every dataset and metadataset it names (every split: Energon opens them all)."""
    real = os.path.realpath(file)
    seen = set() if seen is None else seen
    if real in seen:
        raise DataError(f"{file}: the metadataset names itself (through {len(seen)} metadataset(s))")
    if len(seen) >= MAX_NESTING:
        raise DataError(f"{file}: metadatasets nested deeper than {MAX_NESTING}")
    seen = seen | {real}
    cfg = _mapping(load_config_file(file), file, "the document")
    _energon_class(cfg, ["MetadatasetV2"], file, "")
    _keys(cfg, {"__module__", "__class__", "splits"}, file, "")
    splits: Dict = _mapping(cfg.get("splits"), file, "splits")
    for name, node in splits.items():
        where = f"splits.{name}"
        node = _mapping(node, file, where)
        if "blend" in node or "blend_epochized" in node:
            key = "blend" if "blend" in node else "blend_epochized"
            _keys(node, {key, "subset"}, file, where)
            _plain(node.get("subset"), file, f"{where}.subset")
            entries = node[key]
            if not isinstance(entries, list) or not entries:
                _refuse(file, f"{where}.{key}", "expected a list of dataset references")
            for i, entry in enumerate(entries):
                _check_reference(entry, file, f"{where}.{key}[{i}]",
                                 {"weight"} if key == "blend" else {"repetitions"}, seen)
        else:
            _check_reference(node, file, where, set(), seen)


def check_energon_source(path: str) -> None:
    """Check every config Energon will read for ``--data-path path`` (a prepared dataset folder or a metadataset
    YAML); a :class:`~megatron_glm5.data.DataError` naming the file and key for anything outside the whitelist."""
    if os.path.isdir(path):
        check_dataset_folder(path)
    else:
        check_metadataset(path)
