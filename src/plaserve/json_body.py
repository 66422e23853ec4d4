"""Untrusted JSON request bodies, parsed within limits that keep the parser safe and fast.

Python's ``json`` recurses once per nesting level (a body 100,000 levels deep raises RecursionError),
converts integer literals with ``int()`` (quadratic in the digits, refused past 4,300), and decodes
``\\ud800``-style escapes into lone surrogates that no tokenizer can encode. :func:`loads` checks the
first two on the raw text before parsing and the third after, and raises :class:`JsonBodyError` (a
``ValueError``) for all of them, so an HTTP layer answers 400 instead of 500.

``NaN``, ``Infinity`` and overflowing numbers (``1e999``) are left to parse as floats: the field they
are in must reject them by name (``SamplingParams`` does).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

MAX_JSON_DEPTH = 64  # nested arrays and objects; a chat request needs about 5
MAX_INT_DIGITS = 40  # digits of a number (2**128 has 39)

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
# then a long number is a run of zeros
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
# A surrogate, escaped (\ud800-\udfff) or as raw bytes (json.loads decodes bytes with "surrogatepass").
_SURROGATE = re.compile(rb"\\[uU][dD][89abcdefABCDEF]|\xed[\xa0-\xbf]")


class JsonBodyError(ValueError):
    """A body that is not JSON, or not within the limits."""


def check_limits(raw: bytes) -> None:
    """Raise :class:`JsonBodyError` when ``raw`` nests arrays and objects deeper than
    ``MAX_JSON_DEPTH`` or has a number of more than ``MAX_INT_DIGITS`` digits (strings are ignored for
    both). Works on the text, in a few linear passes in C and numpy."""
    text = _JSON_STRING.sub(b"", raw)
    if b"0" * (MAX_INT_DIGITS + 1) in text.translate(_DIGITS_AS_ZERO):
        raise JsonBodyError(f"a number in the body has more than {MAX_INT_DIGITS} digits")
    brackets = text.translate(None, _NOT_BRACKETS)
    if brackets:
        codes = np.frombuffer(brackets, dtype=np.uint8)
        depth = int(np.cumsum(np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)).max())
        if depth > MAX_JSON_DEPTH:
            raise JsonBodyError(
                f"the JSON body nests {depth} levels deep; at most {MAX_JSON_DEPTH} are allowed"
            )


def _check_unicode(value: Any) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise JsonBodyError(
                        f"the body holds a string that is not valid Unicode ({e.reason} at "
                        f"character {e.start})"
                    ) from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def loads(raw: bytes) -> Any:
    """``json.loads(raw)`` within the limits (see the module docstring); :class:`JsonBodyError` otherwise."""
    check_limits(raw)
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise JsonBodyError(f"request body is not valid JSON: {e}") from None
    except RecursionError:  # check_limits should have caught it: never a 500 all the same
        raise JsonBodyError(
            f"the JSON body nests too deeply (at most {MAX_JSON_DEPTH} levels)"
        ) from None
    if (b"\\" in raw or b"\xed" in raw) and _SURROGATE.search(raw):
        _check_unicode(value)
    return value
