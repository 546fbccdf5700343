"""``moe-plugin plan``: the offline stage of two-stage automatic parallelization (SmartMoE).

Costs every valid layout (``search.py``), drops those that do not fit, ranks them by predicted step time
(under a gate trace's mean load with ``--trace``) and writes the pool (``report.py``), each member's JSON
with the ``moe.placement`` block that starts the online stage. With a trace it also replays the pool
(``simulator.py``). Flags: ``moe_plugin_tools/plan_args.py``; usage: docs/planner.md.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import numpy as np

from moe_plugin.configs import ConfigError
from moe_plugin.planner.report import (COLUMNS, markdown_table, plot, table_rows, text_table, write_markdown,
                                       write_pool)
from moe_plugin.planner.search import Progress, candidate_pool, search
from moe_plugin.planner.spec import ClusterSpec, PlanModel


def trace_load(path: Path, model: PlanModel, traffic: bool = False):
    """The trace's loads [steps, layers, E] (with ``traffic``: and its traffic [steps, layers, P, E]); its expert
    count must be the model's (else ``ConfigError``)."""
    from moe_plugin.placement.trace import read_trace

    try:
        trace = read_trace(path)
    except OSError as err:
        raise ConfigError("--trace", str(path), f"cannot be read ({err.strerror})") from None
    if trace.num_experts != model.moe.num_experts:
        raise ConfigError("--trace", str(path), f"has {trace.num_experts} experts per layer but moe.num_experts "
                          f"is {model.moe.num_experts}")
    if trace.load.shape[0] == 0:
        raise ConfigError("--trace", str(path), "holds no step")
    return (trace.load, trace.traffic) if traffic else trace.load


def plan(model: PlanModel, cluster: ClusterSpec, out: Path, *, top: int = 5, trace: Optional[Path] = None,
         world_size: Optional[int] = None, interval: int = 100, replica_budget: int = 0) -> list:
    """Search, write the pool, print the table; returns the pool."""
    from moe_plugin.planner.simulator import load_fractions

    load_IME = traffic_IMPE = None
    if trace is not None:
        load_IME, traffic_IMPE = trace_load(trace, model, traffic=True)
    moe_layers = len(model.moe_layers)
    load_ME = load_fractions(load_IME, moe_layers).mean(axis=0) if load_IME is not None else None
    progress = Progress("plan") if sys.stderr.isatty() else None
    candidates = search(model, cluster, load_ME=load_ME, world_size=world_size, progress=progress)
    pool = candidate_pool(candidates, top)
    if not pool:
        best = min(candidates, key=lambda c: c.cost.memory_total)
        raise ConfigError("cluster.memory", cluster.memory, f"no layout fits: the smallest needs "
                          f"{best.cost.memory_total / 1e9:.1f} GB per rank ({best.layout.name()}) of "
                          f"{cluster.memory_usable:.0%} usable")
    out.mkdir(parents=True, exist_ok=True)
    extra, replays = "", None
    if load_IME is not None:
        replays = [_replay(model, cluster, c.layout, load_IME, interval, replica_budget, traffic_IMPE) for c in pool]
        extra = _replay_table(pool, replays, load_IME.shape[0], interval)
    placements = [placement_block(c.layout, interval, replays[i] if replays else None) for i, c in enumerate(pool)]
    paths = write_pool(out, pool, model, placements, replays)
    write_markdown(out, model, cluster, candidates, pool, extra)
    plot(out, candidates, pool, cluster, title=f"{model.total_params() / 1e6:,.0f}M GPT-MoE, {model.moe.num_experts} "
         f"experts on {cluster.name}")
    fitting = sum(c.fits for c in candidates)
    print(f"{len(candidates)} valid layouts, {fitting} fit in memory; pool of {len(pool)} "
          f"(load: {'trace ' + str(trace) if trace else 'uniform'})")
    print(text_table(COLUMNS, table_rows(pool, model)))
    if extra:
        print()
        print(extra)
    print(f"\nwrote {', '.join(p.name for p in paths)}, pool.json, plan.md, plan.png in {out}")
    return pool


def placement_block(layout, interval: int, replay: Optional[dict] = None) -> dict:
    """A pool member's ``moe.placement`` block: greedy every ``interval`` steps with expert parallelism, unless the
    replay found static as fast; static without EP; plus ``replica_budget`` where shadowing replayed fastest."""
    if (layout.ep > 1 and layout.etp == 1 and replay is not None and "shadow_ms" in replay
            and replay["shadow_ms"] < min(replay["greedy_ms"], replay["static_ms"])):
        return {"policy": "greedy", "check_interval": interval, "replica_budget": replay["replica_budget"]}
    if layout.ep == 1 or (replay is not None and replay["greedy_ms"] >= replay["static_ms"]):
        return {"policy": "static"}
    return {"policy": "greedy", "check_interval": interval}


def _replay(model: PlanModel, cluster: ClusterSpec, layout, load_IME: np.ndarray, interval: int,
            replica_budget: int = 0, traffic_IMPE: Optional[np.ndarray] = None) -> dict:
    """Mean step time of ``layout`` on the trace under static and greedy placement (and with shadow experts)."""
    from moe_plugin.planner.simulator import Policy, replay

    stride = max(1, load_IME.shape[0] // 500)     # at most ~500 replayed steps per run
    static = replay(model, cluster, layout, load_IME, Policy("static"), stride)
    greedy = replay(model, cluster, layout, load_IME, Policy("greedy", interval), stride)
    out = {"stride": stride, "static_ms": 1e3 * static.mean_s, "greedy_ms": 1e3 * greedy.mean_s,
           "experts_moved": greedy.moves, "migration_ms": 1e3 * greedy.migration_s}
    if replica_budget:
        shadow = replay(model, cluster, layout, load_IME, Policy("greedy", interval, replica_budget=replica_budget),
                        stride, traffic_IMPE)
        out.update(replica_budget=replica_budget, shadow_ms=1e3 * shadow.mean_s, shadow_steps=shadow.shadow_steps,
                   replication_ms_per_step=1e3 * shadow.replication_s / len(shadow.step_s))
    return out


def _replay_table(pool, replays: list[dict], steps: int, interval: int) -> str:
    rows = []
    budget = replays[0].get("replica_budget", 0)
    for i, (c, r) in enumerate(zip(pool, replays), 1):
        block = placement_block(c.layout, interval, r)
        chosen = block["policy"] + (f"+shadow{block['replica_budget']}" if "replica_budget" in block else "")
        row = [str(i), c.layout.name(), f"{r['static_ms']:.1f}", f"{r['greedy_ms']:.1f}",
               f"{r['static_ms'] / r['greedy_ms']:.3f}", str(r["experts_moved"]), f"{r['migration_ms']:.1f}"]
        if budget:
            row += [f"{r['shadow_ms']:.1f}", str(r["shadow_steps"]), f"{r['replication_ms_per_step']:.2f}"]
        rows.append(row + [chosen])
    head = ["rank", "layout", "static ms", f"greedy/{interval} ms", "speedup", "experts moved", "migration ms"]
    if budget:
        head += [f"greedy/{interval}+shadow{budget} ms", "shadowed steps", "replication ms/step"]
    head += ["placement in its JSON"]
    return (f"Trace replay ({steps} steps, every {replays[0]['stride']}): mean step time\n\n"
            + markdown_table(head, rows))
