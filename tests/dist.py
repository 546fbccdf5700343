"""The project's spawn helper: run one function on N gloo ranks and get each rank's result.

    def child(rank, world_size, x):           # module level, so it can be pickled
        ...                                    # torch.distributed is initialised (gloo)
        return {"out": tensor}                 # anything torch.save can write

    results = run_distributed(child, 4, tmp_path, x)   # results[r] is rank r's return value

An exception in any rank is raised again in the parent (same type where it pickles, with the
child's traceback text as its cause), and the other ranks are stopped, so
``pytest.raises(ValueError, match=...)`` works around a distributed call. Ranks run
``torch.set_num_threads(1)``; a rendezvous file and the results live in ``tmp_path``.

Processes start from a fork server that has imported torch, DeepSpeed and Megatron-Core once
per test session: a fresh interpreter per rank would import them again every time (seconds
each on two cores). It has also loaded DeepSpeed's CPU fused Adam, which each rank would load
again (~2.4 s of CPU), and frozen what it holds out of the ranks' garbage collections (0.3-0.7 s a
full collection otherwise): ``tests/dist_preload.py``. Set ``MOE_PLUGIN_TEST_START=spawn`` to use
plain spawn instead.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from launcher import require_slow_mark

START_METHOD = os.environ.get("MOE_PLUGIN_TEST_START", "forkserver")
PRELOAD = ["torch", "torch.distributed", "deepspeed", "megatron.core.parallel_state", "moe_plugin", "pytest",
           "dist_preload"]
TESTS = Path(__file__).resolve().parent
PYTHONPATH_BEFORE = "MOE_PLUGIN_TEST_PYTHONPATH_BEFORE"   # read (and removed) by dist_preload


class RemoteTraceback(Exception):
    """The traceback text of an exception raised in a child rank."""

    def __str__(self) -> str:
        return self.args[0]


def _child(rank: int, fn: Callable, world_size: int, workdir: str, timeout_s: float, args: tuple) -> None:
    torch.set_num_threads(1)
    work = Path(workdir)
    try:
        dist.init_process_group("gloo", init_method=f"file://{work / 'store'}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        torch.save(fn(rank, world_size, *args), work / f"result{rank}.pt")
    except BaseException as exc:
        text = f"rank {rank}:\n{traceback.format_exc()}"
        try:
            payload = pickle.dumps(exc)
            pickle.loads(payload)  # exceptions with custom __init__ may not come back
        except Exception:
            payload = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
        (work / f"error{rank}.pkl").write_bytes(pickle.dumps((payload, text)))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def fp16_answer() -> str:
    """Why DeepSpeed's accelerator refuses fp16 here ("" where it takes it): a CPU says fp16 only where
    oneDNN has fp16 kernels, which many x86-64 CPUs lack; the product then refuses an fp16 config in
    one line (``tests/e2e/test_input_checks.py``), so fp16 cases are skipped with this reason."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    answer = accelerator.is_fp16_supported()
    return "" if answer else (f"DeepSpeed's {accelerator.device_name()} accelerator answers "
                              f"is_fp16_supported() = {answer!r} on this machine")


def needs_fp16(test: Callable) -> Callable:
    """Skips a test (or a parameter) that runs fp16 where DeepSpeed's accelerator has none."""
    why = fp16_answer()
    return pytest.mark.skipif(bool(why), reason=why)(test)


def _start_fork_server() -> None:
    """Start the fork server with ``PRELOAD`` (nothing once it runs). Python 3.11's fork server imports
    ``PRELOAD`` from its own default ``sys.path`` (``multiprocessing.forkserver.main`` drops the
    ``sys_path`` it is given), without this directory: it is put on ``PYTHONPATH`` for the start only,
    and ``dist_preload`` sets the server's ``PYTHONPATH`` back, so that no rank inherits it."""
    import multiprocessing.forkserver

    multiprocessing.set_forkserver_preload(PRELOAD)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS)] + ([before] if before else []))
    os.environ[PYTHONPATH_BEFORE] = "unset" if before is None else f"set:{before}"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before
        os.environ.pop(PYTHONPATH_BEFORE, None)


def run_distributed(fn: Callable, world_size: int, tmp_path: Path, *args: Any, timeout: float = 180.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results by rank.

    ``fn`` must be a module-level function; ``args`` and results must pickle. ``timeout`` (seconds)
    bounds the whole run and every collective.
    """
    require_slow_mark(f"run_distributed ({world_size} rank{'s' if world_size > 1 else ''})")
    if START_METHOD == "forkserver":
        _start_fork_server()
    workdir = tempfile.mkdtemp(prefix="dist-", dir=tmp_path)  # a fresh store per call
    ctx = tmp.start_processes(_child, args=(fn, world_size, workdir, timeout, args), nprocs=world_size,
                              join=False, start_method=START_METHOD)
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"ranks {alive} of {world_size} still running after {timeout:.0f} s")
    except (tmp.ProcessRaisedException, tmp.ProcessExitedException) as failure:
        errors = sorted(Path(workdir).glob("error*.pkl"), key=lambda p: int(p.stem[5:]))
        first = Path(workdir) / f"error{failure.error_index}.pkl"
        if not errors:
            raise
        payload, text = pickle.loads((first if first.exists() else errors[0]).read_bytes())
        raise pickle.loads(payload) from RemoteTraceback(text)
    finally:
        for path in ctx.error_files:   # torch's own traceback files (in the system's temporary directory)
            Path(path).unlink(missing_ok=True)
    return [torch.load(Path(workdir) / f"result{r}.pt", weights_only=False) for r in range(world_size)]


def attempts(results: dict, rank: int) -> Callable:
    """``attempt(name, fn, *args)``: ``results[name] = fn(*args)``, or this rank's traceback as a string
    when it raises, so that one spawn serves several cases and each case's test reports its own failure
    (a refused checkpoint load must not leave the ranks out of step)."""
    def attempt(name: str, fn: Callable, *args: Any) -> None:
        try:
            results[name] = fn(*args)
        except Exception:   # reported by the case's test; the next case goes on
            results[name] = f"rank {rank}:\n{traceback.format_exc()}"
    return attempt


def case_results(results: list, name: str) -> list:
    """Every rank's result of case ``name`` (one entry of each rank's ``attempts`` dict); a rank's
    traceback fails the calling test with that traceback."""
    out = [r[name] for r in results]
    for r in out:
        if isinstance(r, str):
            pytest.fail(r, pytrace=False)
    return out
