"""Megatron-LM's checkpoint layout: a save root holding ``latest_checkpointed_iteration.txt`` (the tracker) that
names one checkpoint folder beside it, ``iter_NNNNNNN`` (a training save) or ``release`` (converted weights, loaded
with ``--pretrained-checkpoint`` / ``--finetune``)::

    ROOT/latest_checkpointed_iteration.txt      "release" or an iteration number
    ROOT/release/ | ROOT/iter_0000010/          the torch_dist checkpoint (metadata.json, .metadata, *.distcp, ...)

The one home of the tracker logic (Megatron-LM's own is ``megatron.training.checkpointing.read_metadata`` /
``get_checkpoint_name``, which need a parsed ``args`` and exit the process on a bad tracker):

* :func:`checkpoint_in` -- the folder a save root's tracker names (None without a tracker); a checkpoint folder
  given instead of its root is refused (the trainer's ``--load`` / ``--pretrained-checkpoint`` check: Megatron-LM
  would start from random weights).
* :func:`resolve_checkpoint_dir` -- for the checkpoint readers (exporter, reader): a save root resolves to the
  folder its tracker names; a checkpoint folder itself is taken as it is.
* :func:`write_release_tracker` -- the tracker of converted weights.

The tracker is untrusted input: it must be a small regular file holding ``release`` or a decimal iteration, and the
folder it names must exist; anything else is one :class:`CheckpointDirError` line.
"""

from __future__ import annotations

import os
from typing import Optional

from megatron_glm5.errors import CheckpointError, one_line

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"
_MAX_TRACKER_BYTES = 64
# files that make a folder a megatron dist checkpoint (metadata.json) or a torch DCP one (.metadata)
_CHECKPOINT_MARKERS = ("metadata.json", ".metadata")


class CheckpointDirError(CheckpointError):
    """A checkpoint directory that Megatron-LM would misread or that names nothing readable (one-line message)."""


def is_checkpoint_folder(path: str) -> bool:
    """Whether ``path`` holds a checkpoint's own files (``metadata.json`` or ``.metadata``)."""
    return any(os.path.isfile(os.path.join(path, m)) for m in _CHECKPOINT_MARKERS)


def folder_name(tracker_text: str) -> Optional[str]:
    """The checkpoint folder a tracker's text names (``release`` or ``iter_NNNNNNN``, Megatron-LM's
    ``get_checkpoint_name``), None when the text is neither ``release`` nor a decimal iteration."""
    name = tracker_text.strip()
    if name == RELEASE:
        return RELEASE
    if name.isascii() and name.isdigit() and len(name) <= 12:
        return f"iter_{int(name):07d}"
    return None


def read_tracker(root: str) -> Optional[str]:
    """The folder name ``root``'s tracker names, None when ``root`` has no tracker; raises
    :class:`CheckpointDirError` (one line) for a tracker that is not a small regular file (not a symbolic link, a
    directory, a FIFO) holding ASCII ``release`` or a decimal iteration with optional whitespace around it: exactly the
    texts Megatron-LM's own reader (``int(text.strip())``, any ASCII-compatible locale) reads the same way."""
    tracker = os.path.join(root, TRACKER_FILE)
    if not os.path.lexists(tracker):
        return None
    if os.path.islink(tracker) or not os.path.isfile(tracker):  # a FIFO would block; a link may point anywhere
        raise CheckpointDirError(f"{tracker}: not a regular file")
    try:
        with open(tracker, "rb") as fh:
            data = fh.read(_MAX_TRACKER_BYTES + 1)
    except OSError as e:
        raise CheckpointDirError(f"{tracker}: unreadable ({one_line(e)})") from None
    if len(data) > _MAX_TRACKER_BYTES:
        raise CheckpointDirError(f"{tracker}: expected an iteration number or 'release', got more than "
                                 f"{_MAX_TRACKER_BYTES} bytes")
    text = data.decode("ascii") if data.isascii() else None
    name = None if text is None else folder_name(text)
    if name is None:
        shown = repr(text.strip()[:40]) if text is not None else "bytes that are not ASCII text"
        raise CheckpointDirError(f"{tracker}: expected an iteration number or 'release', got {shown}")
    return name


def start_iteration(args) -> int:
    """The iteration a Megatron-LM run with these arguments starts after: ``--ckpt-step``, else the iteration
    ``--load``'s tracker names (0 without one, for 'release', with ``--finetune`` and for an unreadable tracker,
    which the ``--load`` checks name)."""
    load = getattr(args, "load", None)
    if getattr(args, "finetune", False) or not load or not os.path.isdir(load):
        return 0
    if getattr(args, "ckpt_step", None) is not None:
        return int(args.ckpt_step)
    try:
        name = read_tracker(load)
    except CheckpointDirError:
        return 0
    return int(name[len("iter_"):]) if name and name.startswith("iter_") else 0


def checkpoint_in(root: str) -> Optional[str]:
    """The checkpoint directory ``root``'s tracker names, None when ``root`` holds no tracker; raises
    :class:`CheckpointDirError` for a tracker that names nothing readable, or files of a checkpoint without one
    (what ``--load`` / ``--pretrained-checkpoint`` refuse: Megatron-LM would start from random weights)."""
    name = read_tracker(root)
    if name is None:
        if is_checkpoint_folder(root):
            parent = os.path.dirname(os.path.abspath(root))
            hint = (f"give {parent}, whose tracker names it" if os.path.isfile(os.path.join(parent, TRACKER_FILE))
                    else f"it has no {TRACKER_FILE} (Megatron-LM would start from random weights)")
            raise CheckpointDirError(f"{root} is a checkpoint's own folder: {hint}")
        return None
    path = os.path.join(root, name)
    if not os.path.isdir(path):
        raise CheckpointDirError(f"{os.path.join(root, TRACKER_FILE)} names {name}, which is not in {root}")
    return path


def resolve_checkpoint_dir(path: str, flag: str = "--load") -> str:
    """The checkpoint folder to read for ``path``: the folder a save root's tracker names (``iter_NNNNNNN`` or
    ``release``), or ``path`` itself when it is a checkpoint folder. Raises :class:`CheckpointDirError` (one line,
    naming ``flag``) for a missing directory, a bad tracker, or a directory that is neither."""
    if not os.path.isdir(path):
        raise CheckpointDirError(f"{flag} {path}: no such directory")
    found = checkpoint_in(path) if read_tracker(path) is not None else None
    if found is not None:
        return found
    if is_checkpoint_folder(path):
        return path
    raise CheckpointDirError(f"{flag} {path}: not a megatron checkpoint (neither a save folder with {TRACKER_FILE} "
                             "nor a checkpoint folder with metadata.json)")


def write_release_tracker(root: str) -> str:
    """Write ``root/latest_checkpointed_iteration.txt`` naming ``release`` (Megatron-LM's layout of converted
    weights); returns its path. ``root`` is a folder being built (published atomically as a whole by the caller)."""
    path = os.path.join(root, TRACKER_FILE)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(RELEASE)
    return path


# the ``checkpoint_version`` Megatron-LM's trainer writes into a checkpoint's common state (``save_checkpoint``); an
# older or missing one makes its loader convert legacy QKV layouts (and refuse virtual pipeline stages)
CHECKPOINT_VERSION = 3.0
