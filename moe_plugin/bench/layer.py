"""``moe-plugin bench layer``: our MoE layer against DeepSpeed's, forward + backward, and the floor.

Shape suffixes: T tokens, H hidden, E experts, R kept routes (rows in expert order).

For each configuration (``LayerBenchSpec``) ``bench_layer`` builds

* ``ours``: ``MoELayer`` (router, permute, grouped experts, combine, attached balance loss);
* ``deepspeed``: ``deepspeed.moe.layer.MoE`` routing the same way with copies of our weights
  (``deepspeed_moe.py`` states what "the same" means and where the two differ);
* ``floor``: our ``GroupedExperts`` alone on the rows our router kept (same per-expert counts,
  no routing, no permutation): what any design must at least spend on the expert GEMMs;

feeds all three the same input [T, 1, H] and output gradient, and times forward + backward of
each, the three in a rotating order every iteration (gradients set to None outside the timed
region), after ``warmup`` untimed iterations. Medians are reported. Then one more call of each
runs under the allocator profiler for its peak memory (``memory.py``). An untimed first call
checks that the two layers route alike (per-expert loads equal) and reports how far apart
their outputs are.

``skew`` makes the routing unbalanced on purpose: every token's hidden feature 0 is set to 1
and the router's weight column 0 to ``skew * g_e`` (``g`` sorted standard normal), which adds a
fixed per-expert offset of standard deviation ``skew`` to the logits.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from moe_plugin.bench.memory import peak_allocated_bytes
from moe_plugin.configs.schema import MoEConfig
from moe_plugin.layers import MoELayer

VARIANTS = ("ours", "deepspeed", "floor")
AUX_LOSS_COEFF = 1e-2


@dataclass(frozen=True)
class LayerBenchSpec:
    tokens: int = 4096
    experts: int = 64
    hidden: int = 512
    ffn: int = 1024
    k: int = 2
    capacity_factor: float = 1.25
    dropless: bool = False
    skew: float = 0.0
    iters: int = 5
    warmup: int = 1
    vs_deepspeed: bool = True
    seed: int = 0

    def moe_config(self) -> MoEConfig:
        router = {1: "switch", 2: "gshard"}.get(self.k, "topk")
        block = {"num_experts": self.experts, "router": router, "capacity_factor": self.capacity_factor,
                 "eval_capacity_factor": self.capacity_factor, "drop_tokens": not self.dropless,
                 "activation": "gelu", "aux_loss_coeff": AUX_LOSS_COEFF}
        if router == "gshard":
            block["second_expert_policy"] = "all"  # see deepspeed_moe.py
        if router == "topk":
            block["top_k"] = self.k
        return MoEConfig.from_dict(block)


@dataclass
class _Run:
    """One variant: ``step()`` is forward + backward; ``clear()`` drops its gradients."""

    step: Callable[[], None]
    tensors: list[Tensor]

    def clear(self) -> None:
        for t in self.tensors:
            t.grad = None


def skew_router(layer: MoELayer, x_TH: Tensor, skew: float, gen: torch.Generator) -> None:
    """Give expert e the logit offset ``skew * g_e`` for every token (see the module docstring)."""
    offset_E = torch.sort(torch.randn(layer.config.num_experts, generator=gen)).values * skew
    with torch.no_grad():
        x_TH[:, 0] = 1.0
        layer.router.weight[:, 0] = offset_E


def bench_layer(spec: LayerBenchSpec) -> dict:
    """Time and measure one configuration; returns the JSON record (see docs/benchmarks.md)."""
    from moe_plugin.bench.deepspeed_moe import deepspeed_capacity, deepspeed_twin

    gen = torch.Generator().manual_seed(spec.seed)
    ours = MoELayer(spec.moe_config(), spec.hidden, spec.ffn, seed=spec.seed).train()
    x_SBH = torch.randn(spec.tokens, 1, spec.hidden, generator=gen)
    skew_router(ours, x_SBH.view(spec.tokens, spec.hidden), spec.skew, gen)
    x_SBH.requires_grad_(True)
    grad_SBH = torch.randn(spec.tokens, 1, spec.hidden, generator=gen)
    twin = deepspeed_twin(ours) if spec.vs_deepspeed else None

    with torch.no_grad():   # routing check, and the floor's per-expert counts
        out_ours = ours(x_SBH)[0]
        stats = ours.last_stats
        check = {}
        if twin is not None:
            out_ds, _, routed_ds_E = twin(x_SBH)
            check = {"routing_agrees": bool(torch.equal(routed_ds_E.long(), stats.routed_per_expert.long())),
                     "max_abs_diff": float((out_ours - out_ds).abs().max())}
        del out_ours
    counts_E = stats.kept_per_expert.clone()
    x_RH = torch.randn(int(counts_E.sum()), spec.hidden, generator=gen).requires_grad_(True)
    grad_RH = torch.randn(x_RH.shape, generator=gen)

    def step_ours() -> None:
        ours(x_SBH)[0].backward(grad_SBH)

    def step_deepspeed() -> None:
        out, l_aux, _ = twin(x_SBH)
        torch.autograd.backward((out, l_aux), (grad_SBH, torch.tensor(AUX_LOSS_COEFF)))

    def step_floor() -> None:
        ours.experts(x_RH, counts_E).backward(grad_RH)

    runs = {"ours": _Run(step_ours, [x_SBH, *ours.parameters()]),
            "floor": _Run(step_floor, [x_RH, *ours.experts.parameters()])}
    if twin is not None:
        runs["deepspeed"] = _Run(step_deepspeed, [x_SBH, *twin.parameters()])
    times = _time_rotating(runs, spec.warmup, spec.iters)
    peaks = {}
    for name, run in runs.items():
        run.clear()
        gc.collect()
        peaks[name] = peak_allocated_bytes(run.step)
        run.clear()

    kept = stats.kept_per_expert
    record = {"bench": "layer", **{k: v for k, v in asdict(spec).items() if k != "vs_deepspeed"},
              "dtype": "float32", "threads": torch.get_num_threads(), "ep": 1,
              "capacity": stats.capacity,
              "deepspeed_capacity": deepspeed_capacity(ours, spec.tokens, stats.routed_per_expert) if twin else None,
              "routed_rows": int(kept.sum()), "max_load": int(kept.max()), "mean_load": float(kept.float().mean()),
              "dropped_fraction": round(float(stats.dropped_fraction), 5)}
    for name in VARIANTS:
        record[f"{name}_ms"] = _round(statistics.median(times[name])) if name in times else None
    record["deepspeed_over_ours"] = _ratio(record["deepspeed_ms"], record["ours_ms"])
    record["ours_over_floor"] = _ratio(record["ours_ms"], record["floor_ms"])
    for name in VARIANTS:
        record[f"{name}_peak_bytes"] = peaks.get(name)
    record["ours_over_deepspeed_peak"] = _ratio(peaks["ours"], peaks.get("deepspeed"))
    record.update(check)
    record["loadavg"] = _loadavg()
    return record


def _time_rotating(runs: dict[str, _Run], warmup: int, iters: int) -> dict[str, list[float]]:
    """ms per forward + backward; iteration i starts with variant ``i % len(runs)``."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + iters):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            run = runs[name]
            run.clear()
            start = time.perf_counter()
            run.step()
            elapsed = (time.perf_counter() - start) * 1e3
            if i >= warmup:
                times[name].append(elapsed)
    for run in runs.values():
        run.clear()
    return times


def _round(value: float) -> float:
    return round(value, 2)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 3) if a is not None and b else None


def _loadavg() -> Optional[list[float]]:
    try:
        with open("/proc/loadavg") as f:
            return [float(v) for v in f.read().split()[:3]]
    except OSError:
        return None


def specs_from_args(args: argparse.Namespace) -> list[LayerBenchSpec]:
    return [LayerBenchSpec(tokens=args.tokens, experts=e, hidden=args.hidden, ffn=args.ffn, k=args.top_k,
                           capacity_factor=args.capacity_factor, dropless=args.dropless, skew=s,
                           iters=args.iters, warmup=args.warmup, vs_deepspeed=args.vs == "deepspeed",
                           seed=args.seed)
            for e in args.experts for s in args.skew]


def summary(record: dict) -> str:
    """One human-readable line of a record."""
    def ms(name: str) -> str:
        value = record[f"{name}_ms"]
        return "-" if value is None else f"{value:.1f}"

    return (f"T={record['tokens']} E={record['experts']} H={record['hidden']} F={record['ffn']} k={record['k']} "
            f"cf={record['capacity_factor']}{' dropless' if record['dropless'] else ''} skew={record['skew']}: "
            f"ours {ms('ours')} ms, deepspeed {ms('deepspeed')} ms, floor {ms('floor')} ms | "
            f"deepspeed/ours {record['deepspeed_over_ours']}, ours/floor {record['ours_over_floor']} | peak MiB "
            + ", ".join(f"{n} {record[f'{n}_peak_bytes'] / 2**20:.0f}" for n in VARIANTS
                        if record[f"{n}_peak_bytes"] is not None)
            + f" | max load {record['max_load']} (mean {record['mean_load']:.0f}), load avg {record['loadavg']}")


def run(args: argparse.Namespace) -> None:
    """The ``bench layer`` command: one line per configuration (JSON with ``--json``)."""
    if args.ep > 1:
        raise ValueError(f"--ep {args.ep}: the multi-rank bench needs the expert-parallel MoE layer, which this "
                         "checkout does not have yet; run with --ep 1")
    torch.set_num_threads(args.threads)
    for spec in specs_from_args(args):
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout; keep stdout for results
            record = bench_layer(spec)
        print(json.dumps(record) if args.json else summary(record), flush=True)
