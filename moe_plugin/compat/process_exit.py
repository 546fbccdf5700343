"""Ending a distributed process without the interpreter's teardown racing torch's gloo threads.

A gloo process group runs its collectives on threads of its own (``pt_gloo_runloop``), and such a
thread takes Python's GIL when it drops the last reference to a tensor Python made, or runs a
future's Python callback. torch 2.13's ``destroy_process_group`` does not stop those threads: they
live as long as a Python object holds the group (Megatron-Core's and DeepSpeed's module globals
do). A thread that asks for the GIL after the interpreter has begun its teardown is ended there
with ``pthread_exit``, inside C++ frames that may not unwind, and the process aborts
("terminate called without an active exception", status -6; under torch 2.11 and Python 3.12 a
segmentation fault, -11) after the run has finished and saved; or the teardown waits for a thread
that waits for the GIL, and the process hangs. Under
load (4 ranks on 2 cores) one run in some tens ended so. ``tests/test_process_exit.py`` makes
the race certain with a callback that keeps asking for the GIL on a gloo thread.

``exit_process(status)`` ends the process the other way: what the interpreter's exit would do for
the program (wait for its non-daemon threads, run the ``atexit`` handlers, flush the standard
streams), then ``os._exit``, which ends every thread with the process and skips the teardown
where the race lies. The process groups are destroyed first, as torch asks.

``run_and_exit(main)`` is a script's last line: ``main``'s status through ``exit_process``, and an
exception ``main`` lets out (an error of this rank's own, after the groups exist) printed with its
traceback once and ended with status 1 the same way, where the interpreter would print it and then
abort in its teardown.
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
    """Destroy the default process group (and with it every group) if there is one, wait for
    the program's non-daemon threads, run the ``atexit`` handlers, flush ``sys.stdout`` and
    ``sys.stderr`` (and the C library's streams, which ``os._exit`` would drop), and end the process
    with ``status`` (None: 0, as ``sys.exit``; module docstring: why not ``sys.exit``). A failure to
    destroy the groups is printed and makes a status of 0 into 1."""
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
    """Run ``main`` and end the process with its status through ``exit_process``. An exception it lets
    out prints its traceback once (stderr) and ends with status 1 (``KeyboardInterrupt``: 130;
    ``SystemExit``: its code, a message printed as ``sys.exit`` would)."""
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
    """What the interpreter's exit does first: threading's own exit calls (``concurrent.futures``
    tells the idle workers of a live ``ThreadPoolExecutor`` to end there; joined without it, they
    would wait for work forever), then every non-daemon thread joined (``threading._shutdown``,
    Python 3.11's, which asks for the main thread). From another thread: the non-daemon threads but
    the main one joined."""
    if threading.current_thread() is threading.main_thread():
        threading._shutdown()
        return
    for thread in threading.enumerate():
        if thread not in (threading.current_thread(), threading.main_thread()) and not thread.daemon:
            thread.join()


def _flush_c_streams() -> None:
    """``fflush(NULL)``: what C and C++ code (DeepSpeed's and torch's ops) printed is still in the C
    library's buffers when stdout is a pipe or a file (a launcher's capture) and Python's is not
    unbuffered; the interpreter's exit flushes them, ``os._exit`` does not."""
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):   # no C library to ask: nothing buffered there either
        pass
