"""Checkpoints of a model with the plugin's MoE layers, through DeepSpeed's engine.

    from moe_plugin.checkpoint import load_checkpoint, save_checkpoint
    save_checkpoint(run, "ckpt")                          # every rank; tag default "global_step{N}"
    load_path, client_state = load_checkpoint(run, "ckpt")   # tag default: the "latest" file
    save_checkpoint(run, "ckpt", async_save=True)         # written in the background while training goes on;
    poll_save(run)                                        # after each step (collective): committed, or its error
    wait_for_save(run)                                    # before exit

No file is read in a way that runs code from it. The names are imported on first use, so ``export``
runs without DeepSpeed or Megatron. User guide: docs/checkpoints.md; format and design:
docs/design/checkpoint_format.md.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from moe_plugin.lazy import lazy_getattr

if TYPE_CHECKING:   # the names _LAZY hands on, for type checkers and go-to-definition
    from moe_plugin.checkpoint.api import checkpoint_exists, load_checkpoint, poll_save, save_checkpoint, wait_for_save
    from moe_plugin.checkpoint.errors import CheckpointError
    from moe_plugin.checkpoint.export import export_checkpoint, load_export
    from moe_plugin.checkpoint.metadata import read_latest, read_metadata
    from moe_plugin.checkpoint.upcycle import upcycle_checkpoint

_LAZY = {"save_checkpoint": "api", "load_checkpoint": "api", "checkpoint_exists": "api", "wait_for_save": "api",
         "poll_save": "api", "read_latest": "metadata",
         "read_metadata": "metadata", "CheckpointError": "errors", "export_checkpoint": "export",
         "load_export": "export", "upcycle_checkpoint": "upcycle"}
__all__ = sorted(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY)
