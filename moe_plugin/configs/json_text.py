"""A DeepSpeed JSON file's text, read as DeepSpeed reads it (hjson), with what hjson reads wrongly or
not at all (bytes that are not UTF-8, nesting deeper than ``MAX_DEPTH``, bare ``NaN`` / ``Infinity``,
numbers no float or int holds) refused in one line naming the file and the key path. How:
docs/design/configs_checks.md.
"""
from __future__ import annotations

import math
import re
from typing import Any, Iterator

from moe_plugin.configs.errors import ConfigError

MAX_DEPTH = 100   # DeepSpeed's JSON nests 3 or 4 levels
MARK = "\x00moe_plugin:"   # a marker string: MARK + "offset:token" (no JSON text holds a NUL)
_TOKENS = re.compile(r'''"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|\#[^\n]*|//[^\n]*|/\*.*?\*/|([\[{])|([\]}])'''
                     r'''|(?<=[:,\[])([ \t]*)(-?Infinity|NaN)(?=[ \t]*(?:[,\]}\r\n#]|//|/\*|$))''', re.S)


class OutOfRange:
    """A number hjson read that no float or int holds (its text kept for the message)."""

    def __init__(self, text: str):
        self.text = text

    def __int__(self) -> int:
        return 0

    def __eq__(self, other: Any) -> bool:
        return other is self

    __hash__ = object.__hash__


def number(text: str) -> Any:
    value = float(text)
    return value if math.isfinite(value) else OutOfRange(text)


def integer(text: str) -> Any:
    try:
        return int(text)
    except ValueError:   # past sys.get_int_max_str_digits()
        return OutOfRange(text)


def position(text: str, offset: int) -> str:
    return f"line {text.count(chr(10), 0, offset) + 1} column {offset - text.rfind(chr(10), 0, offset)}"


def utf8(data: bytes, where: str, valid: str) -> str:
    """``data`` decoded, or a ``ConfigError`` naming ``where`` and the first byte that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - data.rfind(b"\n", 0, err.start)
        raise ConfigError(where, None, valid,
                          shown=f"byte 0x{data[err.start]:02x} at line {line} column {column}, not UTF-8") from None


def read_text(data: bytes, where: str) -> tuple[str, str]:
    """(the text as written, the text hjson is given, with bare NaN / Infinity swapped for markers)."""
    text = utf8(data, where, "a DeepSpeed JSON is UTF-8 text: save it as UTF-8")
    depth, pieces, last = 0, [], 0
    for m in _TOKENS.finditer(text):
        if m.group(1):
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError(where, None, f"a DeepSpeed JSON nests a few levels (at most {MAX_DEPTH} are read)",
                                  shown=f"lists and objects nested {depth} deep at {position(text, m.start())}")
        elif m.group(2):
            depth = max(0, depth - 1)
        elif m.group(4):
            start = m.start(4)
            pieces += [text[last:start], '"\\u0000moe_plugin:', str(start), ":", m.group(4), '"']
            last = m.end(4)
    return text, "".join(pieces + [text[last:]]) if pieces else text


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, value


def refuse_markers(value: Any, text: str, where: str) -> None:
    """A ``ConfigError`` naming the key path of the first marker in ``value``, if any."""
    for path, leaf in _leaves(value, ""):
        key = f"{where}: {path}" if path else where
        if isinstance(leaf, OutOfRange):
            shown = leaf.text if len(leaf.text) <= 40 else f"a number of {len(leaf.text)} characters"
            raise ConfigError(key, None, "beyond the range of a number (a float: about 1.8e308; an integer: 4300 "
                              "digits); write a finite number", shown=shown)
        if isinstance(leaf, str) and leaf.startswith(MARK):
            offset, token = leaf[len(MARK):].split(":", 1)
            raise ConfigError(key, None, "JSON has no NaN or Infinity (DeepSpeed's hjson would read it as text); "
                              "write a finite number", shown=f"{token} at {position(text, int(offset))}")
