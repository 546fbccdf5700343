"""Checkpoints of a model with the plugin's MoE layers, through DeepSpeed's engine.

    from moe_plugin.checkpoint import load_checkpoint, save_checkpoint
    save_checkpoint(run, "ckpt")                          # every rank; tag default "global_step{N}"
    load_path, client_state = load_checkpoint(run, "ckpt")   # tag default: the "latest" file
    save_checkpoint(run, "ckpt", async_save=True)         # written in the background while training goes on;
    poll_save(run)                                        # after each step (collective): committed, or its error
    wait_for_save(run)                                    # before exit

* ``api``: ``save_checkpoint``, ``load_checkpoint``, ``checkpoint_exists`` (atomic tags, the load's
  order of checks; the on-disk layout in its docstring).
* ``metadata``: ``moe_plugin.json`` (shapes per stage, layout, placement) and whether a checkpoint
  fits the running model. ``errors``: ``CheckpointError``, raised alike on every rank.
* ``experts``: expert weights by global id (ETP shards joined, cut again); ``expert_files``: the
  files holding them and how they go back in; ``optimizer``: the basic (ZeRO-0) optimizer's state;
  ``rng``: every rank's random streams; ``background``: asynchronous saves (host copy, writer thread).
* ``shards``, ``reshard``: tensors and state dicts cut for and joined from TP / ETP ranks;
  ``keys``: a ``PipelineModule`` checkpoint read as a ``GPTModel`` and back.
* ``files``: checksums, named read errors, stale temporary directories; ``tags``: the tag a load
  takes (falling back from a damaged ``latest``), the tags a save keeps, a write that fails;
  ``export``: any checkpoint as the 1-rank ``GPTModel``'s fp32 state dict (``moe-plugin export``); ``upcycle``: an MoE
  checkpoint made from a dense one (``moe-plugin upcycle``); ``one_rank``: a checkpoint written without a run (as
  the 1-rank model's; ``moe-plugin import-hf``); ``architecture``: a load into a model built with other flags
  than the checkpoint records, refused naming the flag.
* ``confine``: every path a checkpoint or an HF directory names resolves inside it (checked by
  ``metadata.read_metadata`` before any file of a tag is read); a save creates its files new.
* No file is read in a way that runs code from it: ``tensor_files`` (safetensors), ``plain_files``
  (the optimizer record, the rng state: safetensors and JSON), DeepSpeed's pickles through
  ``compat.torch_files`` (tensors, plain data and DeepSpeed's few classes; anything else refused);
  ``convert``: a checkpoint of an earlier moe_plugin (pickles of its own) rewritten once, trusted
  (``moe-plugin convert-checkpoint``); ``trust=True`` / ``--trust-checkpoint`` reads pickles as torch does.

DeepSpeed's file names and the loader behaviour relied on: ``moe_plugin.compat.deepspeed_checkpoint``.
The names below are imported on first use, so ``export`` runs without DeepSpeed or Megatron.
"""
from __future__ import annotations

from moe_plugin.lazy import lazy_getattr

_FROM = {"save_checkpoint": "api", "load_checkpoint": "api", "checkpoint_exists": "api", "wait_for_save": "api",
         "poll_save": "api", "read_latest": "metadata",
         "read_metadata": "metadata", "CheckpointError": "errors", "export_checkpoint": "export",
         "load_export": "export", "upcycle_checkpoint": "upcycle", "convert_checkpoint": "convert"}
__all__ = sorted(_FROM)
__getattr__ = lazy_getattr(__name__, _FROM)
