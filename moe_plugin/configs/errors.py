"""ConfigError and the translation of pydantic's errors into one line: ``<key path>: got <value>; <what is
valid>``, e.g. ``moe.parallel.expert: got 3; must divide num_experts (8); valid: 1, 2, 4, 8``.
"""
from __future__ import annotations

import difflib
from typing import Any, Iterable, Optional

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from moe_plugin.configs.fields import accepts, accepts_item, sub_block


class _Missing:
    """The value of a key that is absent (shown as "missing", not as "got None")."""

    def __repr__(self) -> str:
        return "MISSING"

    def __reduce__(self) -> str:
        return "MISSING"  # unpickles as this module's singleton


MISSING = _Missing()


class ConfigError(ValueError):
    """A bad value in the ``"moe"`` block: the message names the key path, the value and what is valid."""

    def __init__(self, path: str, value: Any, expected: str, shown: Optional[str] = None):
        self.path = path
        self.value = value
        self.expected = expected
        self.shown = shown
        # `shown` replaces the repr of the value where a description reads better.
        got = "missing" if value is MISSING else f"got {shown if shown is not None else _show(value)}"
        super().__init__(f"{path}: {got}; {expected}")

    def __reduce__(self):
        # Picklable, so an error raised on one rank reaches a parent process intact.
        return (type(self), (self.path, self.value, self.expected, self.shown))


class FieldProblem(ValueError):
    """Raised inside a validator to blame one key (relative to the block being validated)."""

    def __init__(self, key: str, value: Any, expected: str):
        self.key, self.value, self.expected = key, value, expected
        super().__init__(expected)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _field_at(model: type[BaseModel], keys: tuple[str, ...]) -> tuple[Optional[type[BaseModel]], Optional[FieldInfo]]:
    """The block that owns the last key of ``keys`` and that key's field (None where unknown)."""
    for key in keys[:-1]:
        field = model.model_fields.get(key)
        model = sub_block(field) if field is not None else None
        if model is None:
            return None, None
    return model, model.model_fields.get(keys[-1]) if keys else None


def from_validation_error(err: ValidationError, model: type[BaseModel], root: str) -> ConfigError:
    """The first error of a pydantic ``ValidationError`` as a ``ConfigError``."""
    errors = err.errors()
    first = errors[0]
    # Union members add their type name to the location; keep only real keys and indices.
    loc = tuple(k for k in first["loc"] if isinstance(k, int) or not _is_type_tag(k))
    path = ".".join([root] + [f"[{k}]" if isinstance(k, int) else str(k) for k in loc]).replace(".[", "[")
    keys = tuple(k for k in loc if isinstance(k, str))  # a list item is judged by its list's field
    owner, field = _field_at(model, keys)
    kind = first["type"]
    value = first.get("input")
    problem = (first.get("ctx") or {}).get("error")
    if isinstance(problem, FieldProblem):
        return ConfigError(f"{path}.{problem.key}", problem.value, problem.expected)
    if kind == "extra_forbidden":
        known = sorted(owner.model_fields) if owner is not None else []
        hint = did_you_mean(loc[-1], known)
        return ConfigError(path, value, f"unknown key{hint}; valid keys: {', '.join(known)}")
    if kind == "missing" and field is not None:
        meaning = (field.description or "").split(";")[0].rstrip(".")
        meaning = f" ({meaning[0].lower()}{meaning[1:]})" if meaning else ""
        slip = _near_miss(loc, errors)
        slip = f"; the block has {slip!r} (did you mean {loc[-1]!r}?)" if slip else ""
        return ConfigError(path, MISSING, f"required: {accepts(field)}{meaning}{slip}")
    if field is not None and kind != "value_error":
        expected = accepts_item(field) if isinstance(loc[-1], int) else accepts(field)
        return ConfigError(path, value, f"expected {expected}{_hint(field, value)}")
    message = first["msg"].removeprefix("Value error, ")
    return ConfigError(path, value, message[0].lower() + message[1:])


def _near_miss(loc: tuple, errors: list[dict]) -> Optional[str]:
    """An unknown key next to the missing key ``loc[-1]`` that reads like a slip for it."""
    unknown = [e["loc"][-1] for e in errors if e["type"] == "extra_forbidden" and tuple(e["loc"][:-1]) == loc[:-1]]
    close = difflib.get_close_matches(str(loc[-1]), [str(k) for k in unknown], n=1, cutoff=0.6)
    return close[0] if close else None


def _hint(field: FieldInfo, value: Any) -> str:
    """A nudge for the usual slips: a number in quotes, true for a number, a near-miss choice."""
    choices = getattr(field.annotation, "__args__", ())
    if isinstance(value, str) and choices and all(isinstance(c, str) for c in choices):
        return did_you_mean(value, choices)
    if not any(word in accepts(field) for word in ("integer", "number")):
        return ""
    if isinstance(value, bool):
        return " (true/false is not a number)"
    if isinstance(value, str) and _is_number(value):
        return f" (write the number without quotes: {value}, not {value!r})"
    return ""


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_type_tag(key: str) -> bool:
    # pydantic names union branches like "int", "list[int]", "function-after[...]".
    return key in {"int", "float", "bool", "str", "list[int]", "dict"} or "[" in key or key.startswith("function")
