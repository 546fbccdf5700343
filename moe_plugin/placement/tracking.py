"""Load tracking: per MoE layer, the expert load of the last ``window`` steps, from the gate.

    tracker = LoadTracker(model, window=100, trace_path="run/gate.trace")   # hooks every MoELayer
    tracker.end_step(step)                        # every rank of the job, after the step's forwards
    loads = tracker.window_loads()                # collective; {layer name: WindowLoad}

The window is exact (a ring of steps), at most one all-reduce per check. docs/design/placement_load.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_plugin.layers.moe_layer import MoELayer, StatsSum, moe_layers
from moe_plugin.placement.trace import TraceMeta, TraceWriter

if TYPE_CHECKING:
    from moe_plugin.groups.process_groups import ProcessGroups


@dataclass(frozen=True)
class WindowLoad:
    """One layer's load over the last ``steps`` steps (sums over the stage, identical on its ranks)."""

    steps: int
    traffic_PE: Tensor      # [P, E] int64 kept routes of EP rank p's tokens to expert e

    @property
    def kept_E(self) -> Tensor:
        """[E] routes each expert processed."""
        return self.traffic_PE.sum(0)

    def per_step(self) -> Tensor:
        """[P, E] float64 mean traffic of one step."""
        return self.traffic_PE.double() / max(self.steps, 1)


class _Ring:
    """The last ``size`` values of one [P, E] tensor and their running sum."""

    def __init__(self, size: int, like: Tensor) -> None:
        self.values = torch.zeros((size, *like.shape), dtype=torch.int64, device=like.device)
        self.total = torch.zeros_like(like, dtype=torch.int64)
        self.count = 0

    def push(self, value: Tensor) -> None:
        slot = self.count % self.values.shape[0]
        self.total += value - self.values[slot]
        self.values[slot] = value
        self.count += 1

    @property
    def filled(self) -> int:
        return min(self.count, self.values.shape[0])


def collective_device(group: dist.ProcessGroup, tensors: dict[str, Tensor]) -> torch.device:
    """Where a tensor for a collective over ``group`` lives (a stage without MoE layers: the accelerator's)."""
    if tensors:
        return next(iter(tensors.values())).device
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    from deepspeed.accelerator import get_accelerator
    return torch.device(get_accelerator().current_device_name())


def trace_name(name: str, layer: MoELayer, stage: int = 0, pp: int = 1) -> str:
    """A layer's name in a trace: ``layer<global index>``, else its module name (with its stage)."""
    index = getattr(layer, "layer_index", None)
    if index is not None:
        return f"layer{int(index)}"
    return name if pp == 1 else f"stage{stage}.{name}"


class LoadTracker:
    """Windowed expert load of every ``MoELayer`` in ``model``, by module name; with ``trace_path`` a
    gate trace too (global rank 0). ``close()`` removes the hooks and closes the trace."""

    def __init__(self, model: nn.Module, window: int, *, groups: Optional["ProcessGroups"] = None,
                 trace_path: Union[str, Path, None] = None, trace_info: Optional[dict] = None,
                 trace_append: bool = False):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive number of steps, got {window!r}")
        self.window = window
        self.layers: dict[str, MoELayer] = moe_layers(model)
        if not self.layers and groups is None:
            raise ValueError(f"{type(model).__name__} has no MoELayer to track; on a pipeline stage without MoE "
                             "layers pass groups=...")
        for layer in self.layers.values():   # the traffic comes with the counts exchange
            layer.track_traffic("a load tracker")
        first = next(iter(self.layers.values()), None)
        self.groups = groups if groups is not None else first.groups
        self.num_experts = first.config.num_experts if first is not None else None
        self.ep_size = first.parallel.ep_size if first is not None else self.groups.layout.sizes.ep
        self._tokens = first.parallel.tokens if first is not None else None
        tokens_size = dist.get_world_size(self._tokens) if self._tokens is not None else 1
        self.needs_reduce = self._tokens is not None and tokens_size != self.ep_size
        self._sums = {name: StatsSum() for name in self.layers}
        self._rings: dict[str, _Ring] = {}
        self._hooks = [layer.register_forward_hook(self._hook(name)) for name, layer in self.layers.items()]
        self.tracing = trace_path is not None   # rings then hold stage sums, not this rank's share
        self.trace: Optional[TraceWriter] = None   # the writer, on global rank 0 only
        self.trace_stages: Optional[list[list[str]]] = None
        self.steps_seen = 0
        if self.tracing:
            self._setup_trace(Path(trace_path), trace_info or {}, trace_append)

    # -- accumulation -----------------------------------------------------------------------
    def _hook(self, name: str):
        def add(module: MoELayer, _inputs: Any, _output: Any) -> None:
            if module.training and module.last_stats is not None:
                self._sums[name].add(module.last_stats)
        return add

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self.trace is not None:
            self.trace.close()
            self.trace = None

    def end_step(self, step: int) -> None:
        """Close step ``step`` (every rank, after its forwards); collective only when tracing."""
        missing = [n for n, s in self._sums.items() if s.forwards == 0]
        if missing:
            raise RuntimeError(f"step {step}: MoE layers {missing} ran no training forward since the last "
                               "end_step(); call it once per step, after the step's forwards")
        routed = {n: s.routed for n, s in self._sums.items()}
        # kept routes per sender and expert; without EP one sender row: the kept load
        traffic = {n: s.traffic if s.traffic is not None else s.kept[None] for n, s in self._sums.items()}
        if self.tracing:
            routed, traffic = self._reduce(routed, traffic)
            self._write_trace(step, routed, traffic)
        for name, value in traffic.items():
            if name not in self._rings:
                self._rings[name] = _Ring(self.window, value)
            self._rings[name].push(value)
        for s in self._sums.values():
            s.reset()
        self.steps_seen += 1

    def window_loads(self) -> dict[str, WindowLoad]:
        """Every layer's load over the last ``min(window, steps)`` steps, identical on a stage's ranks
        (at most one all-reduce for all layers)."""
        if not self._rings:
            raise RuntimeError("no step tracked yet: call end_step() after each step's forwards")
        traffic = {name: ring.total.clone() for name, ring in self._rings.items()}
        if not self.tracing:
            _, traffic = self._reduce(None, traffic)
        return {name: WindowLoad(steps=self._rings[name].filled, traffic_PE=t.cpu()) for name, t in traffic.items()}

    # -- reduction ---------------------------------------------------------------------------
    def _reduce(self, routed: Optional[dict[str, Tensor]], traffic: dict[str, Tensor]):
        """Sums over the stage's token groups: one all-reduce of every layer's tensors packed."""
        if self._tokens is None or (not self.needs_reduce and routed is None):
            return routed, traffic
        tensors = [*traffic.values(), *(routed or {}).values()]
        packed = torch.cat([t.flatten() for t in tensors])
        dist.all_reduce(packed, group=self._tokens)
        summed = [part.view_as(t) for part, t in zip(packed.split([t.numel() for t in tensors]), tensors)]
        # every member of an EP group holds that group's matrix: count each group once
        out_traffic = {name: t // self.ep_size for name, t in zip(traffic, summed)}
        return (None if routed is None else dict(zip(routed, summed[len(traffic):]))), out_traffic

    # -- trace -------------------------------------------------------------------------------
    def _setup_trace(self, path: Path, info: dict, append: bool) -> None:
        """Layer names of every stage (one all-gather, once) and, on global rank 0, the writer."""
        g = self.groups
        rank = dist.get_rank() if dist.is_initialized() else 0
        pp = g.layout.sizes.pp if g is not None else 1
        stage = g.layout.coords(rank)["pp"] if g is not None else 0
        mine = [trace_name(n, m, stage, pp) for n, m in self.layers.items()]
        stages = [mine]
        if pp > 1:
            stages = [None] * pp
            dist.all_gather_object(stages, (mine, self.num_experts), group=g.pp)
            experts = {e for _, e in stages if e is not None}
            stages = [names for names, _ in stages]
            self.num_experts = experts.pop() if len(experts) == 1 else self.num_experts
        self.trace_stages = stages
        self._pp_ranks = g.ranks("pp") if g is not None else [0]
        if rank != 0:
            return
        names = [n for s in stages for n in s]
        header = dict(info)
        if g is not None:
            header.setdefault("sizes", g.layout.sizes.model_dump())
            header.setdefault("ep_groups", g.layout.groups("ep"))
        header.setdefault("load", "routes chosen per expert, before capacity, summed over the step")
        header.setdefault("traffic", "kept routes [EP rank of the sender, expert], summed over the stage's EP groups")
        self.trace = TraceWriter(path, TraceMeta(names, num_experts=self.num_experts, ep_size=self.ep_size,
                                                 info=header), append=append)

    def _write_trace(self, step: int, routed: dict[str, Tensor], traffic: dict[str, Tensor]) -> None:
        records = self._gather_stages(routed, traffic)
        if self.trace is not None:
            self.trace.append(step, records)

    def _gather_stages(self, routed: dict[str, Tensor], traffic: dict[str, Tensor]) -> dict:
        """{trace name: (load_E, traffic_PE)} of every stage on global rank 0; other ranks get {}."""
        E, P = self.num_experts, self.ep_size
        stages = self.trace_stages
        if len(stages) == 1:
            names = stages[0]
            return {t: (routed[n].cpu(), traffic[n].cpu()) for t, n in zip(names, self.layers)}
        if 0 not in self._pp_ranks:
            return {}
        width = max(len(s) for s in stages) * E * (1 + P)
        mine = torch.zeros(width, dtype=torch.int64)
        at = 0
        for n in self.layers:
            mine[at:at + E] = routed[n].cpu()
            mine[at + E:at + E * (1 + P)] = traffic[n].cpu().flatten()
            at += E * (1 + P)
        mine = mine.to(collective_device(self.groups.pp, traffic))
        rank = dist.get_rank()
        gathered = [torch.zeros_like(mine) for _ in stages] if rank == 0 else None
        dist.gather(mine, gathered, dst=0, group=self.groups.pp)
        if rank != 0:
            return {}
        out = {}
        for names, flat in zip(stages, gathered):
            flat = flat.cpu()
            for i, name in enumerate(names):
                base = i * E * (1 + P)
                out[name] = (flat[base:base + E], flat[base + E:base + E * (1 + P)].view(P, E))
        return out
