"""Imported once, by the fork server of ``tests/dist.py`` (the last of its ``PRELOAD``), never by a
test. Every rank the tests spawn is forked from that server, so what it does here each rank has:

* DeepSpeed's CPU fused Adam op (DeepSpeed's ``AdamW``) loaded into DeepSpeed's own cache of loaded
  ops (``OpBuilder._loaded_ops``). Each rank that builds an engine with it otherwise loads it again,
  and its builder asks py-cpuinfo twice for the compile flags, a child interpreter each time: ~2.4 s
  of CPU per rank (the shared-memory all-reduce's builder asks nothing: ~0.1 s, left to the ranks).
  It is the same op: the same builder, sources and ``TORCH_EXTENSIONS_DIR`` (``tests/conftest.py``),
  built there first if it is not yet (on a fresh venv, by the first spawn instead of the first run
  that uses it). Only on DeepSpeed's CPU accelerator; should the load fail, the ranks load it
  themselves, as before.
* ``gc.freeze()`` last: every object the server holds (the imported torch, DeepSpeed, Megatron-Core,
  ...) goes to the collector's permanent generation, which a rank's collections do not walk (Python's
  advice for a server that forks without exec). A full collection in a rank otherwise walks those
  ~440,000 objects and, touching each, copies the pages it shares with the server: 0.3-0.7 s each.
  The layer bench collects before each of its memory measurements (``test_bench.py``'s
  expert-parallel tests: 40 s of their 45). Objects a rank makes are collected as before.

It also sets the server's ``PYTHONPATH`` back to what it was before ``dist._start_fork_server`` added
this directory, so that no rank's environment differs from the test's."""
from __future__ import annotations

import gc
import os

_BEFORE = "MOE_PLUGIN_TEST_PYTHONPATH_BEFORE"   # dist.PYTHONPATH_BEFORE


def _restore_pythonpath() -> None:
    before = os.environ.pop(_BEFORE, None)
    if before == "unset":
        os.environ.pop("PYTHONPATH", None)
    elif before is not None:
        os.environ["PYTHONPATH"] = before.removeprefix("set:")


def _load_fused_adam() -> None:
    try:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        if accelerator.device_name() != "cpu":
            return
        builder = accelerator.create_op_builder("FusedAdamBuilder")
        if builder is not None:
            builder.load(verbose=False)
    except Exception:   # the ranks load it themselves (and report what fails)
        pass


_restore_pythonpath()
_load_fused_adam()
gc.freeze()
