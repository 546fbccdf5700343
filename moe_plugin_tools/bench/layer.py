"""``moe-plugin bench layer``: our MoE layer against DeepSpeed's, forward + backward, and the floor.

Shape suffixes: see ``moe_plugin.layers``.

For each configuration (``LayerBenchSpec``) ``bench_layer`` builds

* ``ours``: ``MoELayer`` (router, permute, grouped experts, combine, attached balance loss);
* ``deepspeed``: ``deepspeed.moe.layer.MoE`` routing the same way with copies of our weights
  (``deepspeed_moe.py`` states what "the same" means and where the two differ);
* ``megatron`` (``vs_megatron``, CUDA only): Megatron-Core's own ``MoELayer`` with the same sizes,
  top-k, capacity and its alltoall dispatcher and grouped GEMM (``megatron_moe.py``; its own
  weights and routing, so no output check);
* ``floor``: our ``GroupedExperts`` alone on the rows our router kept (same per-expert counts,
  no routing, no permutation): what any design must at least spend on the expert GEMMs;

feeds them the same input [T, 1, H] and output gradient, and times forward + backward of
each, the three in a rotating order every iteration (gradients set to None outside the timed
region), after ``warmup`` untimed iterations. Everything runs on ``device`` in ``dtype`` (weights
and activations; ``device.py``): off the CPU each timed step is bracketed by the accelerator's
``synchronize`` and peak memory is the accelerator's ``max_memory_allocated``. Medians are
reported, with the machine's load average and ``others_cpu``: the cores other processes kept
busy meanwhile (``/proc/stat`` minus our own CPU time; near 0 on a quiet machine, and the timings
are suspect when it is not). Then one more call of each runs under the allocator profiler for its
peak memory (``memory.py``).
An untimed first call checks that the two layers route alike (per-expert loads equal) and
reports how far apart their outputs are.

``skew`` makes the routing unbalanced on purpose: every token's hidden feature 0 is set to 1
and the router's weight column 0 to ``skew * g_e`` (``g`` sorted standard normal), which adds a
fixed per-expert offset of standard deviation ``skew`` to the logits.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import Tensor

from moe_plugin_tools.bench.deepspeed_moe import routing_fields
from moe_plugin_tools.bench.device import Target
from moe_plugin_tools.bench.machine import cpu_seconds, loadavg, others_share
from moe_plugin.configs.schema import MoEConfig
from moe_plugin.layers import GroupedExperts, MoELayer

if TYPE_CHECKING:
    from moe_plugin.layers.router import RoutingPlan
    from moe_plugin.groups.process_groups import ProcessGroups

VARIANTS = ("ours", "deepspeed", "megatron", "floor")
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
    vs_megatron: bool = False
    breakdown: bool = False
    recompute_pre_activation: bool = False
    overlap_chunks: int = 1
    router_groups: Optional[int] = None
    group_topk: Optional[int] = None
    exchange: str = "counts"
    deterministic: bool = False
    seed: int = 0
    device: str = "cpu"
    dtype: str = "fp32"

    @property
    def target(self) -> Target:
        return Target(self.device, self.dtype)

    def moe_config(self, ep: int = 1) -> MoEConfig:
        block = {"num_experts": self.experts, **routing_fields(self.k, self.dropless, self.capacity_factor),
                 "activation": "gelu", "aux_loss_coeff": AUX_LOSS_COEFF, "parallel": {"expert": ep},
                 "recompute_fc1": self.recompute_pre_activation,
                 "overlap_chunks": self.overlap_chunks if ep > 1 else 1,
                 "exchange": self.exchange if ep > 1 else "counts"}
        if self.group_topk is not None or self.router_groups is not None:
            # the bench's default (a bench at one EP size): one group per EP rank, written into the block
            groups = self.router_groups if self.router_groups is not None or self.group_topk is None else ep
            block.update(group_topk=self.group_topk, router_groups=groups)
        return MoEConfig.from_dict(block)


@dataclass
class _Run:
    """One variant: ``step()`` is forward + backward, ``forward()`` the forward alone (its result
    holds what backward would use); ``clear()`` drops the gradients; ``clear(storage=True)``
    also the expert gradients' kept storage (``GradStore``), so a memory profile counts the
    weight gradients of both layers alike."""

    step: Callable[[], None]
    forward: Callable[[], object]
    tensors: list[Tensor]
    experts: Optional[GroupedExperts] = None

    def clear(self, storage: bool = False) -> None:
        for t in self.tensors:
            t.grad = None
        if storage and self.experts is not None:
            self.experts.release_grad_storage()


def skew_router(layer: MoELayer, x_TH: Tensor, skew: float, gen: torch.Generator) -> None:
    """Give expert e the logit offset ``skew * g_e`` for every token (see the module docstring)."""
    offset_E = torch.sort(torch.randn(layer.config.num_experts, generator=gen)).values * skew
    with torch.no_grad():
        x_TH[:, 0] = 1.0
        layer.router.weight[:, 0] = offset_E


class Ranks:
    """The processes one configuration runs on: this process alone (``groups=None``), or every
    rank of an expert-parallel job (``layer_ep.py``): then the steps start together and a step
    takes as long as its slowest rank. ``device``: where the values of ``reduce`` travel (the
    device of the job's backend: the CPU for gloo, the rank's GPU for nccl)."""

    def __init__(self, groups: Optional["ProcessGroups"] = None, device: str = "cpu"):
        self.groups = groups
        self.device = device
        self.size = 1 if groups is None else groups.size("ep")
        self.rank = 0 if groups is None else groups.rank_in("ep")

    def barrier(self) -> None:
        if self.groups is not None:
            torch.distributed.barrier(self.groups.ep)

    def reduce(self, values: list[float], op: str) -> list[float]:
        """Element-wise max or sum over the ranks."""
        if self.groups is None:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        reduce_op = torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM
        torch.distributed.all_reduce(t, op=reduce_op, group=self.groups.ep)
        return t.tolist()


def bench_layer(spec: LayerBenchSpec, ranks: Optional[Ranks] = None) -> dict:
    """Time and measure one configuration; returns the JSON record (docs/benchmarks_history.md).
    With ``ranks`` of an expert-parallel job every rank calls it with its own tokens; rank 0's
    record describes the job. ``spec.deterministic``: under ``torch.use_deterministic_algorithms``."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(before or spec.deterministic)
    try:
        return _bench_layer(spec, ranks)
    finally:
        torch.use_deterministic_algorithms(before)


def _bench_layer(spec: LayerBenchSpec, ranks: Optional[Ranks]) -> dict:
    from moe_plugin_tools.bench.deepspeed_moe import deepspeed_capacity, deepspeed_twin

    ranks = ranks or Ranks()
    target = spec.target
    device, dtype = target.torch_device, target.torch_dtype
    gen = torch.Generator().manual_seed(spec.seed * 1000 + ranks.rank)
    ours = MoELayer(spec.moe_config(ranks.size), spec.hidden, spec.ffn, ranks.groups, seed=spec.seed).train()
    x_SBH = torch.randn(spec.tokens, 1, spec.hidden, generator=gen)
    skew_router(ours, x_SBH.view(spec.tokens, spec.hidden), spec.skew, torch.Generator().manual_seed(spec.seed))
    ours.to(device, dtype)
    x_SBH = x_SBH.to(device, dtype).requires_grad_(True)
    grad_SBH = torch.randn(spec.tokens, 1, spec.hidden, generator=gen).to(device, dtype)
    twin = deepspeed_twin(ours, ranks.size) if spec.vs_deepspeed else None
    rival = None
    if spec.vs_megatron:
        from moe_plugin_tools.bench.megatron_moe import megatron_twin

        rival = megatron_twin(spec, AUX_LOSS_COEFF, ranks.size)

    with torch.no_grad():   # routing check, and the floor's per-expert counts
        plans = []          # the router's plan, for the traffic record
        hook = ours.router.register_forward_hook(lambda module, args, out: plans.append(out[0]))
        out_ours = ours(x_SBH)[0]
        hook.remove()
        stats = ours.last_stats
        check = {}
        if twin is not None:
            out_ds, _, routed_ds_E = twin(x_SBH)
            agrees = torch.equal(routed_ds_E.long(), stats.routed_per_expert.long())
            diff = float((out_ours - out_ds).abs().max())
            agrees, diff = ranks.reduce([float(not agrees), diff], "max")
            check = {"routing_agrees": agrees == 0, "max_abs_diff": diff}
        del out_ours
    kept_E = stats.kept_per_expert
    # the floor: the rows this rank's experts receive (from every rank), in the same groups
    job_kept_E = torch.tensor(ranks.reduce(kept_E.double().tolist(), "sum")).long()
    counts_L = job_kept_E.view(ranks.size, -1)[ranks.rank].clone()
    x_RH = torch.randn(int(counts_L.sum()), spec.hidden, generator=gen).to(device, dtype).requires_grad_(True)
    grad_RH = torch.randn(x_RH.shape, generator=gen).to(device, dtype)

    def fwd_ours():
        return ours(x_SBH)[0]

    def fwd_deepspeed():
        return twin(x_SBH)

    def fwd_floor():
        return ours.experts(x_RH, counts_L)

    def step_ours() -> None:
        fwd_ours().backward(grad_SBH)

    def step_deepspeed() -> None:
        out, l_aux, _ = fwd_deepspeed()
        torch.autograd.backward((out, l_aux), (grad_SBH, l_aux.new_tensor(AUX_LOSS_COEFF)))

    def fwd_megatron():
        return rival(x_SBH)[0]   # Megatron attaches its aux loss to the output itself

    def step_megatron() -> None:
        fwd_megatron().backward(grad_SBH)

    def step_floor() -> None:
        fwd_floor().backward(grad_RH)

    runs = {"ours": _Run(step_ours, fwd_ours, [x_SBH, *ours.parameters()], ours.experts),
            "floor": _Run(step_floor, fwd_floor, [x_RH, *ours.experts.parameters()], ours.experts)}
    if twin is not None:
        runs["deepspeed"] = _Run(step_deepspeed, fwd_deepspeed, [x_SBH, *twin.parameters()])
    if rival is not None:
        runs["megatron"] = _Run(step_megatron, fwd_megatron, [x_SBH, *rival.parameters()])
    busy_before = cpu_seconds()  # others_cpu covers the timed loop
    times = _time_rotating(runs, spec.warmup, spec.iters, ranks, target)
    busy_after = cpu_seconds()
    memory = {}
    for name, run in runs.items():
        for key, fn in (("peak_bytes", run.step), ("activation_bytes", run.forward)):
            values = []
            # EP: gloo frees a send buffer on its own thread, before or after the profile ends
            # (+-1 buffer of rows); the median of 3 measurements steadies that
            for _ in range(1 if ranks.size == 1 else 3):
                run.clear(storage=True)
                gc.collect()
                profile = target.memory_profile(fn)
                values.append(profile.peak_bytes if key == "peak_bytes" else profile.retained_bytes)
            memory[f"{name}_{key}"] = statistics.median(values)
        run.clear()
    memory = dict(zip(memory, (int(v) for v in ranks.reduce(list(memory.values()), "max"))))

    job_routed_E = torch.tensor(ranks.reduce(stats.routed_per_expert.double().tolist(), "sum")).long()
    record = {"bench": "layer", **{k: v for k, v in asdict(spec).items()
                                   if k not in ("vs_deepspeed", "vs_megatron", "breakdown")},
              "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(), "ep": ranks.size,
              "malloc_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")},
              "capacity": stats.capacity,
              "deepspeed_capacity": deepspeed_capacity(ours, spec.tokens, stats.routed_per_expert) if twin else None,
              "routed_rows": int(job_kept_E.sum()), "max_load": int(job_kept_E.max()),
              "mean_load": float(job_kept_E.float().mean()),
              "dropped_fraction": round(1 - float(job_kept_E.sum()) / max(1, float(job_routed_E.sum())), 5)}
    for name in VARIANTS:
        record[f"{name}_ms"] = _round(statistics.median(times[name])) if name in times else None
    record["deepspeed_over_ours"] = _ratio(record["deepspeed_ms"], record["ours_ms"])
    record["megatron_over_ours"] = _ratio(record["megatron_ms"], record["ours_ms"])
    record["ours_over_floor"] = _ratio(record["ours_ms"], record["floor_ms"])
    # the most any dispatcher over these GEMMs could reach: DeepSpeed's time over ours with free routing
    record["deepspeed_over_floor"] = _ratio(record["deepspeed_ms"], record["floor_ms"])
    for key in ("peak_bytes", "activation_bytes"):
        for name in VARIANTS:
            record[f"{name}_{key}"] = memory.get(f"{name}_{key}")
        record[f"ours_over_deepspeed_{key.split('_')[0]}"] = _ratio(memory["ours_" + key],
                                                                    memory.get("deepspeed_" + key))
    if ranks.size > 1:
        record.update(_traffic(spec, ranks, plans[0], record["deepspeed_capacity"], dtype))
    record.update(check)
    if spec.breakdown and ranks.size == 1:
        from moe_plugin_tools.bench.breakdown import time_parts

        record["ours_parts_ms"] = time_parts(ours, x_SBH.detach().view(spec.tokens, spec.hidden),
                                             spec.warmup, spec.iters, target.sync)
    record["loadavg"] = loadavg()
    record["others_cpu"] = others_share(busy_before, busy_after, ranks)
    return record


def _traffic(spec: LayerBenchSpec, ranks: Ranks, plan: "RoutingPlan", ds_capacity: Optional[int],
             dtype: torch.dtype) -> dict:
    """Bytes a rank sends to other ranks (rows to itself not counted), mean over the ranks
    (``traffic.py``): per all-to-all of the dispatch (``ours_a2a_bytes``), and per training step
    (dispatch and combine, forward and backward: 4 all-to-alls; ``ours_dispatch_step_bytes``: the
    dispatch's two). With ``exchange`` token the dispatch sends the distinct (token, rank) pairs,
    each with its slot-mask columns (``layers/token_wire.py``), the combine one row per route.
    ``token_rank_a2a_step_bytes``: each token sent once per destination rank both ways, rows of H
    (``token_rank_dispatch_step_bytes``: the dispatch's two)."""
    from moe_plugin.layers.token_wire import mask_bits
    from moe_plugin_tools.bench.traffic import deepspeed_bytes_sent, ours_rows_sent, token_rank_rows_sent

    itemsize, L = dtype.itemsize, spec.experts // ranks.size
    plan = plan.kept(int(plan.kept_D.sum()))
    rows = [ours_rows_sent(plan.kept_E, ranks.size, ranks.rank),
            token_rank_rows_sent(plan.token_R, plan.slot_R(), L, ranks.size, ranks.rank)]
    per_route, token_rank = (v / ranks.size for v in ranks.reduce(rows, "sum"))
    combine = per_route * spec.hidden * itemsize
    dispatch = combine
    if spec.exchange == "token":
        columns = spec.hidden + -(-L // mask_bits(dtype))         # H + the mask columns
        dispatch = token_rank * columns * itemsize
    out = {"ours_a2a_bytes": round(dispatch), "ours_a2a_step_bytes": round(2 * dispatch + 2 * combine),
           "ours_dispatch_step_bytes": round(2 * dispatch),
           "token_rank_a2a_step_bytes": round(4 * token_rank * spec.hidden * itemsize),
           "token_rank_dispatch_step_bytes": round(2 * token_rank * spec.hidden * itemsize)}
    if ds_capacity is not None:
        # DeepSpeed pads every rank to the same capacity (dropless: the max over the EP group)
        capacity = int(ranks.reduce([ds_capacity], "max")[0])
        out["deepspeed_a2a_bytes"] = deepspeed_bytes_sent(spec.experts, capacity, ranks.size, spec.hidden, itemsize)
        out["ours_over_deepspeed_a2a"] = _ratio(out["ours_a2a_bytes"], out["deepspeed_a2a_bytes"])
    return out


def _time_rotating(runs: dict[str, _Run], warmup: int, iters: int, ranks: Ranks,
                   target: Target) -> dict[str, list[float]]:
    """ms per forward + backward; iteration i starts with variant ``i % len(runs)``. Across ranks
    a step starts after a barrier and counts as long as the slowest rank; off the CPU the device
    is synchronised before the clock starts and before it stops."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + iters):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            run = runs[name]
            run.clear()
            target.sync()
            ranks.barrier()
            start = time.perf_counter()
            run.step()
            target.sync()
            elapsed = ranks.reduce([(time.perf_counter() - start) * 1e3], "max")[0]
            if i >= warmup:
                times[name].append(elapsed)
    for run in runs.values():
        run.clear()
    return times


def _round(value: float) -> float:
    return round(value, 2)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 3) if a is not None and b else None


def specs_from_args(args: argparse.Namespace) -> list[LayerBenchSpec]:
    """One spec per expert count and skew; checks ``--device`` (``device.check_device``)."""
    from moe_plugin_tools.bench.device import target_from_args

    target = target_from_args(args)
    if args.group_topk is not None and args.vs != "none":
        raise ValueError(f"--group-topk needs --vs none: the {args.vs} layer does not limit the groups alike")
    if args.vs == "megatron":
        from moe_plugin_tools.bench.megatron_moe import require_cuda

        require_cuda(target.device)
    specs = [LayerBenchSpec(tokens=args.tokens, experts=e, hidden=args.hidden, ffn=args.ffn, k=args.top_k,
                            capacity_factor=args.capacity_factor, dropless=args.dropless, skew=s,
                            iters=args.iters, warmup=args.warmup, vs_deepspeed=args.vs == "deepspeed",
                            vs_megatron=args.vs == "megatron", breakdown=args.breakdown,
                            recompute_pre_activation=args.recompute_pre_activation,
                            overlap_chunks=args.overlap_chunks, router_groups=args.router_groups,
                            group_topk=args.group_topk, exchange=args.exchange,
                            deterministic=args.deterministic, seed=args.seed,
                            device=target.device, dtype=target.dtype)
             for e in args.experts for s in args.skew]
    for spec in specs:      # a bad moe block fails here, before any rank starts
        spec.moe_config(args.ep)
    return specs


def summary(record: dict) -> str:
    """One human-readable line of a record."""
    def ms(name: str) -> str:
        value = record[f"{name}_ms"]
        return "-" if value is None else f"{value:.1f}"

    limit = (f" group_topk={record['group_topk']} of {record['router_groups'] or 'ep'}"
             if record.get("group_topk") else "")
    return (f"ep={record['ep']} T={record['tokens']} E={record['experts']} H={record['hidden']} F={record['ffn']} k={record['k']} "
            f"cf={record['capacity_factor']}{' dropless' if record['dropless'] else ''} skew={record['skew']}"
            f"{' chunks=%d' % record['overlap_chunks'] if record.get('overlap_chunks', 1) > 1 else ''}"
            f"{limit}{' exchange=' + record['exchange'] if record.get('exchange', 'counts') != 'counts' else ''}: "
            f"ours {ms('ours')} ms, deepspeed {ms('deepspeed')} ms, "
            + (f"megatron {ms('megatron')} ms, " if record["megatron_ms"] is not None else "")
            + f"floor {ms('floor')} ms | "
            f"deepspeed/ours {record['deepspeed_over_ours']} (at most {record['deepspeed_over_floor']}: "
            f"deepspeed/floor), ours/floor {record['ours_over_floor']} | peak MiB "
            + ", ".join(f"{n} {record[f'{n}_peak_bytes'] / 2**20:.0f}" for n in VARIANTS
                        if record[f"{n}_peak_bytes"] is not None)
            + (f" | a2a bytes ours {record['ours_a2a_bytes']} (step {record['ours_a2a_step_bytes']}, token once per "
               f"rank {record['token_rank_a2a_step_bytes']}), deepspeed {record.get('deepspeed_a2a_bytes')}"
               if "ours_a2a_bytes" in record else "")
            + f" | max load {record['max_load']} (mean {record['mean_load']:.0f}) | load avg {record['loadavg']}, "
            f"others_cpu {record['others_cpu']}")
