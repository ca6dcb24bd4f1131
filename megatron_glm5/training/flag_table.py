"""The flag table of ``pretrain_glm5_vlm.py`` without torch: a snapshot of Megatron-LM's parser with the GLM flags
(:func:`~megatron_glm5.training.arguments.add_glm5_arguments`), and the front parser built from it.

Megatron-LM's parser lives in ``megatron.training.arguments``, whose import loads torch and megatron-core (tens of
seconds on a busy machine). ``flag_table.json`` holds, for the megatron-core release it was written with, every
flag's option strings, dest, action, type name, nargs, choices, default (and the machine's default where it depends
on CUDA, :func:`~megatron_glm5.training.arguments.machine_defaults`), help, group, the bound of a numeric flag
(:func:`~megatron_glm5.training.arguments.flag_bound`) and whether this model refuses it. :func:`check_flags_fast`
serves ``--help`` from it (the GLM groups first, every default shown, refused flags marked) and reports an unknown
flag (with the closest known one), a bad value (type, choice, bound), a bad ``--hf-config`` / ``--model-preset``
/ ``--num-layers`` or a parallel layout / schedule that cannot run (world size, batch sizes, learning-rate schedule,
:func:`~megatron_glm5.training.arguments.check_layout_without_torch`) in one ``PROG: error: ...`` line, exit 2,
before torch is imported; the full parse
(:func:`~megatron_glm5.training.arguments.parse_args`) stays the authority. With another megatron-core installed
than the snapshot's, the front parser steps aside.

    python -m megatron_glm5.training.flag_table --write    # regenerate the snapshot (imports megatron)
    python -m megatron_glm5.training.flag_table --check    # exit 1 when it differs from the live parser
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import sys
from typing import List, Optional

from megatron_glm5.errors import ArgumentError

SNAPSHOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flag_table.json")
GLM_GROUP_PREFIX = "GLM-5.3"
USAGE = "%(prog)s (--hf-config DIR | --model-preset NAME) [--mock-data | --data-path ...] [FLAG ...]"
DESCRIPTION = ("Pretrain or fine-tune GLM-5.3-Flash with Megatron-LM's trainer: the GLM-5.3 flags, then Megatron-LM's "
               "(each with its default).")
EPILOG = ("Flags marked [refused] are Megatron-LM's that this model does not carry; given, the run stops with one "
          "error line.")

_ACTIONS = {
    "_StoreAction": "store", "_StoreConstAction": "store_const", "_StoreTrueAction": "store_true",
    "_StoreFalseAction": "store_false", "_AppendAction": "append", "_AppendConstAction": "append_const",
    "_CountAction": "count", "_HelpAction": "help", "_VersionAction": "version", "_ExtendAction": "extend",
    "BooleanOptionalAction": argparse.BooleanOptionalAction,
}
_TYPES = {"int": int, "float": float, "str": str, "enum": str}


def installed_megatron_core() -> Optional[str]:
    """The installed megatron-core's version (package metadata: no import), or None."""
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def _jsonable(v):
    """A default / choice / const as JSON: an enum member as its name, any other object as its ``repr``."""
    if isinstance(v, enum.Enum):
        return v.name
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    name = getattr(v, "name", None)
    return name if isinstance(name, str) else repr(v)


# ---------------------------------------------------------------------------- the live parser (imports megatron)
class _Parser(Exception):
    """Carries the parser Megatron-LM's ``parse_args`` built out of it, before it parses."""


def live_parser(prog: str = "pretrain_glm5_vlm.py") -> argparse.ArgumentParser:
    """Megatron-LM's parser as its ``parse_args`` builds it, with the GLM flags and this model's defaults except the
    machine's (:func:`~megatron_glm5.training.arguments.add_glm5_flags`)."""
    from megatron.training.arguments import parse_args as megatron_parse_args

    from megatron_glm5.training.arguments import add_glm5_flags, escape_help_percents

    def grab(parser):
        raise _Parser(parser)

    try:
        megatron_parse_args(extra_args_provider=grab)
    except _Parser as e:
        parser = e.args[0]
    parser.prog = prog
    escape_help_percents(parser, prog)
    return add_glm5_flags(parser)


def _refusals(parser: argparse.ArgumentParser) -> dict:
    """``{dest: reason}`` of the flags this model refuses: those
    :func:`~megatron_glm5.training.arguments.check_unsupported_features` / ``check_precision`` refuse when set,
    those that describe the architecture (must equal it), and those whose namesake model config field no flag sets
    (:func:`~megatron_glm5.training.arguments.check_flags_reach_the_model` refuses any other value)."""
    from megatron_glm5.training import arguments as A

    base = parser.parse_args([])
    out = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in out:
            continue
        values = [True] if action.nargs == 0 and action.default in (False, None) else [
            c for c in (action.choices or ()) if _jsonable(c) not in ("none", None)]
        for value in values:
            args = argparse.Namespace(**vars(base))
            setattr(args, action.dest, value)
            try:
                A.check_unsupported_features(args)
                A.check_precision(args)
            except ArgumentError as e:  # the defaults pass: refused for this flag's value
                reason = str(e).split(": ", 1)[1]
                if reason.startswith(f"{_jsonable(value)}: ") or reason.split(": ", 1)[0].isidentifier():
                    reason = reason.split(": ", 1)[1]  # the value it names
                out[action.dest] = reason.split(" (")[0].split(";")[0]
                break
    args = argparse.Namespace(**vars(base))
    hf = A.hf_config_dict(None, "glm5-tiny")
    args.hf_config_dict, args.model_preset = hf, "glm5-tiny"
    from megatron_glm5.config import Glm5Config

    config = Glm5Config.from_hf(hf, use_cpu_initialization=True)
    every_flag_set = argparse.Namespace(**{k: 1 if v is None else v for k, v in vars(args).items()})
    reached = set(A.model_config_overrides(args, "cpu")) | set(A.model_config_overrides(every_flag_set, "cpu"))
    reached |= set(A._FLAGS_READ_BY_THE_TRAINER)
    reached |= set(vars(A._preparse([])))  # the flags that name the architecture
    for action in parser._actions:
        dest = action.dest
        if not action.option_strings or dest in out:
            continue
        if dest in A._ARCHITECTURE_FLAGS:
            out[dest] = "only the value of --hf-config / --model-preset"
        elif hasattr(config, dest) and dest not in reached:
            out[dest] = "only this model's value; " + A._MODEL_FLAG_INSTEAD.get(
                dest, "set by --hf-config / --model-preset or this trainer")
    return out


def live_table(prog: str = "pretrain_glm5_vlm.py") -> dict:
    """The flag table of the live parser (:func:`live_parser`), as the snapshot holds it."""
    from megatron_glm5.training.arguments import flag_bound, machine_defaults

    parser = live_parser(prog)
    refused = _refusals(parser)
    machine = {True: machine_defaults(True), False: machine_defaults(False)}
    mutex = {id(a): i for i, g in enumerate(parser._mutually_exclusive_groups) for a in g._group_actions}
    rows = []
    for group in parser._action_groups:
        for a in group._group_actions:
            kind = type(a).__name__
            type_name = None if a.type is None else _jsonable(getattr(a.type, "__name__", repr(a.type)))
            if a.choices and all(isinstance(c, enum.Enum) for c in a.choices):
                type_name = "enum"  # read by member name (megatron.training.argument_utils)
            elif a.type is not None and type_name not in _TYPES:
                type_name = "other:" + type_name
            bound = flag_bound(a)
            row = dict(
                option_strings=list(a.option_strings), dest=a.dest,
                action=kind if kind in _ACTIONS else "other:" + kind,
                type=type_name, nargs=a.nargs, const=_jsonable(a.const),
                choices=None if a.choices is None else [_jsonable(c) for c in a.choices],
                default=_jsonable(a.default), required=a.required, help=a.help,
                metavar=_jsonable(a.metavar), group=group.title, mutex=mutex.get(id(a)),
                bound=None if bound is None else list(bound), refused=refused.get(a.dest))
            if any(a.dest in m for m in machine.values()):
                row["machine_default"] = {name: _jsonable(machine[cuda].get(a.dest, a.default))
                                          for name, cuda in (("cuda", True), ("cpu", False))}
            rows.append(row)
    return dict(megatron_core=installed_megatron_core(), prog=prog, description=parser.description,
                mutex_required=[g.required for g in parser._mutually_exclusive_groups], actions=rows)


def write_snapshot(path: str = SNAPSHOT) -> None:
    """Write :func:`live_table` to ``path`` (through a temporary file: a failure leaves the old one)."""
    text = json.dumps(live_table(), indent=1, sort_keys=True) + "\n"
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- the front parser (no torch)
def load_table(path: str = SNAPSHOT) -> Optional[dict]:
    """The snapshot, or None when it is missing or was written for another megatron-core than the installed one."""
    try:
        with open(path, encoding="utf-8") as fh:
            table = json.load(fh)
    except (OSError, ValueError):
        return None
    return table if table.get("megatron_core") == installed_megatron_core() else None


def _shown(v) -> str:
    return " ".join(str(x) for x in v) if isinstance(v, list) else str(v)


def _help_text(row: dict, first: dict) -> Optional[str]:
    """The flag's help with its default (and, refused, why) appended; '%' escaped for argparse. ``first``: the row
    of the first flag of its dest, whose default is the dest's (``--no-X`` after ``--X``)."""
    text = row["help"]
    if text == argparse.SUPPRESS:
        return text
    text = text or ""
    said = "%(default)" in text or "(default:" in text  # a help that states its default itself
    if row["action"] not in ("_HelpAction", "_VersionAction") and not said:
        row = first
        machine = row.get("machine_default")
        if machine and machine["cuda"] != machine["cpu"]:
            shown = f"{_shown(machine['cuda'])} with CUDA, {_shown(machine['cpu'])} without"
        else:
            shown = _shown(row["default"])
        text += f" (default: {shown.replace('%', '%%')})"
    if row["refused"]:
        text += f" [refused: {row['refused'].replace('%', '%%')}]"
    return text.strip()


def front_parser(table: dict, prog: str) -> argparse.ArgumentParser:
    """An argparse parser of the table's flags (the GLM groups first): values of a Megatron-LM flag with a type of
    its own are read as text (the full parse reads them)."""
    parser = argparse.ArgumentParser(prog=prog, usage=USAGE, description=DESCRIPTION, epilog=EPILOG, add_help=False,
                                     allow_abbrev=False)
    titles = []
    for row in table["actions"]:
        if row["group"] not in titles:
            titles.append(row["group"])
    titles.sort(key=lambda t: not (t or "").startswith(GLM_GROUP_PREFIX))
    groups = {t: parser.add_argument_group(t) for t in titles}
    mutex, first = {}, {}
    for row in table["actions"]:
        first.setdefault(row["dest"], row)
    for row in table["actions"]:
        container = groups[row["group"]]
        if row["mutex"] is not None:
            if row["mutex"] not in mutex:
                mutex[row["mutex"]] = container.add_mutually_exclusive_group(
                    required=table["mutex_required"][row["mutex"]])
            container = mutex[row["mutex"]]
        action = _ACTIONS.get(row["action"])
        opts = row["option_strings"]
        kw = dict(dest=row["dest"], help=_help_text(row, first[row["dest"]]))
        if action is None:  # an action class of Megatron-LM's own: its value(s) read as text
            action = "store_const" if row["nargs"] == 0 else "store"
        if action == argparse.BooleanOptionalAction:
            opts = [o for o in opts if not (o.startswith("--no-") and "--" + o[5:] in opts)]
        if action in ("store", "append", "extend"):
            typ = _TYPES.get(row["type"]) if row["type"] is not None else None
            kw.update(nargs=row["nargs"], metavar=row["metavar"])
            if typ is not None:
                kw["type"] = typ
            if row["choices"] is not None:
                if row["type"] is None or typ is not None:
                    kw["choices"] = row["choices"]
                elif row["metavar"] is None:
                    kw["metavar"] = "{" + ",".join(str(c) for c in row["choices"]) + "}"
        if action in ("store_const", "append_const"):
            kw["const"] = row["const"]
        if action not in ("help", "version"):
            kw.update(default=row["default"], required=row["required"])
            if action in ("store_const", "append_const", "store_true", "store_false", "count",
                          argparse.BooleanOptionalAction):
                kw.pop("required") if not row["required"] else None
        else:
            kw.pop("dest")
        container.add_argument(*opts, action=action, **kw)
    return parser


def check_flags_fast(argv: Optional[List[str]] = None, prog: str = "pretrain_glm5_vlm.py") -> bool:
    """``--help`` (printed, exit 0) and the checks that need no torch (one line, exit 2), from the snapshot.
    Returns False, having done nothing, when the snapshot does not match the installed megatron-core."""
    from megatron_glm5.training.arguments import (check_architecture_flags, check_layout_without_torch,
                                                  check_numeric_flags, fail, suggest_flag)

    table = load_table()
    if table is None:
        return False
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = front_parser(table, prog)
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        raise SystemExit(0)
    parser.error = lambda message: fail(suggest_flag(message, parser._option_string_actions), prog)
    try:
        check_architecture_flags(argv)
        args = parser.parse_args(argv)
        check_numeric_flags(args, parser._actions)
        check_layout_without_torch(args)
    except ArgumentError as e:
        fail(str(e), prog)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_glm5.training.flag_table", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help=f"write the snapshot ({SNAPSHOT})")
    mode.add_argument("--check", action="store_true", help="exit 1 when the snapshot differs from the live parser")
    args = p.parse_args(argv)
    from megatron_glm5.errors import quiet_library_warnings

    quiet_library_warnings()
    if args.write:
        write_snapshot()
        print(f"wrote {SNAPSHOT}")
        return 0
    with open(SNAPSHOT, encoding="utf-8") as fh:
        same = json.load(fh) == json.loads(json.dumps(live_table()))
    print("the snapshot matches the live parser" if same else
          "the snapshot differs from the live parser: run python -m megatron_glm5.training.flag_table --write")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
