"""Trace replay: the step time a layout and a placement policy would have had on a recorded run.

A gate trace (``moe_plugin.placement.trace``: ``load[steps, layers, E]`` routes per expert,
``traffic[steps, layers, P, E]``) records where the router sent tokens, step by step. The
routing depends on the model and the data, not on the layout, so one trace from a small run
replays on any layout of any cluster: each step is costed by ``cost_model.step_cost`` with
that step's load (as route fractions; the candidate applies its own capacity), under the
placement the policy holds at that step.

Policies (``Policy``):

* ``static``: expert e in slot e for the whole run.
* ``greedy`` every ``interval`` steps: ``placement.policies.greedy`` on the load of the last
  ``window`` steps (what the runtime would have seen), relabelled by ``align`` so that as few
  experts as possible move; the steps before the first check run static. The new placement is
  taken only when it pays (hysteresis, as ``moe.placement.min_gain``): predicted on the window's
  load, the step gets at least ``min_speedup`` faster and the saving until the next check exceeds
  the migration cost by ``min_gain``; routing noise on a uniform load therefore moves nothing.
  A move is paid on the
  step it happens: every rank receives the experts that arrive at it -- weights and optimizer
  state, ``(param_bytes + optimizer_bytes / edp_shards) * expert_params / etp`` each -- over
  its EP link (``migration_seconds``).

Trace layers map onto the model's MoE layers in order (trace layer ``j % n`` for MoE layer ``j``
when the counts differ). ``synthetic_trace`` makes Zipf-skewed loads whose hot experts drift
over the steps, for tests and for studies without a recorded run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from moe_plugin.planner.cost_model import group_span, step_cost
from moe_plugin.planner.spec import ClusterSpec, Layout, ModelSpec


@dataclass(frozen=True)
class Policy:
    """``kind`` static or greedy; greedy re-places every ``interval`` steps from the last ``window``."""

    kind: str = "static"
    interval: int = 100
    window: Optional[int] = None
    min_gain: float = 0.05
    min_speedup: float = 0.01

    def __post_init__(self) -> None:
        if self.kind not in ("static", "greedy"):
            raise ValueError(f"placement policy {self.kind!r} is unknown; expected 'static' or 'greedy'")
        if self.interval < 1 or (self.window is not None and self.window < 1):
            raise ValueError(f"policy interval and window must be >= 1, got {self.interval}, {self.window}")

    @property
    def name(self) -> str:
        return "static" if self.kind == "static" else f"greedy/{self.interval}"


@dataclass
class Replay:
    """Seconds of every replayed step (migration included) and the moves made."""

    layout: Layout
    policy: Policy
    step_s: np.ndarray
    migration_s: float = 0.0
    moves: int = 0
    placements: list = field(default_factory=list)   # (step, [layers, E]) after every change

    @property
    def mean_s(self) -> float:
        return float(self.step_s.mean())

    @property
    def total_s(self) -> float:
        return float(self.step_s.sum())


def load_fractions(load_SLE: np.ndarray, moe_layers: int) -> np.ndarray:
    """[steps, moe_layers, E] route fractions from a trace's [steps, layers, E] counts."""
    load = np.asarray(load_SLE, dtype=float)
    if load.ndim != 3:
        raise ValueError(f"a trace load must be [steps, layers, experts], got shape {load.shape}")
    load = load[:, [j % load.shape[1] for j in range(moe_layers)], :]
    total = load.sum(axis=-1, keepdims=True)
    E = load.shape[-1]
    return np.where(total > 0, load / np.maximum(total, 1e-30), 1.0 / E)


def migration_seconds(model: ModelSpec, cluster: ClusterSpec, layout: Layout, old_E, new_E) -> float:
    """Seconds to move the experts whose rank changes from ``old_E`` to ``new_E`` (slots): the
    rank that receives most of them sets the time."""
    L = model.experts // layout.ep
    old_r, new_r = np.asarray(old_E) // L, np.asarray(new_E) // L
    moved = old_r != new_r
    if not moved.any():
        return 0.0
    shards = layout.edp if layout.zero >= 1 else 1
    per_expert = model.expert_params() / layout.etp * (model.param_bytes + model.optimizer_bytes / shards)
    busiest = np.bincount(new_r[moved], minlength=layout.ep).max()
    bw, lat = cluster.link(group_span(layout, "ep", expert_grid=True))
    return float(busiest * per_expert / bw + lat * (layout.ep - 1))


def replay(model: ModelSpec, cluster: ClusterSpec, layout: Layout, load_SLE: np.ndarray, policy: Policy,
           stride: int = 1) -> Replay:
    """Replay every ``stride``-th step of a trace's loads (``[steps, layers, E]``) on ``layout``."""
    from moe_plugin.placement.policies import align, greedy, static

    moe_layers = sum(model.is_moe(i) for i in range(model.layers))
    frac = load_fractions(load_SLE, moe_layers)
    if frac.shape[-1] != model.experts:
        raise ValueError(f"the trace has {frac.shape[-1]} experts per layer, the model {model.experts}")
    E, P = model.experts, layout.ep
    placement = np.stack([static(E, P).numpy() for _ in range(moe_layers)])
    window = policy.window or policy.interval
    times, migration, moves, history = [], 0.0, 0, []
    for s in range(0, frac.shape[0], stride):
        extra = 0.0
        if policy.kind == "greedy" and P > 1 and s > 0 and s % policy.interval < stride:
            seen = frac[max(0, s - window):s].mean(axis=0)
            new = np.stack([align(greedy(seen[j], P), placement[j], P).numpy() for j in range(moe_layers)])
            cost = sum(migration_seconds(model, cluster, layout, placement[j], new[j]) for j in range(moe_layers))
            now = step_cost(model, cluster, layout, seen, placement).total
            then = step_cost(model, cluster, layout, seen, new).total
            pays = (now - then) * policy.interval > (1 + policy.min_gain) * cost
            if pays and now - then > policy.min_speedup * now:
                moves += int((new // (E // P) != placement // (E // P)).sum())
                placement, extra = new, cost
                history.append((s, placement.copy()))
        migration += extra
        times.append(step_cost(model, cluster, layout, frac[s], placement).total + extra)
    return Replay(layout, policy, np.asarray(times), migration, moves, history)


def synthetic_trace(steps: int, layers: int, experts: int, tokens: int, *, zipf: float = 1.0,
                    drift_every: int = 0, senders: int = 1, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(load[steps, layers, E], traffic[steps, layers, P, E])`` int32: each layer's experts draw
    ``tokens`` routes per step from a Zipf(``zipf``) popularity over a per-layer random order
    (``zipf`` 0: uniform). Every ``drift_every`` steps (0: never) the popularity drifts: in each
    layer a random expert trades places with the one ranked just above it, so hot experts cool
    down and others heat up slowly. Routes split evenly over ``senders``."""
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


def compare(model: ModelSpec, cluster: ClusterSpec, layouts: Sequence[Layout], load_SLE: np.ndarray,
            policies: Sequence[Policy], stride: int = 1) -> list[Replay]:
    """Every layout under every policy."""
    return [replay(model, cluster, lay, load_SLE, pol, stride) for lay in layouts for pol in policies]


__all__ = ["Policy", "Replay", "compare", "load_fractions", "migration_seconds", "replay", "synthetic_trace"]
