"""Expert placement policies: pure functions from observed load to a placement ([E] slots):
``static``, ``greedy`` (SmartMoE's load balancing), ``network_aware`` (fewest cross-node routes within
a compute bound) and ``align`` (as few experts moved as possible). docs/design/placement_load.md.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor


def _slots_per_rank(E: int, P: int) -> int:
    if not isinstance(P, int) or P < 1:
        raise ValueError(f"the EP size P must be a positive integer, got {P!r}")
    if E < 1 or E % P:
        raise ValueError(f"{E} experts cannot be spread evenly over {P} EP ranks; P must divide E")
    return E // P


def _as_load(load_E) -> Tensor:
    load = torch.as_tensor(load_E).detach().cpu().double()
    if load.dim() != 1:
        raise ValueError(f"load_E must be one count per expert, got shape {tuple(load.shape)}")
    if load.numel() and load.min() < 0:
        raise ValueError(f"load_E must be non-negative, got a minimum of {load.min().item()}")
    return load


def static(E: int, P: int) -> Tensor:
    """Expert e in slot e: rank ``e // (E / P)`` hosts a contiguous block of experts."""
    _slots_per_rank(E, P)
    return torch.arange(E, dtype=torch.int64)


def rank_of(placement: Tensor, P: int) -> Tensor:
    """[E] the EP rank that hosts each expert."""
    return torch.as_tensor(placement).long() // _slots_per_rank(len(placement), P)


def check_placement(slot_E, E: int, name: str = "placement") -> Tensor:
    """``slot_E`` as an int64 CPU tensor once it is a permutation of the slots ``0..E-1``."""
    t = torch.as_tensor(slot_E)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() != 1 or t.numel() != E:
        raise ValueError(f"{name}: expected {E} integer slots (a 1-D tensor, one per expert), got "
                         f"shape {tuple(t.shape)} dtype {t.dtype}")
    t = t.detach().to("cpu", torch.long)
    if sorted(t.tolist()) != list(range(E)):
        raise ValueError(f"{name}: {t.tolist()} is not a permutation of the slots 0..{E - 1} (each expert "
                         "needs a distinct slot)")
    return t


def rank_loads(load_E, placement, P: int) -> Tensor:
    """[P] the load each EP rank processes under ``placement`` (float64)."""
    load = _as_load(load_E)
    return torch.zeros(P, dtype=torch.float64).index_add_(0, rank_of(placement, P), load)


def imbalance(load_E, placement, P: int) -> float:
    """Max rank load / mean rank load under ``placement`` (1.0: balanced; 1.0 for no load)."""
    loads = rank_loads(load_E, placement, P)
    mean = loads.mean().item()
    return loads.max().item() / mean if mean > 0 else 1.0


def nodes_of(ep_ranks: Sequence[int], ranks_per_node: int) -> list[int]:
    """Node index of each EP rank, from the EP group's global ranks and the ranks per node."""
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
    return [int(r) // ranks_per_node for r in ep_ranks]


def cross_node_routes(traffic_PE, placement, node_of_rank: Sequence[int]) -> float:
    """Routes whose sender's node differs from the node of the expert's rank."""
    traffic = torch.as_tensor(traffic_PE).double()
    P = traffic.shape[0]
    node = torch.as_tensor(list(node_of_rank))
    expert_node = node[rank_of(placement, P)]                # [E]
    crossing = node[:, None] != expert_node[None, :]         # [P, E]
    return float((traffic * crossing).sum())


def _to_placement(ranks_E: list[int], P: int) -> Tensor:
    """Slots from a rank per expert: on each rank, experts in id order take its slots."""
    E = len(ranks_E)
    L = E // P
    placement = torch.empty(E, dtype=torch.int64)
    used = [0] * P
    for e, r in enumerate(ranks_E):
        placement[e] = r * L + used[r]
        used[r] += 1
    return placement


def _order(load: Tensor) -> list[int]:
    """Experts heaviest first; equal loads by id (deterministic on every rank)."""
    w = load.tolist()
    return sorted(range(len(w)), key=lambda e: (-w[e], e))


def greedy(load_E, P: int, *, refine: bool = True) -> Tensor:
    """Heaviest expert first onto the least-loaded rank with a free slot (ties: lowest rank), then
    (``refine``) swaps that lower the most loaded rank's load."""
    load = _as_load(load_E)
    L = _slots_per_rank(len(load), P)
    w = load.tolist()
    loads, free, ranks = [0.0] * P, [L] * P, [0] * len(w)
    for e in _order(load):
        r = min((r for r in range(P) if free[r]), key=lambda r: (loads[r], r))
        ranks[e], loads[r], free[r] = r, loads[r] + w[e], free[r] - 1
    if refine:
        ranks = _refine_max(ranks, load, P)
    return _to_placement(ranks, P)


def _refine_max(ranks: list[int], load: Tensor, P: int, max_swaps: int = 10_000) -> list[int]:
    """Best swap between the most loaded rank and any other, while it lowers their maximum."""
    ranks, w = list(ranks), load.tolist()
    loads = [0.0] * P
    for e, r in enumerate(ranks):
        loads[r] += w[e]
    for _ in range(max_swaps):
        top = max(range(P), key=lambda r: (loads[r], -r))
        best, best_pair = loads[top], None
        for a in (e for e in range(len(w)) if ranks[e] == top):
            for b in (e for e in range(len(w)) if ranks[e] != top and w[e] < w[a]):
                d = w[a] - w[b]
                worst = max(loads[top] - d, loads[ranks[b]] + d)
                if worst < best - 1e-9:
                    best, best_pair = worst, (a, b)
        if best_pair is None:
            break
        a, b = best_pair
        rb = ranks[b]
        d = w[a] - w[b]
        ranks[a], ranks[b] = rb, top
        loads[top] -= d
        loads[rb] += d
    return ranks


def _node_preferring(load: Tensor, cross_EN: Tensor, node: list[int], cap: float) -> list[int]:
    """Step (1) of ``network_aware``: each expert onto the in-bound rank that crosses least."""
    P, (E, _) = len(node), cross_EN.shape
    L = E // P
    crossing = cross_EN.T.tolist()   # crossing[n][e], plain lists for a Python loop
    w = load.tolist()
    loads, free, ranks = [0.0] * P, [L] * P, [0] * E
    for e in _order(load):
        open_ranks = [r for r in range(P) if free[r]]
        within = [r for r in open_ranks if loads[r] + w[e] <= cap + 1e-9]
        if within:
            r = min(within, key=lambda r: (crossing[node[r]][e], loads[r], r))
        else:
            r = min(open_ranks, key=lambda r: (loads[r], r))
        ranks[e], loads[r], free[r] = r, loads[r] + w[e], free[r] - 1
    return ranks


def _improve_by_swaps(ranks: list[int], load: Tensor, cross_EN: Tensor, node: list[int], cap: float,
                      max_swaps: Optional[int] = None) -> list[int]:
    """Step (2) of ``network_aware``: the best swap across nodes within ``cap``, while one cuts routes."""
    P, (E, _) = len(node), cross_EN.shape
    ranks_E = torch.as_tensor(ranks, dtype=torch.int64)
    node_P = torch.as_tensor(node, dtype=torch.int64)
    loads = torch.zeros(P, dtype=torch.float64).index_add_(0, ranks_E, load)
    delta = load[:, None] - load[None, :]                    # [a, b]: what a's rank loses, b's gains
    for _ in range(max_swaps if max_swaps is not None else 4 * E):
        node_E = node_P[ranks_E]
        own = cross_EN[torch.arange(E), node_E]                # [E] routes crossing now
        there = cross_EN[:, node_E]                            # [a, b] a's crossing on b's node
        gain = own[:, None] + own[None, :] - there - there.T
        rank_load = loads[ranks_E]
        ok = ((node_E[:, None] != node_E[None, :]) & (rank_load[:, None] - delta <= cap + 1e-9)
              & (rank_load[None, :] + delta <= cap + 1e-9))
        gain = torch.where(ok, gain, torch.full_like(gain, -1.0))
        best = int(torch.argmax(gain))
        if gain.view(-1)[best].item() <= 1e-9:
            break
        a, b = divmod(best, E)
        ra, rb = int(ranks_E[a]), int(ranks_E[b])
        loads[ra] -= delta[a, b]
        loads[rb] += delta[a, b]
        ranks_E[a], ranks_E[b] = rb, ra
    return ranks_E.tolist()


def network_aware(load_E, traffic_PE, P: int, node_of_rank: Optional[Sequence[int]] = None, *,
                  ranks_per_node: Optional[int] = None, slack: float = 0.1) -> Tensor:
    """Fewest cross-node routes with max rank load <= (1 + slack) x greedy's; nodes from
    ``node_of_rank`` or ``ranks_per_node`` (EP ranks laid out contiguously)."""
    load = _as_load(load_E)
    E = len(load)
    _slots_per_rank(E, P)
    traffic = torch.as_tensor(traffic_PE).detach().cpu().double()
    if traffic.shape != (P, E):
        raise ValueError(f"traffic_PE must have shape (P, E) = ({P}, {E}), got {tuple(traffic.shape)}")
    if node_of_rank is None:
        if ranks_per_node is None:
            raise ValueError("network_aware needs node_of_rank or ranks_per_node to know which ranks share a node")
        node_of_rank = [p // ranks_per_node for p in range(P)]
    node = [int(n) for n in node_of_rank]
    if len(node) != P:
        raise ValueError(f"node_of_rank must give the node of each of the {P} EP ranks, got {len(node)} entries")
    if slack < 0:
        raise ValueError(f"slack must be >= 0, got {slack}")
    dense = {n: i for i, n in enumerate(sorted(set(node)))}
    node = [dense[n] for n in node]
    base = greedy(load, P)
    if len(dense) == 1:
        return base
    cap = (1.0 + slack) * rank_loads(load, base, P).max().item()
    node_P = torch.as_tensor(node)
    # cross_EN[e, n]: routes to expert e from senders outside node n
    cross_EN = torch.stack([traffic[node_P != n].sum(0) for n in range(len(dense))], dim=1)
    candidates = []
    for start in (rank_of(base, P).tolist(), _node_preferring(load, cross_EN, node, cap)):
        ranks = _improve_by_swaps(start, load, cross_EN, node, cap)
        placement = _to_placement(ranks, P)
        if rank_loads(load, placement, P).max().item() <= cap + 1e-9:
            candidates.append(placement)
    return min(candidates, key=lambda pl: cross_node_routes(traffic, pl, node))


def align(new, current, P: int, node_of_rank: Optional[Sequence[int]] = None) -> Tensor:
    """``new`` relabelled (every rank's expert set kept; with ``node_of_rank`` within a node) to move as
    few experts as possible from ``current``."""
    E = len(new)
    L = _slots_per_rank(E, P)
    new, current = check_placement(new, E), check_placement(current, E)
    node = list(node_of_rank) if node_of_rank is not None else [0] * P
    new_rank, cur_rank = (new // L).tolist(), (current // L).tolist()
    overlap = torch.zeros(P, P, dtype=torch.int64)           # [new rank, current rank]
    for e in range(E):
        overlap[new_rank[e], cur_rank[e]] += 1
    pairs = sorted(((overlap[a, b].item(), a, b) for a in range(P) for b in range(P) if node[a] == node[b]),
                   key=lambda t: (-t[0], t[1], t[2]))
    relabel: dict[int, int] = {}
    taken: set[int] = set()
    for _, a, b in pairs:
        if a not in relabel and b not in taken:
            relabel[a] = b
            taken.add(b)
    out = torch.empty(E, dtype=torch.int64)
    for r in range(P):
        target = relabel[r]
        members = [e for e in range(E) if new_rank[e] == r]
        stay = {e: current[e].item() % L for e in members if cur_rank[e] == target}
        free = iter(sorted(set(range(L)) - set(stay.values())))
        for e in members:
            out[e] = target * L + (stay[e] if e in stay else next(free))
    return out


def moved_experts(old, new, P: Optional[int] = None) -> list[int]:
    """Experts whose slot differs between two placements; with ``P``, only those that change EP rank."""
    old, new = torch.as_tensor(old).long(), torch.as_tensor(new).long()
    if P is not None:
        old, new = rank_of(old, P), rank_of(new, P)
    return (old != new).nonzero().flatten().tolist()
