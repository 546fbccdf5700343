"""Shared fixtures: no process group outlives a test; ``dist_run`` runs a function on N ranks;
``launcher_port``: a free rendezvous port for a run through the ``deepspeed`` launcher, whose
DeepSpeed shared-memory buffers (``/dev/shm``, named by the port) are removed afterwards, should
the run have left any.

The layout (tests/README.md): ``unit/<package>/`` per package of ``moe_plugin`` (and ``tools/`` for
``moe_plugin_tools``), ``e2e/`` for what a user runs, ``repo/`` for the repository's own rules. The
helpers beside this file (``dist``, ``launcher``, ``ds_json``, ``gpt_tiny``, ``hf_tiny``, ...) are
imported by their names; a test module imports another by its full name (``tests.unit.layers...``)."""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))   # the helpers, by their names

from dist import run_distributed  # noqa: E402

# Every process the tests start finds the venv's tools first, as the ranks of the deepspeed launcher
# do (tests/launcher.py): DeepSpeed builds its CPU ops (the shm all-reduce, CPU Adam) with the first
# ``ninja`` on PATH into one cache, and two ninja versions (the venv's and the system's) disagree on
# the build log, so each would rebuild the op after the other (a minute of two cores each time).
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
# ... and into a cache of this venv's own: two checkouts' venvs (a clone beside the working tree)
# sharing ~/.cache/torch_extensions would each rebuild the op the other built, at every spawn.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


def _clean_up() -> None:
    # Registries first (they hold group handles), then the default group itself.
    adapters = sys.modules.get("moe_plugin.groups.adapters")
    if adapters is not None:
        adapters.unregister()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    _clean_up()
    yield
    _clean_up()


@pytest.fixture
def dist_run(tmp_path):
    """``dist_run(fn, world_size, *args)``: ``run_distributed`` with this test's ``tmp_path``."""

    def run(fn, world_size, *args, timeout: float = 180.0):
        return run_distributed(fn, world_size, tmp_path, *args, timeout=timeout)

    return run


@pytest.fixture
def launcher_port():
    """A free TCP port for ``deepspeed --master_port``. Afterwards the job's ``/dev/shm`` buffers
    (DeepSpeed's CPU all-reduce, named by address and port: no other job's) are removed if any
    remain; a test that checks the job left nothing asserts that before this runs."""
    from moe_plugin.compat.shm_buffers import job_shm_buffers

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    yield port
    for path in job_shm_buffers("127.0.0.1", str(port)):
        path.unlink(missing_ok=True)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts ranks through the deepspeed launcher or spawns ranks "
                                       "(left out by make test-fast)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Before the item's fixtures (module-scoped runs included) are set up: tests/launcher.py's
    # require_slow_mark fails a test that starts several processes without the marker.
    os.environ["MOE_PLUGIN_TEST_SLOW"] = "1" if item.get_closest_marker("slow") else "0"
