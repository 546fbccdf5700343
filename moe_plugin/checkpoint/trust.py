"""Whether a checkpoint's pickles may be read as torch reads them (running what they name).

By default nothing is; ``trusting()`` (``--trust-checkpoint``, ``trust=True``) is the one way around it,
for files whose every writer the user trusts: a ``pytorch_model.bin``, a DeepSpeed file holding a class
outside ``compat.torch_files.DEEPSPEED_GLOBALS``, an ``activation_func`` outside the modules a record
may name. No torch import here (the ``moe-plugin`` command's help uses it).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

TRUST_HINT = ("reading it could run code planted in it; if you trust this checkpoint, pass --trust-checkpoint "
              "(trust=True)")
TRUST_HELP = ("read pickle files (pytorch_model.bin, DeepSpeed's files holding classes moe_plugin does not admit)"
              " as torch.load does, which runs any code planted in them: only for files whose every writer you trust")
_TRUST = contextvars.ContextVar("moe_plugin_trust_checkpoint", default=False)


@contextlib.contextmanager
def trusting(trust: bool = True) -> Iterator[None]:
    """Inside (``trust``), files are read as torch reads them, running what they name."""
    token = _TRUST.set(bool(trust) or _TRUST.get())
    try:
        yield
    finally:
        _TRUST.reset(token)


def trusted() -> bool:
    return _TRUST.get()


def trust_argument(fn: Callable) -> Callable:
    """``fn`` with a keyword ``trust`` (default False) that runs it inside ``trusting(trust)``."""
    @functools.wraps(fn)
    def wrapper(*args: Any, trust: bool = False, **kwargs: Any) -> Any:
        with trusting(trust):
            return fn(*args, **kwargs)

    return wrapper
