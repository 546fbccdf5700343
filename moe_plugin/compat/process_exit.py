"""Ending a distributed process without the interpreter's teardown racing torch 2.13's gloo threads
(an abort or a hang after the run finished): ``exit_process`` does what the interpreter's exit does
for the program, then ``os._exit``; ``run_and_exit(main)`` is a script's last line. The race:
docs/design/compat_upstream.md.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from typing import Callable, NoReturn, Optional


def distributed_initialized() -> bool:
    """Whether this process has a default process group (without importing torch)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def exit_process(status: int | None = 0) -> NoReturn:
    """Destroy the process groups, join the non-daemon threads, run ``atexit``, flush Python's and C's
    streams, ``os._exit(status)`` (None: 0; a failure to destroy the groups turns 0 into 1)."""
    status = status or 0
    try:
        if distributed_initialized():   # (torch.distributed not imported: nothing to destroy, torch stays unloaded)
            sys.modules["torch.distributed"].destroy_process_group()
    except Exception as err:   # the process still ends, and says why it ends worse
        print(f"moe_plugin: destroying the process groups failed: {err!r}", file=sys.stderr)
        status = status or 1
    _wait_for_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):   # closed, or replaced by an object without flush
            pass
    _flush_c_streams()
    os._exit(status)


def run_and_exit(main: Callable[[], Optional[int]]) -> NoReturn:
    """``exit_process(main())``; an exception it lets out: its traceback once, then status 1."""
    try:
        status = main()
    except SystemExit as stop:
        status = stop.code
        if status is not None and not isinstance(status, int):
            print(status, file=sys.stderr)
            status = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        status = 130
    except BaseException:   # noqa: BLE001 -- whatever it is, the process ends without the teardown
        traceback.print_exc()
        status = 1
    exit_process(status)


def _wait_for_threads() -> None:
    """What the interpreter's exit does first: threading's exit calls, then the non-daemon threads joined."""
    if threading.current_thread() is threading.main_thread():
        threading._shutdown()
        return
    for thread in threading.enumerate():
        if thread not in (threading.current_thread(), threading.main_thread()) and not thread.daemon:
            thread.join()


def _flush_c_streams() -> None:
    """``fflush(NULL)``: C and C++ output still in the C library's buffers (``os._exit`` drops it)."""
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):   # no C library to ask: nothing buffered there either
        pass
