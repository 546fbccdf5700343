"""A ``ConfigError`` reported the way the ``moe-plugin`` command and the example report it: one line
``error: <message>`` on stderr, printed by rank 0 only, and exit status 2 on every rank.

    with moe_plugin.exit_on_config_error():          # in a training script, around the set-up
        run = moe_plugin.initialize("ds_config.json", model_provider)

    except ConfigError as err:                       # or by hand, where main() returns its status
        return moe_plugin.report_config_error(err)

Under the ``deepspeed`` launcher every rank runs the same checks on the same inputs and raises
the same error; without this each would print its own traceback. The rank is torch.distributed's
when a process group exists, else the launcher's ``RANK`` (0 when unset, e.g. a plain ``python``).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from moe_plugin.configs.errors import ConfigError

EXIT_BAD_INPUT = 2


def process_rank() -> int:
    """This process's global rank: torch.distributed's if initialised, else ``RANK``, else 0."""
    dist = sys.modules.get("torch.distributed")   # never imported here: the CLI stays light
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    text = os.environ.get("RANK", "0").strip()
    return int(text) if text.isdigit() else 0


def error_line(err: BaseException) -> str:
    """``error: <message>`` on one line."""
    return "error: " + " ".join(str(err).splitlines())


def report_config_error(err: BaseException, file: TextIO | None = None) -> int:
    """Print ``err`` as one line on rank 0 (stderr by default); return the exit status, 2."""
    if process_rank() == 0:
        print(error_line(err), file=sys.stderr if file is None else file, flush=True)
    return EXIT_BAD_INPUT


@contextmanager
def exit_on_config_error(*errors: type[BaseException]) -> Iterator[None]:
    """Turn a ``ConfigError`` (or one of ``errors``) raised inside into one line on rank 0 and
    ``SystemExit(2)`` on every rank."""
    try:
        yield
    except (ConfigError, *errors) as err:
        raise SystemExit(report_config_error(err)) from None
