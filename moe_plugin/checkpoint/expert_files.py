"""The expert files of a checkpoint (one per global expert id and stage), and how they go back in.

* ``expert_files`` gathers this rank's experts (ETP shards joined) into one entry per global id,
  with their placement and the expert rows of the optimizer record (``optimizer``: fp32 master and
  Adam's moments, whole over the expert-data-parallel group); ``read_experts`` cuts the running
  layout's shards out of those files.
* ``experts_into_load``: while DeepSpeed loads the module, our experts replace what its file holds
  (its MoE save path writes the module state of data-parallel rank 0 only, so the expert shards of
  one EP rank). A ``load_state_dict`` pre-hook on the module rather than DeepSpeed's
  ``custom_load_fn``, which DeepSpeed's ``PipelineEngine`` refuses; the same for both engines.
* ``marker_without_local_experts``: DeepSpeed looks for no ``layer_*_expert_*`` files of its own.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moe_plugin.checkpoint.errors import CheckpointError
from moe_plugin.checkpoint.experts import expert_weights, full_experts, local_experts
from moe_plugin.checkpoint.keys import running_state
from moe_plugin.checkpoint.metadata import expert_file, local_ids, placement_key, saved_local_ids, stage_view
from moe_plugin.checkpoint.optimizer import MASTER, full_param_state, record_kind, state_names
from moe_plugin.checkpoint.readers import materialize, open_expert
from moe_plugin.compat.deepspeed_checkpoint import no_local_experts
from moe_plugin.compat.deepspeed_moe import DeepSpeedMoEMarker
from moe_plugin.placement.migration import copies_in_placement


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
    names = state_names(engine)[0] if record_kind(engine) is not None else []
    weights = expert_weights(engine.module)
    items = []
    for w in weights:
        states = full_param_state(engine, w.param, names)   # whole over the expert-data-parallel group
        items.append((w.module, torch.arange(w.module.num_experts), [w.param] + states, names))
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
    for entry in files.values():
        _weights_once(entry)
    return {expert_file(path, e, coords["pp"]): entry for e, entry in files.items()}


def _weights_once(entry: dict) -> None:
    """An expert weight whose record has its fp32 master is that master rounded to the weight's
    dtype (DeepSpeed copies the master into the weight after every step): it is not written again,
    ``"weights_from_master"`` names its dtype (``readers.open_expert`` rounds the master back). A
    weight that differs from its rounded master (none is known to) is kept."""
    for key, weight in list(entry["weights"].items()):
        master = entry["optimizer"].get(key, {}).get(MASTER)
        if master is not None and torch.equal(master.to(weight.dtype), weight):
            entry.setdefault("weights_from_master", {})[key] = str(weight.dtype).replace("torch.", "")
            del entry["weights"][key]


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
    files = {(e, st): open_expert(path, meta, e, st)   # headers only: each tensor is read below, if needed
             for e in local_ids(meta, run.engine.module, groups) for st in sorted(set(stage_of.values()))}
    for f in files.values():   # names of the running model kind
        f.weights, f.optimizer = running_state(meta, f.weights), running_state(meta, f.optimizer)
    for (e, st), f in files.items():
        keys = [w.key for w in weights if stage_of[w.key] == st]
        if f.expert_id != e or any(k not in f.weights for k in keys):
            raise CheckpointError(f"{f.path}: does not hold expert {e} with keys {keys[:4]}")
    stacked = {w.key: local_experts({e: materialize(files[e, stage_of[w.key]].weights[w.key]) for e in ids_of[w.key]},
                                    w, coords["etp"], s.etp, ids_of[w.key]) for w in weights}
    saved = view.get("placements", {})
    for w in weights:
        slots = saved.get(placement_key(w.key), list(range(w.module.num_experts)))
        stacked[placement_key(w.key)] = torch.tensor(slots, dtype=torch.long)
    moments: dict = {}
    if with_optimizer:
        for w in weights:
            mine = [files[e, stage_of[w.key]] for e in ids_of[w.key]]
            names = set.intersection(*(set(f.optimizer.get(w.key, {})) for f in mine))
            moments[w.key] = {n: local_experts({e: materialize(files[e, stage_of[w.key]].optimizer[w.key][n])
                                                for e in ids_of[w.key]}, w, coords["etp"], s.etp, ids_of[w.key],
                                               dtype=torch.float32)
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
    with no_local_experts(m for m in model.modules() if isinstance(m, DeepSpeedMoEMarker)):
        yield
