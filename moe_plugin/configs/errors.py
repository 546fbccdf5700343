"""ConfigError and the translation of pydantic's errors into one readable line."""
from __future__ import annotations

import difflib
from typing import Any, Iterable

from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
    """A bad value in the ``"moe"`` block: the message names the key path, the value and what is valid."""

    def __init__(self, path: str, value: Any, expected: str):
        self.path = path
        self.value = value
        self.expected = expected
        super().__init__(f"{path}: got {_show(value)}; {expected}")


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


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model that owns the last key of ``loc``, walking nested sub-blocks."""
    for key in loc[:-1]:
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            return None
        sub = field.annotation
        candidates = getattr(sub, "__args__", (sub,))
        sub = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if sub is None:
            return None
        model = sub
    return model


def from_validation_error(err: ValidationError, model: type[BaseModel], root: str) -> ConfigError:
    """The first error of a pydantic ``ValidationError`` as a ``ConfigError``."""
    first = err.errors()[0]
    loc = tuple(first["loc"])
    # Union members add their type name to the location; keep only real keys and indices.
    loc = tuple(k for k in loc if isinstance(k, int) or not _is_type_tag(k))
    path = ".".join([root] + [f"[{k}]" if isinstance(k, int) else str(k) for k in loc]).replace(".[", "[")
    kind = first["type"]
    value = first.get("input")
    if kind == "extra_forbidden":
        owner = _model_at(model, loc)
        known = sorted(owner.model_fields) if owner is not None else []
        hint = did_you_mean(loc[-1], known)
        return ConfigError(path, value, f"unknown key{hint}; valid keys: {', '.join(known)}")
    problem = (first.get("ctx") or {}).get("error")
    if isinstance(problem, FieldProblem):
        return ConfigError(f"{path}.{problem.key}", problem.value, problem.expected)
    message = first["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    return ConfigError(path, value, message[0].lower() + message[1:])


def _is_type_tag(key: str) -> bool:
    # pydantic names union branches like "int", "list[int]", "function-after[...]".
    return key in {"int", "float", "bool", "str", "list[int]", "dict"} or "[" in key or key.startswith("function")
