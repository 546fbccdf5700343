"""Errors that every rank raises alike, reported once: one line ``error: <message>`` on stderr by rank 0,
and the same exit status on every rank (2 for a ``ConfigError``, 1 else).

    with moe_plugin.exit_on_error():                 # around the set-up of a training script
        run = moe_plugin.initialize("ds_config.json", model_provider)
    # or by hand: if not raised_alike(err): raise; return moe_plugin.report_error(err)

Alike: every ``ConfigError`` and any error marked ``alike_on_every_rank(err)``; any other error passes
unchanged. Which errors are marked, and the launcher's grace: docs/design/configs_checks.md.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn, TextIO

from moe_plugin.compat.process_exit import distributed_initialized, exit_process
from moe_plugin.configs.errors import ConfigError

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
LAUNCHER_GRACE_S = 10.0   # rank 0 reaches the same error within this (it is raised alike)
_ALIKE = "_moe_plugin_alike_on_every_rank"


def process_rank() -> int:
    """This process's global rank: torch.distributed's if initialised, else ``RANK``, else 0."""
    if distributed_initialized():   # torch is never imported here: the CLI stays light
        return sys.modules["torch.distributed"].get_rank()
    text = os.environ.get("RANK", "0").strip()
    return int(text) if text.isdigit() else 0


def error_line(err: BaseException) -> str:
    """``error: <message>`` on one line."""
    return "error: " + " ".join(str(err).splitlines())


def alike_on_every_rank(err: BaseException) -> BaseException:
    """Mark ``err`` as raised identically by every rank (so rank 0 alone reports it); returns it."""
    setattr(err, _ALIKE, True)
    return err


def raised_alike(err: BaseException) -> bool:
    """Whether every rank raises ``err`` identically: a ``ConfigError`` or a marked error."""
    return isinstance(err, ConfigError) or getattr(err, _ALIKE, False)


def report_error(err: BaseException, file: TextIO | None = None) -> int:
    """Print ``err`` as one line on rank 0 (stderr by default); return the exit status, 2 for a
    ``ConfigError``, 1 else. Under a launcher that kills the other ranks when one exits, ranks other than
    0 wait up to ``LAUNCHER_GRACE_S`` first, so rank 0's line is not lost."""
    status = EXIT_BAD_INPUT if isinstance(err, ConfigError) else EXIT_FAILED
    if process_rank() == 0:
        print(error_line(err), file=sys.stderr if file is None else file, flush=True)
    elif under_killing_launcher():
        import time

        if distributed_initialized():   # the launcher may kill this rank while it waits: nothing left behind
            from moe_plugin.compat.shm_buffers import remove_shm_buffers

            remove_shm_buffers([process_rank()])
        time.sleep(LAUNCHER_GRACE_S)
    return status


def under_killing_launcher() -> bool:
    """Whether DeepSpeed's ``launch.py`` or torch's elastic agent (which kill the other ranks) started us."""
    return "CROSS_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def report_config_error(err: BaseException, file: TextIO | None = None) -> int:
    """Print ``err`` as one line on rank 0 (stderr by default); return the exit status, 2."""
    report_error(err, file)
    return EXIT_BAD_INPUT


@contextmanager
def exit_on_error(*errors: type[BaseException]) -> Iterator[None]:
    """Turn an error raised alike (``raised_alike``), or one of ``errors`` (status 2), into one line on
    rank 0 and ``SystemExit`` on every rank (2 for bad input, 1 for a marked error); others pass. With a
    process group, ends through ``moe_plugin.exit_process`` instead."""
    try:
        yield
    except (ConfigError, *errors) as err:
        _end(report_config_error(err))
    except BaseException as err:
        if not raised_alike(err):
            raise
        _end(report_error(err))


def _end(status: int) -> NoReturn:
    if distributed_initialized():
        exit_process(status)
    raise SystemExit(status) from None


exit_on_config_error = exit_on_error   # the older name
