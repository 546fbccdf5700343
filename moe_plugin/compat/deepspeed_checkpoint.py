"""What moe_plugin's checkpoints rely on in DeepSpeed 0.19.8's checkpoint code (``runtime/engine.py``):
its file names, its markers reporting no local experts during a load, and a load directory with one
module file per running model-parallel rank (no merge or split). Details: docs/design/compat_upstream.md.
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
    """DeepSpeed's optimizer file of ``ep_rank`` and ``mp_rank`` (its MoE save path writes one per EP rank)."""
    return f"expp_rank_{ep_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def is_optimizer_file(name: str) -> bool:
    """Whether ``name`` is one of DeepSpeed's optimizer files (``*_optim_states.pt``)."""
    return OPTIMIZER_FILE.fullmatch(name) is not None


def without_module_entries(name: str, state: Any, keys: set[str]) -> Any:
    """DeepSpeed's file ``name`` without the module entries ``keys`` and a module file's ZeRO-0 optimizer state."""
    if not MODEL_FILE.fullmatch(name) or not isinstance(state, dict) or not isinstance(state.get("module"), dict):
        return state
    return {**state, "optimizer": None,
            "module": type(state["module"])((k, v) for k, v in state["module"].items() if k not in keys)}


def is_recovery_script(name: str) -> bool:
    """Whether ``name`` is one of the ``zero_to_*.py`` scripts DeepSpeed copies into a save directory."""
    return RECOVERY_SCRIPT.fullmatch(name) is not None


@contextlib.contextmanager
def no_local_experts(markers: Iterable[nn.Module]) -> Iterator[None]:
    """Inside, the ``MoE`` modules ``markers`` report no local experts (no ``layer_*_expert_*`` files)."""
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
    """A load directory, private to this rank, whose every module file name holds this rank's ``state``."""
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
    """The module file of a 1-rank MoE model made from ``saved``; ``keep_steps``: its counters and lr scheduler."""
    out = {k: v for k, v in saved.items() if keep_steps or k in ENGINE_KEYS}
    out.update(module=module, buffer_names=list(buffer_names), optimizer=None, param_shapes=None,
               frozen_param_shapes=None, frozen_param_fragments=None, shared_params={}, num_experts=[num_experts],
               ds_autoep_layers=None, mp_world_size=1, dp_world_size=1,
               checkpoint_parallel_dimensions={"pp_degree": 1, "tp_degree": 1})
    if not keep_steps:
        out.update(lr_scheduler=None, global_steps=0, global_samples=0, skipped_steps=0)
    return out
