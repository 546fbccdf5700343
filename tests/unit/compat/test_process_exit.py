"""``moe_plugin.exit_process``: a process whose gloo thread needs the GIL after the program is done.

The race of ``moe_plugin/compat/process_exit.py`` made certain: on one gloo rank, an all-reduce's
future gets a Python callback that keeps asking for the GIL on the gloo thread (a sleep of a
millisecond at a time) until the interpreter's teardown has begun. Left to the interpreter's exit (after ``destroy_process_group``, as torch
asks), the process aborts ("terminate called without an active exception"), which is what ended
finished training runs now and then under load. Through ``exit_process`` it ends with the given
status, after the ``atexit`` handlers, the script's non-daemon threads and its buffered output; so
does ``exit_on_error`` once the process has a process group (status 2, one line).
"""
from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = r'''
import atexit, sys, threading, time
import torch, torch.distributed as dist

dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)

def late(future):   # on gloo's thread: asks for the GIL every millisecond until the interpreter's teardown
    give_up = time.monotonic() + 30
    while not sys.is_finalizing() and time.monotonic() < give_up:
        time.sleep(0.001)
    return future.value()

group = dist.new_group([0])   # (on the default group, destroy_process_group would wait for the callback)
dist.all_reduce(torch.ones(4), group=group, async_op=True).get_future().then(late)
time.sleep(0.2)   # the callback runs on gloo's thread now
atexit.register(print, "atexit handler ran")
threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished")), daemon=False).start()
sys.stdout.write("buffered, no newline")
if sys.argv[1] == "exit_process":
    from moe_plugin import exit_process
    exit_process(3)
if sys.argv[1] == "run_and_exit":   # an error of this rank's own, after the groups exist
    from moe_plugin import run_and_exit
    run_and_exit(lambda: 1 / 0)
if sys.argv[1] == "raise":   # the same, left to the interpreter
    1 / 0
if sys.argv[1] == "exit_on_error":   # an error every rank raises alike, after the groups exist
    import moe_plugin
    with moe_plugin.exit_on_error():
        raise moe_plugin.ConfigError("moe.num_experts", 3, "expected 4")
dist.destroy_process_group()
sys.exit(3)
'''


def _run(tmp_path, how: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, how, str(tmp_path / f"store-{how}")], capture_output=True,
                          text=True, timeout=120)


def test_exit_process_ends_with_the_status_where_the_interpreters_exit_aborts(tmp_path):
    for _attempt in range(5):   # the race: nearly certain, but a loaded machine can schedule it away once
        aborted = _run(tmp_path, "sys.exit")
        if aborted.returncode < 0:
            break
    # killed by a signal: SIGABRT under torch 2.13 / Python 3.11, SIGSEGV under torch 2.11 / Python 3.12
    assert aborted.returncode in (-6, -11), (aborted.returncode, aborted.stderr[-2000:])
    assert aborted.returncode != -6 or "terminate called without an active exception" in aborted.stderr
    ended = _run(tmp_path, "exit_process")
    assert ended.returncode == 3, (ended.returncode, ended.stderr[-2000:])
    assert "terminate" not in ended.stderr
    out = ended.stdout
    assert "thread finished" in out and "atexit handler ran" in out and "buffered, no newline" in out, out
    assert out.index("thread finished") < out.index("atexit handler ran")   # threads first, as the interpreter does


def test_exit_on_error_after_the_groups_exist_ends_through_exit_process(tmp_path):
    ended = _run(tmp_path, "exit_on_error")
    assert ended.returncode == 2, (ended.returncode, ended.stderr[-2000:])
    assert "terminate" not in ended.stderr and "Traceback" not in ended.stderr, ended.stderr[-2000:]
    assert "error: moe.num_experts: got 3; expected 4" in ended.stderr, ended.stderr[-2000:]
    assert "atexit handler ran" in ended.stdout and "thread finished" in ended.stdout, ended.stdout


def test_an_error_main_lets_out_prints_its_traceback_once_and_ends_with_status_1(tmp_path):
    """``run_and_exit(main)``, the examples' last line: where the interpreter prints the traceback and
    may then die in its teardown (SIGABRT, or SIGSEGV with torch 2.11), it prints the traceback once and
    ends with status 1."""
    for _attempt in range(5):
        aborted = _run(tmp_path, "raise")
        if aborted.returncode < 0:
            break
    assert aborted.returncode in (-6, -11) and "ZeroDivisionError" in aborted.stderr, (aborted.returncode,
                                                                                       aborted.stderr[-2000:])
    ended = _run(tmp_path, "run_and_exit")
    assert ended.returncode == 1, (ended.returncode, ended.stderr[-2000:])
    assert ended.stderr.count("Traceback (most recent call last)") == 1 and "ZeroDivisionError" in ended.stderr
    assert "terminate" not in ended.stderr, ended.stderr[-2000:]
    assert "atexit handler ran" in ended.stdout and "thread finished" in ended.stdout, ended.stdout


POOL = r'''
import concurrent.futures
from moe_plugin import exit_process

pool = concurrent.futures.ThreadPoolExecutor(1)   # alive at the end, its worker idle (a non-daemon thread)
print(pool.submit(lambda: "task ran").result(), flush=True)
exit_process(4)
'''


def test_exit_process_ends_a_script_that_keeps_a_thread_pool():
    # the interpreter's exit tells the pool's idle worker to end before it joins the threads; so must exit_process
    try:
        ended = subprocess.run([sys.executable, "-c", POOL], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as hung:
        raise AssertionError(f"exit_process waited for the pool's idle worker: {hung.stdout!r}") from None
    assert (ended.returncode, ended.stdout) == (4, "task ran\n"), ended.stderr[-2000:]


C_OUTPUT = r'''
import ctypes
from moe_plugin import exit_process

ctypes.CDLL(None).printf(b"printed by C code\n")   # as a C++ op prints: into the C library's stdout buffer
exit_process(0)
'''


def test_exit_process_keeps_what_c_code_printed():
    # stdout a pipe (a launcher's capture) and Python not unbuffered: the C library holds the line until its exit
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    ended = subprocess.run([sys.executable, "-c", C_OUTPUT], capture_output=True, text=True, timeout=120, env=env)
    assert (ended.returncode, ended.stdout) == (0, "printed by C code\n"), ended.stderr[-2000:]
