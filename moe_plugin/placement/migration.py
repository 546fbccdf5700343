"""Expert migration: give MoE layers a new placement and move every expert's state to its new slot.

    report = migrate(run, {"decoder.layers.1.mlp": new_slot_E})   # every rank, at a step boundary

Weights, gradients and optimizer state move in one exchange; the model computes the same function
before and after; a bad placement raises alike on every rank. docs/design/placement_migration.md.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_plugin.checkpoint.optimizer import basic_optimizer, param_state_names
from moe_plugin.compat.deepspeed_zero import expert_group_indices, is_zero_optimizer, my_partition
from moe_plugin.layers.moe_layer import MoELayer, moe_layers
from moe_plugin.placement.pieces import Piece, Pieces, exchange
from moe_plugin.placement.policies import check_placement, moved_experts
from moe_plugin.placement.zero_partitions import Move, add_partition_moves

PlacementLike = Union[Tensor, Sequence[int]]
CPU_GLOO_SECONDS_PER_BYTE = 0.8e-9  # measured: docs/design/placement_migration.md


@dataclass(frozen=True)
class MigrationReport:
    """What one ``migrate`` did: counts over this rank's stage, bytes and time this rank's."""

    moved_experts: int     # (layer, expert) pairs whose slot changed
    crossing_experts: int  # of those, the ones that changed EP rank
    sent_bytes: int
    seconds: float


def placements(model: nn.Module) -> dict[str, Tensor]:
    """{layer name: copy of its placement [E]}."""
    return {name: m.placement.detach().clone() for name, m in moe_layers(model).items()}


def moves(old_E: Tensor, new_E: Tensor) -> list[Move]:
    """(expert, source slot, destination slot) for every expert whose slot changes, by expert id."""
    return [(e, int(s), int(d)) for e, (s, d) in enumerate(zip(old_E.tolist(), new_E.tolist())) if s != d]


def moved_bytes(old_E: PlacementLike, new_E: PlacementLike, ep_size: int, bytes_per_expert: int) -> int:
    """Bytes a placement change of one layer sends between EP ranks: ``bytes_per_expert``
    (``expert_bytes``) for every expert whose EP rank changes."""
    return len(moved_experts(old_E, new_E, ep_size)) * bytes_per_expert


def expert_bytes(layer: MoELayer, zero_stage: int, with_grads: bool = False, state_tensors: int = 2,
                 edp_size: Optional[int] = None) -> int:
    """What one expert of ``layer`` moves over its ETP shards and EDP replicas: weights, gradients if
    ``with_grads``, ``state_tensors`` fp32 optimizer tensors per element (docs/design/placement_migration.md)."""
    x = layer.experts
    p = layer.parallel
    edp = p.edp_size if edp_size is None else edp_size
    shard = sum(w[0].numel() for w in (x.weight1, x.weight2)) * p.etp_size
    weight = shard * x.weight1.element_size()
    if zero_stage == 0:
        return edp * (weight * (1 + with_grads) + shard * 4 * state_tensors)
    master = x.weight1.dtype != torch.float32
    return edp * weight + shard * 4 * (master + state_tensors)


# -- migrate -------------------------------------------------------------------------------------
def migrate(run: Any, new_placements: Mapping[str, PlacementLike], *, groups: Any = None) -> MigrationReport:
    """Give each named MoE layer the placement ``new_placements[name]`` and move its experts' weights,
    gradients and optimizer state there; collective (every rank, with its stage's layers). ``run``:
    what ``moe_plugin.initialize`` returned, or a bare model with ``groups=`` (no optimizer)."""
    model, engine, groups = _unpack(run, groups)
    rank, world = dist.get_rank(), dist.get_world_size()
    layers = moe_layers(model)
    wanted, error = {}, None
    try:
        wanted = _checked(layers, new_placements)
        if engine is not None and is_zero_optimizer(engine.optimizer):
            check_step_boundary(engine)
    except ValueError as exc:
        error = str(exc)
    optimizer = _per_parameter_optimizer(engine)
    zero = engine.optimizer if engine is not None and is_zero_optimizer(engine.optimizer) else None
    plan = {name: moves(layers[name].placement.cpu(), new) for name, new in wanted.items()}
    pieces = _plan_pieces(layers, plan, optimizer, zero, groups)
    dtypes = _agree(groups, error, wanted, _signature(layers, wanted, optimizer), pieces)

    start = time.perf_counter()
    with torch.no_grad():
        exchange(pieces, world, dtypes)
        for name, new in wanted.items():
            layers[name].experts.placement.copy_(new)
    seconds = time.perf_counter() - start
    crossing = sum(1 for name, ms in plan.items() for _e, s, d in ms
                   if s // layers[name].experts.num_local != d // layers[name].experts.num_local)
    return MigrationReport(moved_experts=sum(len(m) for m in plan.values()), crossing_experts=crossing,
                           sent_bytes=pieces.sent_bytes(rank), seconds=seconds)


def _plan_pieces(layers: dict[str, MoELayer], plan: dict[str, list[Move]], optimizer, zero, groups) -> Pieces:
    """This rank's sends and receives, enumerated in the same order on every rank."""
    pieces, layer_of = Pieces(), {}
    rank = groups.rank
    coords = groups.layout.coords(rank)
    for name in sorted(plan):
        experts = layers[name].experts
        for w in experts.stacked():
            layer_of[id(w)] = (experts.num_local, plan[name])
            tensors = [w.data] + ([w.grad] if w.grad is not None else [])
            tensors += [optimizer.state[w][k] for k in param_state_names(optimizer, w)]
            _add_whole_moves(pieces, tensors, experts.num_local, plan[name], lambda ep: _rank_at(groups, ep, None),
                             coords["ep"])
    if zero is not None:
        for i in expert_group_indices(zero):
            if my_partition(zero, i) != coords["edp"]:
                raise RuntimeError(f"ZeRO partition {my_partition(zero, i)} of expert param group {i} on rank {rank} "
                                   f"is not its expert-data-parallel coordinate {coords['edp']}")
        add_partition_moves(pieces, zero, lambda p: layer_of.get(id(p), (1, [])),
                            lambda ep, edp: _rank_at(groups, ep, edp), rank)
    return pieces


def copies_in_placement(items: Sequence[tuple[Any, PlacementLike, Sequence[Tensor]]],
                        groups: Any, fresh: bool = True) -> list[list[Tensor]]:
    """Copies of expert tensors as they would be after a migration, the model left as it is: per item
    (``GroupedExperts``, target slots [E], tensors [L, ...]) the rows of this rank's target slots.
    Collective (one exchange). ``fresh=False``: an item already in place comes back uncopied."""
    rank = groups.rank
    my_ep = groups.layout.coords(rank)["ep"]
    pieces, out = Pieces(), []
    for experts, target, tensors in items:
        target_E = check_placement(target, experts.num_experts)
        moved = moves(experts.placement.cpu(), target_E)   # the same on every rank: the placement is global
        copies = [t.detach().clone() if fresh or moved else t.detach() for t in tensors]
        _add_whole_moves(pieces, copies, experts.num_local, moved,
                         lambda ep: _rank_at(groups, ep, None), my_ep)
        out.append(copies)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, _dtype_names(pieces))
    with torch.no_grad():
        exchange(pieces, dist.get_world_size(), _dtypes(n for names in every for n in names))
    return out


def check_step_boundary(engine: Any) -> None:
    """ZeRO-1/2: raise unless DeepSpeed holds no expert gradient (after ``engine.step()``)."""
    gas = engine.gradient_accumulation_steps()
    if engine.micro_steps % gas:
        raise ValueError(f"migrate under ZeRO stage {engine.zero_optimization_stage()} needs a step boundary: "
                         f"micro step {engine.micro_steps} is inside gradient accumulation of {gas}; call it after "
                         "engine.step()")
    zero = engine.optimizer
    for i in expert_group_indices(zero):
        held = [p for p in zero.bit16_groups[i] if p.grad is not None or getattr(p, "grad_accum", None) is not None]
        if held or getattr(zero, "averaged_gradients", {}).get(i) is not None:
            raise ValueError(f"migrate under ZeRO stage {engine.zero_optimization_stage()} needs a step boundary: "
                             f"expert param group {i} holds gradients (backward ran since the last step)")


def _unpack(run: Any, groups: Any) -> tuple[nn.Module, Any, Any]:
    if isinstance(run, nn.Module):
        if groups is None:
            raise TypeError("migrate(model, ...) needs groups=: the ProcessGroups the model was built with")
        return run, None, groups
    engine = getattr(run, "engine", None)
    if engine is None or getattr(run, "groups", None) is None:
        raise TypeError(f"migrate takes what moe_plugin.initialize returned (with .engine and .groups) or a model "
                        f"and groups=, got {type(run).__name__}")
    return engine.module, engine, groups if groups is not None else run.groups


def _per_parameter_optimizer(engine: Any) -> Optional[torch.optim.Optimizer]:
    """The optimizer that holds per-parameter state; None without an engine or under ZeRO-1/2."""
    if engine is None or is_zero_optimizer(engine.optimizer):
        return None
    opt = basic_optimizer(engine)
    if opt is None:
        raise NotImplementedError(f"migrate does not know the optimizer {type(engine.optimizer).__name__} (ZeRO "
                                  f"stage {engine.zero_optimization_stage()}): supported are the basic fp32 optimizer "
                                  "(ZeRO-0) and DeepSpeed's ZeRO-1/2 optimizer")
    return opt


def _checked(layers: dict[str, MoELayer], new_placements: Mapping[str, PlacementLike]) -> dict[str, Tensor]:
    unknown = sorted(set(new_placements) - set(layers))
    if unknown:
        raise ValueError(f"migrate: unknown MoE layer(s) {unknown}; this rank's MoE layers are {sorted(layers)} "
                         "(under pipeline parallelism each stage names its own)")
    return {name: check_placement(slot_E, layers[name].config.num_experts, f"placement of layer {name!r}")
            for name, slot_E in new_placements.items()}


def _signature(layers: dict[str, MoELayer], wanted: dict[str, Tensor], optimizer) -> list:
    """What the sender and the receiver of a piece must have alike: tensor counts per layer."""
    out = []
    for name in sorted(wanted):
        x = layers[name].experts
        for w in x.stacked():
            out.append((name, w.grad is not None, param_state_names(optimizer, w)))
    return out


def _agree(groups: Any, error: Optional[str], wanted: dict[str, Tensor], signature: list,
           pieces: Pieces) -> list[torch.dtype]:
    """One all-gather: the same error on every rank; returns the exchange's dtypes, the same everywhere."""
    rank = dist.get_rank()
    stage = groups.layout.coords(rank)["pp"]
    mine = (stage, error, {k: v.tolist() for k, v in wanted.items()}, signature, _dtype_names(pieces))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    failed = [(r, e) for r, (_s, e, _w, _sig, _d) in enumerate(every) if e is not None]
    if failed:
        r, message = failed[0]
        raise ValueError(message if r == rank or message == error else f"rank {r}: {message}")
    for r, (s, _e, theirs, their_signature, _d) in enumerate(every):
        if s == stage and (theirs != mine[2] or their_signature != signature):
            raise ValueError(f"migrate: rank {r} of pipeline stage {stage} was given other placements or holds "
                             f"other expert state than rank {rank}: {theirs} vs {mine[2]}; every rank of a stage "
                             "must pass the same placements, at the same point of training")
    return _dtypes(name for *_rest, names in every for name in names)


def _dtype_names(pieces: Pieces) -> list[str]:
    return sorted({str(t.dtype) for t in pieces.tensors})


def _dtypes(names) -> list[torch.dtype]:
    """torch dtypes from their names ("torch.float32"), sorted and without repeats."""
    return [getattr(torch, n.split(".", 1)[1]) for n in sorted(set(names))]


def _rank_at(groups: Any, ep: int, edp: Optional[int]) -> int:
    """The global rank at EP coordinate ``ep`` (and EDP ``edp``) with this rank's other coordinates."""
    layout = groups.layout
    peer = sorted(layout.group_of("ep", groups.rank))[ep]
    return peer if edp is None else sorted(layout.group_of("edp", peer))[edp]


def _add_whole_moves(pieces: Pieces, tensors: list[Tensor], num_local: int, layer_moves: list[Move],
                     rank_of, my_ep: int) -> None:
    """Sends and receives that move whole expert rows ``[l]`` of ``tensors`` (all [L, ...])."""
    ids = [pieces.add_tensor(t) for t in tensors]
    n = tensors[0].numel() // num_local
    for _expert, src, dst in layer_moves:
        if src // num_local == my_ep:
            pieces.sends += [Piece(rank_of(dst // num_local), t, (src % num_local) * n, n) for t in ids]
        if dst // num_local == my_ep:
            pieces.recvs += [Piece(rank_of(src // num_local), t, (dst % num_local) * n, n) for t in ids]
