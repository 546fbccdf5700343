"""The Hugging Face families the plugin imports and exports, one module each (``Family`` in ``base``).

Every module of this package that defines ``FAMILY`` is registered: adding a family is adding a file.
``REGISTRY`` lists them in their ``order`` (MoE families first); ``family(model_type)`` finds one or
refuses naming the key.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Optional

from moe_plugin.interop.families.base import Family


def _discover() -> tuple[Family, ...]:
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if isinstance(getattr(module, "FAMILY", None), Family):
            found.append(module.FAMILY)
    return tuple(sorted(found, key=lambda f: f.order))


REGISTRY = _discover()
BY_TYPE = {f.model_type: f for f in REGISTRY}
MODEL_TYPES = tuple(BY_TYPE)


def family(model_type: Optional[str], where: str = "config.json") -> Family:
    """The family of ``model_type``, or a ``ConfigError`` naming ``where``'s key and the ones there are."""
    from moe_plugin.configs import ConfigError

    if model_type not in BY_TYPE:
        raise ConfigError(f"{where}: model_type", model_type, f"the plugin imports {', '.join(MODEL_TYPES)}")
    return BY_TYPE[model_type]


def titles(families) -> str:
    """'A, B and C' of the families' titles."""
    names = [f.title for f in families]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
