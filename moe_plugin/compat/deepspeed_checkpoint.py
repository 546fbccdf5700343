"""What moe_plugin's checkpoints rely on in DeepSpeed 0.19.8's checkpoint code (``runtime/engine.py``).

* File names DeepSpeed writes and reads in a tag: ``mp_rank_XX_model_states.pt`` per model-parallel
  rank (``_get_ckpt_name``, ZeRO 0-2), ``expp_rank_E_mp_rank_XX_optim_states.pt`` per expert-parallel
  rank (``_get_optimizer_ckpt_name``, its MoE save path), ZeRO's ``*zero_pp_rank_D_mp_rank_XX_optim_states.pt``
  (every optimizer file ends ``_optim_states.pt``: ``is_optimizer_file``), and the ``zero_to_*.py``
  recovery scripts it copies beside the tags.
* ``load_moe_state_dict`` reads ``num_local_experts`` of every ``deepspeed.moe.layer.MoE`` module to
  look for its ``layer_*_expert_*`` files: ``no_local_experts`` sets it to 0 on the plugin's markers
  while the engine loads (the experts come from the plugin's own files).
* ``_load_checkpoint`` globs the tag's ``mp_rank_*_model_states.pt`` and, when their number differs
  from the running model-parallel size, merges or splits them for Megatron-LM's key names
  (``state_dict_factory``): ``one_file_per_mp_rank`` stages a load directory with exactly one module
  file per running model-parallel rank, so the loader reads this rank's file as it is.

``tests/test_compat_checkpoint.py`` checks each against the installed DeepSpeed.
"""
from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

MODEL_FILE = re.compile(r"mp_rank_\d+_model_states\.pt")
# every optimizer file DeepSpeed writes: ZeRO's and bf16's partitions, its MoE path's per EP rank
OPTIMIZER_FILE = re.compile(r"\w*_optim_states\.pt")
RECOVERY_SCRIPT = re.compile(r"zero_to_\w+\.py")   # DeepSpeed copies these beside the tags at every save


def model_file_name(mp_rank: int) -> str:
    """DeepSpeed's module file of model-parallel rank ``mp_rank`` (ZeRO 0-2)."""
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def optimizer_file_name(mp_rank: int, ep_rank: int = 0) -> str:
    """DeepSpeed's optimizer file of expert-parallel rank ``ep_rank`` and model-parallel rank
    ``mp_rank`` (its MoE save path writes one per EP rank)."""
    return f"expp_rank_{ep_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def is_optimizer_file(name: str) -> bool:
    """Whether ``name`` is one of DeepSpeed's optimizer files (``*_optim_states.pt``)."""
    return OPTIMIZER_FILE.fullmatch(name) is not None


def without_module_entries(name: str, state: Any, keys: set[str]) -> Any:
    """DeepSpeed's file ``name`` with the entries ``keys`` left out of a module file's ``module``
    state (what the plugin's files hold) and without the optimizer state that its MoE save path puts
    there at ZeRO-0 (``optimizer``: the plugin's record holds it; ZeRO's saves put None there); any
    other file as it is."""
    if not MODEL_FILE.fullmatch(name) or not isinstance(state, dict) or not isinstance(state.get("module"), dict):
        return state
    return {**state, "optimizer": None,
            "module": type(state["module"])((k, v) for k, v in state["module"].items() if k not in keys)}


def is_recovery_script(name: str) -> bool:
    """Whether ``name`` is one of the ``zero_to_*.py`` scripts DeepSpeed copies into a save directory."""
    return RECOVERY_SCRIPT.fullmatch(name) is not None


@contextlib.contextmanager
def no_local_experts(markers: Iterable[nn.Module]) -> Iterator[None]:
    """Inside, the DeepSpeed ``MoE`` modules ``markers`` report no local experts, so the engine's
    ``load_moe_state_dict`` looks for no ``layer_*_expert_*`` files of theirs."""
    markers = list(markers)
    saved = [m.num_local_experts for m in markers]
    for m in markers:
        m.num_local_experts = 0
    try:
        yield
    finally:
        for m, n in zip(markers, saved):
            m.num_local_experts = n


@contextlib.contextmanager
def one_file_per_mp_rank(load_dir: str, tag: str, engine: Any, state: dict) -> Iterator[str]:
    """A load directory (private to this rank, removed afterwards) for ``engine.load_checkpoint``:
    the tag's files other than the module files (links), this rank's module file holding ``state``
    (with the running ``mp_world_size``), and links to it under the other running model-parallel
    ranks' names, so DeepSpeed loads one file without its own merge or split of several."""
    source = os.path.join(load_dir, tag)
    with tempfile.TemporaryDirectory(prefix="moe_plugin_tp_") as staging:
        target = os.path.join(staging, tag)
        os.makedirs(target)
        for name in os.listdir(source):
            if not MODEL_FILE.fullmatch(name):
                os.symlink(os.path.join(source, name), os.path.join(target, name))
        mine = os.path.join(target, model_file_name(engine.checkpoint_mp_rank))
        torch.save({**state, "mp_world_size": engine.mp_world_size}, mine)
        for r in range(engine.mp_world_size):
            name = os.path.join(target, model_file_name(r))
            if name != mine:
                os.symlink(mine, name)
        yield staging


# What DeepSpeed 0.19.8 writes into a module file itself (``_save_checkpoint``, its MoE path); the
# other entries are the caller's ``client_state``.
ENGINE_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "num_experts", "ds_autoep_layers"})


def one_rank_moe_file(saved: dict, module: dict, buffer_names: list[str], num_experts: int,
                      keep_steps: bool) -> dict:
    """A module file of model-parallel rank 0 of a 1-rank MoE model, made from the module file
    ``saved`` of another model: ``module`` and its ``buffer_names``; ``num_experts`` as the MoE load
    path reads it (a list); no optimizer state. ``keep_steps``: ``saved``'s step counters, lr
    scheduler and client state; else the counters at 0 and neither (the metadata then tells the
    loader to leave the lr scheduler as it is)."""
    out = {k: v for k, v in saved.items() if keep_steps or k in ENGINE_KEYS}
    out.update(module=module, buffer_names=list(buffer_names), optimizer=None, param_shapes=None,
               frozen_param_shapes=None, frozen_param_fragments=None, shared_params={}, num_experts=[num_experts],
               ds_autoep_layers=None, mp_world_size=1, dp_world_size=1,
               checkpoint_parallel_dimensions={"pp_degree": 1, "tp_degree": 1})
    if not keep_steps:
        out.update(lr_scheduler=None, global_steps=0, global_samples=0, skipped_steps=0)
    return out
