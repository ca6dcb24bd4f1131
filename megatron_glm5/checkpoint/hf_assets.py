"""The non-weight files that make an HF checkpoint usable (tokenizer, chat template, image / video processor), carried
from an HF checkpoint into a converted one and from there (or from an HF folder) into an export.

:data:`ASSET_FILES` lists them with their size bound. They are untrusted input: :func:`read_hf_assets` takes each
one that is present only if it is a regular file inside its folder (a symlink may lead only into a Hugging Face hub
cache's ``blobs``, :func:`~megatron_glm5.checkpoint.safe_load.check_inside`), no larger than its bound, UTF-8, and,
for ``.json`` files, one JSON object; anything else is one :class:`HFAssetError` line. The bytes read and checked
are the bytes written (:func:`write_hf_assets`), so a file changed in between is never copied unchecked.

    assets = read_hf_assets(hf_dir)          # {file name: bytes}, validated
    write_hf_assets(assets, out_tmp_dir)     # before the checksum manifest is written
"""

from __future__ import annotations

import json
import os
from typing import Dict

from megatron_glm5.errors import CheckpointError, one_line
from megatron_glm5.checkpoint.safe_load import check_inside, hub_blobs_dir

_MiB = 1 << 20
# file name -> the largest size accepted (GLM's tokenizer.json is about 20 MiB)
ASSET_FILES: Dict[str, int] = {
    "tokenizer.json": 512 * _MiB,
    "tokenizer_config.json": 16 * _MiB,
    "special_tokens_map.json": 4 * _MiB,
    "chat_template.jinja": 4 * _MiB,
    "chat_template.json": 4 * _MiB,
    "preprocessor_config.json": 4 * _MiB,
    "video_preprocessor_config.json": 4 * _MiB,
    "processor_config.json": 4 * _MiB,
}


class HFAssetError(CheckpointError):
    """A tokenizer / chat-template / processor file that is not safe or not well-formed (one-line message)."""


def _check_content(path: str, data: bytes) -> None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HFAssetError(f"{path}: not UTF-8 text ({one_line(e, 200)})") from None
    if "\x00" in text:
        raise HFAssetError(f"{path}: holds NUL characters; not a text file")
    if path.endswith(".json"):
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise HFAssetError(f"{path}: not valid JSON ({one_line(e, 200)})") from None
        if not isinstance(obj, dict):
            raise HFAssetError(f"{path}: not a JSON object (holds {type(obj).__name__})")


def read_hf_asset(src_dir: str, name: str) -> bytes:
    """The validated bytes of ``src_dir/name`` (one of :data:`ASSET_FILES`, known to exist)."""
    path = os.path.join(src_dir, name)
    real = check_inside(src_dir, name, path, also_inside=hub_blobs_dir(src_dir))
    if not os.path.isfile(real):
        raise HFAssetError(f"{path}: not a regular file")
    limit = ASSET_FILES[name]
    try:
        with open(real, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as e:
        raise HFAssetError(f"{path}: unreadable ({one_line(e, 200)})") from None
    if len(data) > limit:
        raise HFAssetError(f"{path}: larger than {limit // _MiB} MiB; refusing it as a {name}")
    _check_content(path, data)
    return data


def read_hf_assets(src_dir: str) -> Dict[str, bytes]:
    """{file name: bytes} of every :data:`ASSET_FILES` entry present in ``src_dir``, each validated; raises
    :class:`HFAssetError` (or CheckpointError for a path leaving ``src_dir``), one line, for any bad one."""
    return {name: read_hf_asset(src_dir, name) for name in ASSET_FILES
            if os.path.lexists(os.path.join(src_dir, name))}


def write_hf_assets(assets: Dict[str, bytes], dst_dir: str) -> list:
    """Write the validated ``assets`` into ``dst_dir`` (a folder being built, published by the caller); returns
    their names, sorted."""
    for name, data in assets.items():
        if name not in ASSET_FILES:
            raise ValueError(f"{name} is not an HF asset file")
        with open(os.path.join(dst_dir, name), "wb") as fh:
            fh.write(data)
    return sorted(assets)
