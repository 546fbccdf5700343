"""The state a moe_plugin checkpoint keeps beside DeepSpeed's files, and how it goes back in.

* Experts by global id: ``expert_files`` gathers this rank's experts (ETP shards joined) into one
  entry per global id, with their placement and, under ZeRO-0, the expert rows of the basic
  optimizer's state; ``read_experts`` cuts the running layout's shards out of those files.
* ``experts_into_load``: while DeepSpeed loads the module, our experts replace what its file holds
  (its MoE save path writes the module state of data-parallel rank 0 only, so the expert shards of
  one EP rank). A ``load_state_dict`` pre-hook on the module rather than DeepSpeed's
  ``custom_load_fn``, which DeepSpeed's ``PipelineEngine`` refuses; the same for both engines.
* ``marker_without_local_experts``: DeepSpeed looks for no ``layer_*_expert_*`` files of its own.
* RNG (torch, Python, NumPy, accelerator) and the routers' noise generators and pending loads.
* ``load_basic_optimizer``: the ZeRO-0 optimizer after an expert-layout change.
"""
from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch import nn

from moe_plugin.integration.checkpoint_keys import running_state
from moe_plugin.integration.checkpoint_meta import (
    CheckpointError,
    basic_optimizer,
    expert_file,
    local_ids,
    placement_key,
    saved_local_ids,
    stage_view,
)
from moe_plugin.integration.checkpoint_files import read_torch
from moe_plugin.integration.expert_params import DeepSpeedMoEMarker
from moe_plugin.integration.expert_state import expert_weights, full_experts, local_experts
from moe_plugin.layers.router import Router
from moe_plugin.placement.migration import copies_in_placement

try:
    import numpy
except ImportError:  # NumPy's RNG is then neither saved nor restored
    numpy = None


# -- experts -------------------------------------------------------------------------------------
def expert_files(run: Any, path: str) -> dict[str, dict]:
    """{file path: content} of the expert files this rank writes (ETP rank 0 of EDP rank 0; the
    others return {}); collective over the job.

    File ``e`` holds expert e of every MoE layer of the stage, but each layer may place expert e on
    another EP rank (``experts.placement``): the experts are first copied into the static order
    (``placement.migration.copies_in_placement``, one exchange; the model does not change), so
    EP rank p writes the files of experts ``[p * L, (p + 1) * L)``."""
    engine, groups = run.engine, run.groups
    s, coords = groups.layout.sizes, groups.layout.coords(dist.get_rank())
    optimizer = basic_optimizer(engine)
    weights = expert_weights(engine.module)
    items = []
    for w in weights:
        state = optimizer.state.get(w.param, {}) if optimizer is not None else {}
        names = [n for n in sorted(state) if isinstance(state[n], torch.Tensor) and state[n].shape == w.param.shape]
        items.append((w.module, torch.arange(w.module.num_experts), [w.param] + [state[n] for n in names], names))
    copies = copies_in_placement([(m, target, tensors) for m, target, tensors, _ in items], groups)
    files: dict[int, dict] = {}
    for w, (_m, _t, _x, names), (param_LXY, *states_LXY) in zip(weights, items, copies):
        static_ids = list(range(coords["ep"] * w.module.num_local, (coords["ep"] + 1) * w.module.num_local))
        for expert_id, full in full_experts(param_LXY, w, groups.etp, s.etp, static_ids):
            placement = {"ep_rank": coords["ep"], "slot": static_ids.index(expert_id)}
            entry = files.setdefault(expert_id, {"expert_id": expert_id, "stage": coords["pp"], "weights": {},
                                                 "optimizer": {}, "placement": placement})
            entry["weights"][w.key] = full
        for name, value in zip(names, states_LXY):  # the same order on every ETP rank
            for expert_id, full in full_experts(value, w, groups.etp, s.etp, static_ids):
                files[expert_id]["optimizer"].setdefault(w.key, {})[name] = full
    if coords["etp"] != 0 or coords["edp"] != 0:
        return {}
    return {expert_file(path, e, coords["pp"]): entry for e, entry in files.items()}


def read_experts(run: Any, path: str, meta: dict, with_optimizer: bool) -> tuple[dict, dict]:
    """This rank's expert shards cut from the global-id files, for the checkpoint's placement
    (``meta``: its metadata): {key: stacked tensor}, the layers' ``experts.placement`` buffers
    set to the checkpoint's included, and with ``with_optimizer`` {key: {state name: stacked
    tensor}}. The model's own placement does not matter: it takes the checkpoint's."""
    groups = run.groups
    s, coords = groups.layout.sizes, groups.layout.coords(dist.get_rank())
    weights = expert_weights(run.engine.module)
    ids_of = saved_local_ids(meta, run.engine.module, groups)
    view = stage_view(meta, run.engine.module, groups) or {}
    stage_of = {w.key: view.get("from", {}).get(w.key, coords["pp"]) for w in weights}   # saved stage per key
    files = {(e, st): read_torch(expert_file(path, e, st))
             for e in local_ids(meta, run.engine.module, groups) for st in sorted(set(stage_of.values()))}
    files = {k: {**f, "weights": running_state(meta, f.get("weights", {})),   # names of the running model kind
                 "optimizer": running_state(meta, f.get("optimizer", {}))} for k, f in files.items()}
    for (e, st), f in files.items():
        keys = [w.key for w in weights if stage_of[w.key] == st]
        if f.get("expert_id") != e or any(k not in f["weights"] for k in keys):
            raise CheckpointError(f"{expert_file(path, e, st)}: does not hold expert {e} with keys {keys[:4]}")
    stacked = {w.key: local_experts({e: files[e, stage_of[w.key]]["weights"][w.key] for e in ids_of[w.key]}, w,
                                    coords["etp"], s.etp, ids_of[w.key]) for w in weights}
    saved = view.get("placements", {})
    for w in weights:
        slots = saved.get(placement_key(w.key), list(range(w.module.num_experts)))
        stacked[placement_key(w.key)] = torch.tensor(slots, dtype=torch.long)
    moments: dict = {}
    if with_optimizer:
        for w in weights:
            mine = [files[e, stage_of[w.key]] for e in ids_of[w.key]]
            names = set.intersection(*(set(f["optimizer"].get(w.key, {})) for f in mine))
            moments[w.key] = {n: local_experts({e: files[e, stage_of[w.key]]["optimizer"][w.key][n]
                                                for e in ids_of[w.key]}, w, coords["etp"], s.etp, ids_of[w.key])
                              for n in sorted(names)}
    return stacked, moments


@contextlib.contextmanager
def experts_into_load(model: nn.Module, experts: dict) -> Iterator[None]:
    """Inside, ``model.load_state_dict(sd)`` loads ``experts`` (state-dict key -> tensor) in place of
    the entries of ``sd`` with those keys. The hook runs on the root module before its children
    read the (copied) state dict, so the whole load sees our experts."""
    def swap(module, state_dict, prefix, *_args) -> None:
        for key, value in experts.items():
            state_dict[prefix + key] = value

    handle = model.register_load_state_dict_pre_hook(swap)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def marker_without_local_experts(model: nn.Module) -> Iterator[None]:
    """While DeepSpeed loads, our marker reports no local experts, so ``load_moe_state_dict``
    looks for no ``layer_*_expert_*`` files (ours are read by ``load_checkpoint``)."""
    markers = [m for m in model.modules() if isinstance(m, DeepSpeedMoEMarker)]
    saved = [m.num_local_experts for m in markers]
    for m in markers:
        m.num_local_experts = 0
    try:
        yield
    finally:
        for m, n in zip(markers, saved):
            m.num_local_experts = n


# -- optimizer -----------------------------------------------------------------------------------
def load_basic_optimizer(run: Any, path: str, moments: dict) -> None:
    """ZeRO-0 after a layout change: the dense state as saved (the same on every rank of a
    model-parallel slice; the file of EP rank 0), the expert rows re-cut by global expert id.
    Param-group options come from the checkpoint except the expert group's DeepSpeed ``name``,
    which belongs to the new layout."""
    engine = run.engine
    optimizer = basic_optimizer(engine)
    saved = read_torch(os.path.join(path, f"expp_rank_0_mp_rank_{engine.checkpoint_mp_rank:02d}_optim_states.pt"))[
        "optimizer"]
    key_of = {id(w.param): w.key for w in expert_weights(engine.module)}
    state = {}
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"{path}: the optimizer had {len(saved['param_groups'])} param groups, now "
                              f"{len(optimizer.param_groups)}")
    for saved_group, group in zip(saved["param_groups"], optimizer.param_groups):
        for index, param in zip(saved_group["params"], group["params"]):
            entry = dict(saved["state"].get(index, {}))
            for name, value in moments.get(key_of.get(id(param)), {}).items():
                entry[name] = value
            if entry:
                state[index] = entry
        for option in ("name", "moe"):
            if option in group:
                saved_group[option] = group[option]
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


# -- RNG -----------------------------------------------------------------------------------------
def rng_state(model: nn.Module) -> dict:
    """This rank's random streams: torch, Python, NumPy, the accelerator's, and every router's
    noise generators and not-yet-applied load counts."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": numpy.random.get_state() if numpy is not None else None, "accelerator": None, "routers": {}}
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu" and accelerator.is_available():
        state["accelerator"] = accelerator.get_rng_state()
    for name, module in model.named_modules():
        if isinstance(module, Router):
            state["routers"][name] = {"generators": {str(d): g.get_state() for d, g in module._generators.items()},
                                      "load_E": module.load_E.detach().clone()}
    return state


def set_rng_state(model: nn.Module, state: dict) -> None:
    """The inverse of ``rng_state``."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if numpy is not None and state.get("numpy") is not None:
        numpy.random.set_state(state["numpy"])
    if state.get("accelerator") is not None:
        get_accelerator().set_rng_state(state["accelerator"])
    for name, module in model.named_modules():
        if isinstance(module, Router) and name in state["routers"]:
            saved = state["routers"][name]
            for device, gen_state in saved["generators"].items():
                module.generator(torch.device(device)).set_state(gen_state)
            module.load_E.copy_(saved["load_E"])
