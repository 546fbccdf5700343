"""The expert files of a checkpoint (one safetensors file per global expert id and stage), written
from any placement and read back into any layout.

Each file holds the full expert (ETP shards joined) of every MoE layer of its stage with its rows of
the optimizer record. ``experts_into_load`` puts our experts into DeepSpeed's module load (a
``load_state_dict`` pre-hook, the same for both engines). Design: docs/design/checkpoint_format.md.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from moe_plugin.checkpoint.errors import CheckpointError
from moe_plugin.checkpoint.experts import expert_weights, full_experts, local_experts
from moe_plugin.checkpoint.keys import running_state
from moe_plugin.checkpoint.metadata import expert_file, local_ids, placement_key, saved_local_ids, stage_view
from moe_plugin.checkpoint.optimizer import MASTER, dtype_name, full_param_state, record_kind, state_names
from moe_plugin.checkpoint.readers import (
    OPTIMIZER_MARK,
    expert_file_metadata,
    expert_file_specs,
    materialize,
    open_expert,
)
from moe_plugin.checkpoint.tensor_files import TensorWriter
from moe_plugin.compat.deepspeed_checkpoint import no_local_experts
from moe_plugin.compat.deepspeed_moe import DeepSpeedMoEMarker
from moe_plugin.placement.migration import copies_in_placement


# -- experts -------------------------------------------------------------------------------------
def expert_layers(run: Any, fresh: bool = True) -> Iterator[tuple[Any, list[str], list[int], dict, dict]]:
    """Per expert weight of the stage, after its collectives: (weight, state names, ids this rank writes,
    {id: full weight}, {state name: {id: full row}}). Collective; one layer alive at a time."""
    engine, groups = run.engine, run.groups
    s, coords = groups.layout.sizes, groups.layout.coords(dist.get_rank())
    names = state_names(engine)[0] if record_kind(engine) is not None else []
    writes = coords["etp"] == 0 and coords["edp"] == 0
    for w in expert_weights(engine.module):
        states = full_param_state(engine, w.param, names)   # whole over the expert-data-parallel group
        (param_LXY, *states_LXY), = copies_in_placement([(w.module, torch.arange(w.module.num_experts),
                                                          [w.param] + states)], groups, fresh=fresh)
        del states
        ids = list(range(coords["ep"] * w.module.num_local, (coords["ep"] + 1) * w.module.num_local))
        weights = dict(full_experts(param_LXY, w, groups.etp, s.etp, ids))
        rows = {name: dict(full_experts(value, w, groups.etp, s.etp, ids)) for name, value in zip(names, states_LXY)}
        yield w, names, ids, weights if writes else {}, rows if writes else {}


def expert_entries(run: Any, path: str) -> dict[str, dict]:
    """{file path: content} of this rank's expert files, every layer in memory (an asynchronous save)."""
    coords = run.groups.layout.coords(dist.get_rank())
    files: dict[int, dict] = {}
    failure: Optional[CheckpointError] = None   # raised after the last layer: the collectives go on
    for w, _names, ids, weights, rows in expert_layers(run):
        for e in ids if weights and failure is None else []:
            entry = files.setdefault(e, {"expert_id": e, "stage": coords["pp"], "weights": {}, "optimizer": {},
                                         "from_master": {},
                                         "placement": {"ep_rank": coords["ep"], "slot": ids.index(e)}})
            if MASTER in rows:   # the file keeps the master alone: the weight is checked now, not kept
                try:
                    _check_rounded(w.key, e, rows[MASTER][e], weights[e])
                except CheckpointError as exc:
                    failure = exc
                entry["from_master"][w.key] = dtype_name(weights[e].dtype)
            else:
                entry["weights"][w.key] = weights[e]
            entry["optimizer"][w.key] = {name: rows[name][e] for name in rows}
    if failure is not None:
        raise failure
    return {expert_file(path, e, coords["pp"]): entry for e, entry in files.items()}


def write_expert_files(run: Any, path: str) -> None:
    """Write this rank's expert files layer by layer (the peak holds one layer's experts); collective."""
    engine, groups = run.engine, run.groups
    coords = groups.layout.coords(dist.get_rank())
    writers: dict[int, TensorWriter] = {}
    failure: Optional[BaseException] = None   # raised after the last layer: the collectives go on
    for w, names, ids, weights, rows in expert_layers(run, fresh=False):
        if failure is not None or not weights:
            continue
        try:
            if not writers:   # the first layer: every file planned from the model's shapes
                writers = _writers(engine, groups, names, ids, path, coords)
            for e in ids:
                if MASTER in rows:
                    _check_rounded(w.key, e, rows[MASTER][e], weights[e])
                else:
                    writers[e].write(w.key, weights[e])
                for name in rows:
                    writers[e].write(w.key + OPTIMIZER_MARK + name, rows[name][e])
        except (OSError, ValueError, CheckpointError) as exc:
            failure = exc
            for writer in writers.values():
                writer.abandon()
    if failure is not None:
        raise failure
    for writer in writers.values():
        writer.close()


def _writers(engine: Any, groups: Any, names: list[str], ids: list[int], path: str,
             coords: dict) -> dict[int, TensorWriter]:
    s = groups.layout.sizes
    weights = {w.key: (w.param.dtype, w.full_shape(s.etp)[1:]) for w in expert_weights(engine.module)}
    rounded = MASTER in names
    states = {key: {name: (torch.float32, shape) for name in names} for key, (_dtype, shape) in weights.items()}
    specs = expert_file_specs({} if rounded else weights, states)
    from_master = {key: dtype_name(dtype) for key, (dtype, _shape) in weights.items()} if rounded else {}
    return {e: TensorWriter(expert_file(path, e, coords["pp"]), specs,
                            expert_file_metadata(e, coords["pp"], {"ep_rank": coords["ep"], "slot": ids.index(e)},
                                                 from_master))
            for e in ids}


def write_expert_file(entry: dict, path: str) -> None:
    """One expert file from its content (``expert_entries``): the bytes ``write_expert_files`` writes."""
    weights = {k: (v.dtype, list(v.shape)) for k, v in entry["weights"].items()}   # none where kept as masters
    states = {k: {n: (v.dtype, list(v.shape)) for n, v in s.items()} for k, s in entry["optimizer"].items()}
    specs = expert_file_specs(weights, states)
    with TensorWriter(path, specs, expert_file_metadata(entry["expert_id"], entry["stage"], entry["placement"],
                                                        entry["from_master"])) as out:
        for name in specs:
            key, _, state = name.partition(OPTIMIZER_MARK)
            out.write(name, entry["optimizer"][key][state] if state else entry["weights"][key])


def _check_rounded(key: str, expert_id: int, master: Optional[torch.Tensor], weight: torch.Tensor) -> None:
    """Raise unless ``weight`` is its fp32 ``master`` rounded (then the file keeps the master only)."""
    if master is None or not torch.equal(master.to(weight.dtype), weight):
        raise CheckpointError(f"{key}: expert {expert_id}'s weight is not its fp32 master rounded to "
                              f"{weight.dtype}; this optimizer's state cannot be saved once")


def read_experts(run: Any, path: str, meta: dict, with_optimizer: bool) -> tuple[dict, dict]:
    """This rank's expert shards for the checkpoint's placement ({key: stacked tensor}, placement buffers
    included) and, ``with_optimizer``, {key: {state name: stacked tensor}}."""
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
    """Inside, ``model.load_state_dict(sd)`` loads ``experts`` ({key: tensor}) instead of ``sd``'s entries."""
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
    """While DeepSpeed loads, the marker has no local experts (no ``layer_*_expert_*`` files looked for)."""
    with no_local_experts(m for m in model.modules() if isinstance(m, DeepSpeedMoEMarker)):
        yield
