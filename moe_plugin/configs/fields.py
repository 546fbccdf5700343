"""What a config field accepts, in words. Shared by error messages and ``docs/config.md``."""
from __future__ import annotations

import json
import types
from typing import Any, Literal, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

_BOUNDS = ((Ge, "ge", ">="), (Gt, "gt", ">"), (Le, "le", "<="), (Lt, "lt", "<"))


def _without_none(annotation: Any) -> tuple[Any, bool]:
    """``Optional[X]`` -> (X, True); anything else -> (annotation, False)."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def sub_block(field: FieldInfo) -> type[BaseModel] | None:
    """The nested block model of ``field`` (e.g. ``parallel``), or None for a plain value."""
    inner, _ = _without_none(field.annotation)
    return inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None


def bounds(field: FieldInfo) -> str:
    """The numeric bounds of ``field`` as text, e.g. ``">= 0 and < 1"``; empty when unbounded."""
    parts = []
    for meta in field.metadata:
        for kind, attr, sign in _BOUNDS:
            if isinstance(meta, kind):
                parts.append(f"{sign} {getattr(meta, attr)}")
    return " and ".join(parts)


def type_name(annotation: Any) -> str:
    """A short JSON type name: integer, number, boolean, string, list of integers, 'a' | 'b'."""
    inner, optional = _without_none(annotation)
    if get_origin(inner) is Literal:
        name = " | ".join(json.dumps(v) for v in get_args(inner))
    elif isinstance(inner, type) and issubclass(inner, BaseModel):
        name = "object"
    elif get_origin(inner) is list:
        name = f"list of {type_name(get_args(inner)[0])}s"
    else:
        name = {int: "integer", float: "number", bool: "boolean", str: "string"}.get(inner, str(inner))
    return f"{name} or null" if optional else name


def accepts(field: FieldInfo) -> str:
    """What ``field`` accepts, as the end of "expected ...": "an integer >= 1", "one of ...", ..."""
    inner, optional = _without_none(field.annotation)
    block = sub_block(field)
    if get_origin(inner) is Literal:
        text = "one of " + ", ".join(repr(v) for v in get_args(inner))
    elif block is not None:
        text = f"a JSON object with keys among {', '.join(block.model_fields)}"
    elif inner is bool:
        text = "true or false"
    else:
        article = "an" if type_name(inner)[0] in "aeiou" else "a"
        text = f"{article} {type_name(inner)}"
        if bounds(field):
            text += f" {bounds(field)}"
    return f"{text}, or null" if optional else text


def accepts_item(field: FieldInfo) -> str:
    """What one item of the list ``field`` accepts, e.g. "an integer"."""
    inner, _ = _without_none(field.annotation)
    item = type_name(get_args(inner)[0]) if get_origin(inner) is list else "a valid item"
    return f"{'an' if item[0] in 'aeiou' else 'a'} {item}"


def default_text(field: FieldInfo) -> str:
    """The default as JSON, "required" or "see below" for a nested block."""
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        return "see below" if sub_block(field) is not None else json.dumps(field.default_factory())
    return json.dumps(field.default) if field.default is not PydanticUndefined else ""
