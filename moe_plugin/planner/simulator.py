"""Trace replay: the step time a layout and a placement policy would have had on a recorded run.

A gate trace records where the router sent tokens, which does not depend on the layout, so one trace
replays on any layout: each step costed by ``step_cost`` with that step's load, under the placement (and
shadow experts) the policy holds then, decided by the runtime's own rules (``placement/costs.py``).
``synthetic_trace``: drifting Zipf loads. docs/planner.md, *Trace replay*.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from moe_plugin.placement import costs
from moe_plugin.planner.cost_model import group_span, moe_layer_time, step_cost
from moe_plugin.planner.spec import ClusterSpec, Layout, PlanModel


@dataclass(frozen=True)
class Policy:
    """``kind`` static or greedy; greedy re-places every ``interval`` steps from the last ``window``;
    ``replica_budget`` > 0 also shadows up to that many hot experts per layer, decided at the same checks."""

    kind: str = "static"
    interval: int = 100
    window: Optional[int] = None
    min_gain: float = 0.05
    replica_budget: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("static", "greedy"):
            raise ValueError(f"placement policy {self.kind!r} is unknown; expected 'static' or 'greedy'")
        if self.interval < 1 or (self.window is not None and self.window < 1):
            raise ValueError(f"policy interval and window must be >= 1, got {self.interval}, {self.window}")
        if self.replica_budget < 0:
            raise ValueError(f"policy replica_budget must be >= 0, got {self.replica_budget}")

    @property
    def name(self) -> str:
        base = "static" if self.kind == "static" else f"greedy/{self.interval}"
        return base + (f"+shadow{self.replica_budget}" if self.replica_budget else "")


@dataclass
class Replay:
    """Seconds of every replayed step (migration and replication included), the moves and the shadowing."""

    layout: Layout
    policy: Policy
    step_s: np.ndarray
    migration_s: float = 0.0
    moves: int = 0
    placements: list = field(default_factory=list)   # (step, [layers, E]) after every change
    shadow_steps: int = 0
    replication_s: float = 0.0
    shadows: list = field(default_factory=list)      # (step, [layers, E] bool) after every change

    @property
    def mean_s(self) -> float:
        return float(self.step_s.mean())


def load_fractions(load_IME: np.ndarray, moe_layers: int) -> np.ndarray:
    """[steps, moe_layers, E] route fractions from a trace's [steps, layers, E] counts."""
    load = np.asarray(load_IME, dtype=float)
    if load.ndim != 3:
        raise ValueError(f"a trace load must be [steps, layers, experts], got shape {load.shape}")
    load = load[:, [j % load.shape[1] for j in range(moe_layers)], :]
    total = load.sum(axis=-1, keepdims=True)
    E = load.shape[-1]
    return np.where(total > 0, load / np.maximum(total, 1e-30), 1.0 / E)


def migration_seconds(model: PlanModel, cluster: ClusterSpec, layout: Layout, old_E, new_E) -> float:
    """Seconds to move the experts whose rank changes from ``old_E`` to ``new_E``: the busiest receiver's."""
    L = model.moe.num_experts // layout.ep
    old_r, new_r = np.asarray(old_E) // L, np.asarray(new_E) // L
    moved = old_r != new_r
    if not moved.any():
        return 0.0
    shards = layout.edp if layout.zero >= 1 else 1
    o = model.options
    per_expert = model.expert_params() / layout.etp * (o.param_bytes + o.optimizer_bytes / shards)
    busiest = np.bincount(new_r[moved], minlength=layout.ep).max()
    bw, lat = cluster.link(group_span(layout, "ep", expert_grid=True))
    return costs.migration_seconds(busiest * per_expert, 1 / bw, lat * (layout.ep - 1))


def sender_fractions(traffic_IMPE: Optional[np.ndarray], moe_layers: int, ep: int) -> Optional[np.ndarray]:
    """[steps, moe_layers, ep, E]: each EP rank's share of every expert's routes, from a trace's ``traffic``;
    None (uniform senders) without one or where its sender count is not ``ep``."""
    if traffic_IMPE is None or ep == 1:
        return None
    traffic = np.asarray(traffic_IMPE, dtype=float)
    if traffic.ndim != 4 or traffic.shape[2] != ep:
        return None
    traffic = traffic[:, [j % traffic.shape[1] for j in range(moe_layers)]]
    total = traffic.sum(axis=2, keepdims=True)
    return np.where(total > 0, traffic / np.maximum(total, 1e-30), 1.0 / ep)


def choose_shadow(model: PlanModel, cluster: ClusterSpec, layout: Layout, load_E, placement_E, current_E,
                  policy: Policy, senders_PE=None) -> np.ndarray:
    """One layer's shadowed experts (bool [E]) after a check: the cheapest set of the 0..K hottest, taken when
    ``should_switch`` takes it with no migration."""
    load = np.asarray(load_E, dtype=float)
    hot = costs.hottest(load, policy.replica_budget)

    def seconds(mask) -> float:
        return sum(moe_layer_time(model, cluster, layout, load, placement_E, mask, senders_PE).values())

    sets = [np.isin(np.arange(len(load)), hot[:k]) for k in range(len(hot) + 1)]
    times = [seconds(mask) for mask in sets]
    k = min(range(len(times)), key=lambda i: (times[i], i))
    if (sets[k] == current_E).all():
        return current_E
    switch, _ = costs.should_switch(seconds(current_E), times[k], 0.0, policy.interval, policy.min_gain)
    return sets[k] if switch else current_E


def choose_placement(model: PlanModel, cluster: ClusterSpec, layout: Layout, load_E, current_E, new_E,
                     policy: Policy) -> tuple[np.ndarray, float]:
    """One layer's placement after a check and its migration seconds: ``new_E`` when ``should_switch`` takes it."""
    def per_step(placement_E) -> float:
        return layout.gas * sum(moe_layer_time(model, cluster, layout, load_E, placement_E).values())

    cost = migration_seconds(model, cluster, layout, current_E, new_E)
    switch, _ = costs.should_switch(per_step(current_E), per_step(new_E), cost, policy.interval, policy.min_gain)
    return (new_E, cost) if switch and (new_E != current_E).any() else (current_E, 0.0)


def replay(model: PlanModel, cluster: ClusterSpec, layout: Layout, load_IME: np.ndarray, policy: Policy,
           stride: int = 1, traffic_IMPE: Optional[np.ndarray] = None) -> Replay:
    """Replay every ``stride``-th step of a trace's loads (``[steps, layers, E]``) on ``layout``;
    ``traffic_IMPE`` (the trace's ``[steps, layers, P, E]``) gives the senders of shadowed routes."""
    from moe_plugin.placement.policies import align, greedy, static

    moe_layers = len(model.moe_layers)
    E, P = model.moe.num_experts, layout.ep
    frac = load_fractions(load_IME, moe_layers)
    if frac.shape[-1] != E:
        raise ValueError(f"the trace has {frac.shape[-1]} experts per layer, the model {E}")
    placement = np.stack([static(E, P).numpy() for _ in range(moe_layers)])
    window = policy.window or policy.interval
    senders = sender_fractions(traffic_IMPE, moe_layers, P) if policy.replica_budget else None
    shadow = np.zeros((moe_layers, E), dtype=bool)
    can_shadow = policy.replica_budget > 0 and P > 1 and layout.etp == 1
    times, migration, moves, history = [], 0.0, 0, []
    shadow_steps, replication, shadow_history = 0, 0.0, []
    for s in range(0, frac.shape[0], stride):
        extra = 0.0
        check = P > 1 and s > 0 and s % policy.interval < stride
        if check:
            seen = frac[max(0, s - window):s].mean(axis=0)
        if check and policy.kind == "greedy":
            chosen = [choose_placement(model, cluster, layout, seen[j], placement[j],
                                       align(greedy(seen[j], P), placement[j], P).numpy(), policy)
                      for j in range(moe_layers)]
            new = np.stack([c[0] for c in chosen])
            if (new != placement).any():
                moves += int((new // (E // P) != placement // (E // P)).sum())
                placement, extra = new, sum(c[1] for c in chosen)
                history.append((s, placement.copy()))
        if check and can_shadow:
            seen_senders = senders[max(0, s - window):s].mean(axis=0) if senders is not None else None
            new_shadow = np.stack([choose_shadow(model, cluster, layout, seen[j], placement[j], shadow[j], policy,
                                                 None if seen_senders is None else seen_senders[j])
                                   for j in range(moe_layers)])
            if (new_shadow != shadow).any():
                shadow = new_shadow
                shadow_history.append((s, shadow.copy()))
        migration += extra
        if shadow.any():
            cost = step_cost(model, cluster, layout, frac[s], placement, shadow,
                             senders[s] if senders is not None else None)
            shadow_steps += 1
            replication += cost.replication
        else:
            cost = step_cost(model, cluster, layout, frac[s], placement)
        times.append(cost.total + extra)
    return Replay(layout, policy, np.asarray(times), migration, moves, history, shadow_steps, replication,
                  shadow_history)


def synthetic_trace(steps: int, layers: int, experts: int, tokens: int, *, zipf: float = 1.0,
                    drift_every: int = 0, senders: int = 1, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(load[steps, layers, E], traffic[steps, layers, P, E])`` int32: ``tokens`` routes per layer and step from a
    Zipf(``zipf``) popularity over a per-layer random order (0: uniform); every ``drift_every`` steps (0: never) a
    random expert trades places with the one ranked above it. Routes split evenly over ``senders``."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, experts + 1) ** zipf
    weights /= weights.sum()
    orders = [rng.permutation(experts) for _ in range(layers)]   # orders[j][rank] = expert
    load = np.zeros((steps, layers, experts), dtype=np.int32)
    traffic = np.zeros((steps, layers, senders, experts), dtype=np.int32)
    for s in range(steps):
        for j in range(layers):
            if drift_every and s and s % drift_every == 0 and experts > 1:
                i = int(rng.integers(1, experts))
                orders[j][[i - 1, i]] = orders[j][[i, i - 1]]
            p = np.empty(experts)
            p[orders[j]] = weights
            for r in range(senders):
                traffic[s, j, r] = rng.multinomial(tokens // senders, p)
            load[s, j] = traffic[s, j].sum(axis=0)
    return load, traffic


def compare(model: PlanModel, cluster: ClusterSpec, layouts: Sequence[Layout], load_IME: np.ndarray,
            policies: Sequence[Policy], stride: int = 1) -> list[Replay]:
    """Every layout under every policy."""
    return [replay(model, cluster, lay, load_IME, pol, stride) for lay in layouts for pol in policies]
