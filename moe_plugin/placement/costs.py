"""Costs of one MoE layer under one expert placement, the collectives it runs, and the one switching
rule. Pure (numpy, no process group): the runtime controller and the planner both call it. A new
placement or shadow set is taken only when it saves more than the move costs (``should_switch``).
The formulas and the collectives: docs/design/placement_switching.md.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np


# -- per layer and placement ----------------------------------------------------------------------
def _shadow_mask(shadow_E, E: int) -> np.ndarray:
    mask = np.zeros(E, dtype=bool)
    if shadow_E is not None:
        shadow = np.asarray(shadow_E)
        if shadow.size:
            mask[shadow if shadow.dtype != bool else np.flatnonzero(shadow)] = True
    return mask


def computed_routes(routes_PE, rank_E, shadow_E=None) -> np.ndarray:
    """[P] routes each rank computes: everyone's to its unshadowed experts, its own to the shadowed."""
    T = np.asarray(routes_PE, dtype=float)
    P, E = T.shape
    shadow = _shadow_mask(shadow_E, E)
    received = np.bincount(np.asarray(rank_E)[~shadow], weights=T[:, ~shadow].sum(0), minlength=P)
    return received + T[:, shadow].sum(1)


def exchanged_routes(routes_PE, rank_E, node_P: Sequence[int], shadow_E=None) -> tuple[np.ndarray, np.ndarray]:
    """([P] within the node, [P] across nodes): per rank the larger of routes sent and received."""
    T = np.asarray(routes_PE, dtype=float)
    P, E = T.shape
    rank = np.asarray(rank_E)
    node = np.asarray(list(node_P))
    T_sent = np.where(_shadow_mask(shadow_E, E)[None, :], 0.0, T)          # routes the exchange carries
    remote = np.arange(P)[:, None] != rank[None, :]                        # [P, E]
    inter = node[:, None] != node[rank][None, :]
    out = []
    for mask in (remote & ~inter, inter):
        routes = T_sent * mask
        received = np.bincount(rank, weights=routes.sum(0), minlength=P)
        out.append(np.maximum(routes.sum(1), received))
    return out[0], out[1]


def replication_bytes(P: int, shadowed: int, expert_bytes: float) -> float:
    """Bytes per rank of one of the two all-reduces of ``shadowed`` experts' weights over EP."""
    return 2 * (P - 1) / P * shadowed * expert_bytes if P > 1 else 0.0


def migration_seconds(nbytes: float, seconds_per_byte: float, latency: float = 0.0) -> float:
    """Seconds of a migration that moves ``nbytes`` (0 bytes: nothing moves, no latency)."""
    return nbytes * seconds_per_byte + latency if nbytes > 0 else 0.0


# -- the switching rule ---------------------------------------------------------------------------
def should_switch(t_now: float, t_new: float, migration: float, horizon: int, min_gain: float) -> tuple[bool, str]:
    """The switching rule (docs/design/placement_switching.md): (switch, why)."""
    saving = (t_now - t_new) * horizon
    if saving <= (1 + min_gain) * migration:
        return False, f"saving {saving:.3g}s <= (1 + {min_gain}) x migration {migration:.3g}s"
    if t_new > (1 - min_gain) * t_now:
        return False, f"per-step gain {1 - t_new / max(t_now, 1e-30):.1%} < min_gain {min_gain:.0%}"
    return True, f"saving {saving:.3g}s > (1 + {min_gain}) x migration {migration:.3g}s"


def hottest(load_E, budget: int) -> list[int]:
    """The shadow candidates: up to ``budget`` loaded experts, hottest first (ties by id)."""
    load = [float(v) for v in load_E]
    return sorted((e for e in range(len(load)) if load[e] > 0), key=lambda e: (-load[e], e))[:budget]


# -- the runtime's prices -------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerTime:
    """Predicted seconds of one layer step under one placement."""

    compute: float
    all_to_all: float
    replication: float = 0.0     # shadowed experts: weights fetched and gradients reduced

    @property
    def total(self) -> float:
        return self.compute + self.all_to_all + self.replication


@dataclass(frozen=True)
class CostModel:
    """The runtime controller's prices of an MoE layer step and of a migration (defaults: GPU orders
    of magnitude; ``fit`` calibrates the compute from measured steps)."""

    seconds_per_route: float = 2e-7
    seconds_per_byte_intra: float = 1e-11
    seconds_per_byte_inter: float = 8e-11
    migration_seconds_per_byte: float = 1e-10

    def layer_time(self, traffic_PE, placement, node_of_rank: Sequence[int], bytes_per_route: float,
                   shadow: Sequence[int] = (), expert_bytes: float = 0.0) -> LayerTime:
        """Seconds per step from the mean routes per step ``traffic_PE`` under ``placement`` (and
        ``shadow``, with ``expert_bytes`` one expert's weights)."""
        T = np.asarray(traffic_PE, dtype=float)
        P, E = T.shape
        rank_E = np.asarray(placement, dtype=np.int64) // (E // P)
        shadow = list(shadow)
        compute = self.seconds_per_route * computed_routes(T, rank_E, shadow).max()
        intra, inter = exchanged_routes(T, rank_E, node_of_rank, shadow)
        seconds = (intra * bytes_per_route * self.seconds_per_byte_intra
                   + inter * bytes_per_route * self.seconds_per_byte_inter)
        per_byte = self.seconds_per_byte_inter if len(set(node_of_rank)) > 1 else self.seconds_per_byte_intra
        replication = 2 * replication_bytes(P, len(shadow), expert_bytes) * per_byte if shadow else 0.0
        return LayerTime(compute=float(compute), all_to_all=float(seconds.max()), replication=replication)

    def fit(self, max_rank_routes: Sequence[float], seconds: Sequence[float]) -> "CostModel":
        """``seconds_per_route`` fitted to measured compute seconds and their busiest rank's routes."""
        x, y = np.asarray(max_rank_routes, dtype=float), np.asarray(seconds, dtype=float)
        if x.size == 0 or float((x * x).sum()) == 0.0:
            raise ValueError(f"cannot fit seconds_per_route from routes {x.tolist()}: need a nonzero sample")
        return replace(self, seconds_per_route=float((x * y).sum() / (x * x).sum()))


# -- the collectives of one MoE layer -------------------------------------------------------------
@dataclass(frozen=True)
class Collective:
    """One collective of an MoE layer's micro-batch: the torch.distributed call, its group (``ep``,
    ``etp``, ``tp``, ``tokens``) and what it moves."""

    phase: str      # "forward" or "backward"
    op: str         # "all_to_all_single", "all_gather", "all_reduce"
    group: str
    what: str


def moe_layer_collectives(tp: int, dp: int, ep: int, etp: int, sequence_parallel: bool = False,
                          shadowed: bool = False, overlap_chunks: int = 1,
                          aux_loss_scope: str = "micro_batch", exchange: str = "counts") -> list[Collective]:
    """What one MoE layer runs per micro-batch, forward and backward, on a rank of a stage with these
    sizes (a group of size 1 runs nothing); ``exchange``: the layer's resolved mode. Which and why:
    docs/design/placement_switching.md."""
    split = tp > 1 and not sequence_parallel
    a2a, fwd, bwd = "all_to_all_single", "forward", "backward"
    chunks = overlap_chunks if ep > 1 and not shadowed else 1
    rows = "rows" if chunks == 1 else "row chunk"
    plan = [
        (tp * dp > 1 and ep != tp * dp, Collective(fwd, a2a, "tokens", "finite flags")),
        (tp > 1, Collective(fwd, "all_gather", "tp", "router logits")),
        (ep > 1 and exchange != "padded", Collective(fwd, a2a, "ep", "counts")),
        (etp > 1, Collective(fwd, a2a, "etp", "counts")),
        *[(ep > 1, Collective(fwd, a2a, "ep", rows))] * chunks,
        (etp > 1, Collective(fwd, a2a, "etp", "rows")),
        (shadowed and ep > 1, Collective(fwd, "all_reduce", "ep", "shadow weights")),
        (etp > 1, Collective(fwd, a2a, "etp", "rows")),
        *[(ep > 1, Collective(fwd, a2a, "ep", rows))] * chunks,
        (split, Collective(fwd, "all_gather", "tp", "tokens")),
        *[(ep > 1, Collective(bwd, a2a, "ep", rows))] * chunks,
        (etp > 1, Collective(bwd, a2a, "etp", "rows")),
        (etp > 1, Collective(bwd, a2a, "etp", "rows")),
        *[(ep > 1, Collective(bwd, a2a, "ep", rows))] * chunks,
        (shadowed and ep > 1, Collective(bwd, "all_reduce", "ep", "shadow gradients")),
        (tp > 1, Collective(bwd, "all_reduce", "tp", "router gradient")),
        (aux_loss_scope == "global" and dp > 1, Collective(fwd, "all_reduce", "dp", "global load")),
        (split, Collective(bwd, "all_gather", "tp", "tokens")),
    ]
    return [c for on, c in plan if on]
