"""Shared fixtures: no process group outlives a test; ``dist_run`` runs a function on N ranks."""
from __future__ import annotations

import sys

import pytest
import torch.distributed as dist

from dist import run_distributed


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
