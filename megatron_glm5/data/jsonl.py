"""Reading JSONL records that may come from anywhere: each failure is a :class:`~megatron_glm5.data.DataError`
whose one-line message names the record (``FILE:LINE`` or ``TAR:MEMBER``).

:func:`parse_json` turns bad JSON, nesting deeper than Python's recursion limit, an integer longer than Python's
int conversion limit (4,300 digits) and bytes that are not UTF-8 into that error; :func:`text_field` admits only
strings that are text (a JSON ``\\ud800`` escape decodes to a lone
surrogate, which no tokenizer or file can take).
"""

from __future__ import annotations

import json

from megatron_glm5.data import DataError
from megatron_glm5.errors import one_line


def parse_json(text, where: str):
    """``json.loads(text)`` (``text``: str or UTF-8 bytes); :class:`DataError` naming ``where`` if it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: bad JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except ValueError as e:  # an integer of more digits than Python's int-to-str limit (4,300)
        raise DataError(f"{where}: bad JSON ({one_line(e, 200)})") from None


def text_field(record, key: str, where: str, what: str = "") -> str:
    """``record[key]`` of a JSON object, which must be a string of text; ``what`` is added to the missing-key
    message (e.g. the flag that named the key)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if key not in record:
        raise DataError(f"{where}: missing key {key!r}{what}")
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise DataError(f"{where}: {key!r} holds a lone surrogate (a \\ud800-\\udfff escape), not text") from None
    return value
