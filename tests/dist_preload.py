"""Imported once, by the fork server of ``tests/dist.py`` (the last of its ``PRELOAD``), never by a
test: loads the two DeepSpeed CPU ops that spawned ranks load, the shared-memory all-reduce (at
``deepspeed.comm``'s start) and the fused Adam (DeepSpeed's ``AdamW``), into DeepSpeed's own cache
of loaded ops (``OpBuilder._loaded_ops``), which every rank forked from the server then holds.
Without it each rank of each spawn loads them itself: per op the builder asks py-cpuinfo twice for
the compile flags (a child interpreter each time, ~1.2 s of CPU) and runs ninja over the build,
~2.5 s of CPU per op and rank. It is the same op: the same builder, sources and
``TORCH_EXTENSIONS_DIR`` (``tests/conftest.py``; built there first if it is not yet). Only on
DeepSpeed's CPU accelerator; should a load fail, the ranks load the op themselves, as before.

Last, ``gc.freeze()``: every object the server holds now (the imported torch, DeepSpeed,
Megatron-Core, ...) goes to the collector's permanent generation, which a rank's collections do not
walk -- Python's advice for a server that forks without exec. Each ``gc.collect()`` in a rank (the
layer bench calls one per memory measurement, DeepSpeed's ZeRO and engine some) otherwise walks those
millions of objects and, touching each, copies the rank's shared pages: 0.3-0.7 s a collection here,
the bench's expert-parallel test 40 s of its 45. Objects a rank makes are collected as before.

It also sets the server's ``PYTHONPATH`` back to what it was before ``dist._start_fork_server``
added this directory, so that no rank's environment differs from the test's."""
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


def _load_cpu_ops() -> None:
    try:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        if accelerator.device_name() != "cpu":
            return
        import deepspeed.ops

        for name in ("ShareMemCommBuilder", "FusedAdamBuilder"):
            builder = accelerator.create_op_builder(name)
            if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
                builder.load(verbose=False)
    except Exception:   # the ranks load it themselves (and report what fails)
        pass


_restore_pythonpath()
_load_cpu_ops()
gc.freeze()
