"""Where a training step's time goes, part by part: attention, MLPs, the MoE layer's parts,
collectives, optimizer.

``StepParts(model)`` names the parts of a Megatron-Core GPT: it opens a profiler scope
(``record_function``) around the forward of every embedding, attention, MLP, norm and output
layer; the MoE layer opens its own around router, dispatch, experts and combine
(``MoELayer.forward``). ``parts_ms(run_step, steps)`` runs ``run_step()`` ``steps`` times under
``torch.profiler`` (CPU) and returns the milliseconds per step of every part on this rank:

* a forward operator counts for the innermost scope around it; a backward node for the scope of
  the forward operator that made it (the autograd sequence number links the two), so each part's
  figure is its forward plus its backward;
* collectives are split out: in an MoE scope they are ``moe.all_to_all`` (counts and rows), out of
  it ``collectives`` (gradient reductions, ZeRO, the loss's all-reduces); a collective's time
  includes waiting for the slowest peer, which makes it the part that absorbs imbalance;
* ``optimizer`` is ``engine.step()`` (the caller scopes it with ``PHASE_SCOPES``, e.g. ``scoped_step``);
  ``backward_other`` the backward work no forward operator made (gradient accumulation, the engine's
  hooks); ``other`` the rest of the step (Python between scopes, the loss, data movement).

The parts add up to the step's time on this rank (``total``). Timings under the profiler are a
little slower than without it; the shares are what the breakdown is for.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

# Module class names (Megatron-Core, the plugin, the bench's DeepSpeed wrapper) -> part.
MODULE_PARTS = {"LanguageModelEmbedding": "embedding", "SelfAttention": "attention", "MLP": "mlp",
                "MegatronMoEMLP": "moe", "DeepSpeedMoEMLP": "moe", "LayerNorm": "norms", "RMSNorm": "norms",
                "WrappedTorchNorm": "norms", "TENorm": "norms", "FusedLayerNorm": "norms"}
NAMED_PARTS = {"output_layer": "output"}   # by module name
BACKWARD_NODE = "autograd::engine::evaluate_function"
PHASE_SCOPES = ("step.forward", "step.backward", "optimizer")
COLLECTIVE_MARKS = ("c10d::", "alltoall", "all_to_all", "AllToAll", "allreduce", "all_reduce", "allgather",
                    "all_gather", "reduce_scatter", "broadcast", "barrier")


class StepParts:
    """Scopes on ``model``'s parts (module docstring); ``close()`` removes them."""

    def __init__(self, model: nn.Module):
        self._open: list[record_function] = []
        self._hooks = []
        for name, module in model.named_modules():
            part = NAMED_PARTS.get(name.rsplit(".", 1)[-1], MODULE_PARTS.get(type(module).__name__))
            if part is not None:
                self._hooks += [module.register_forward_pre_hook(self._enter(part)),
                                module.register_forward_hook(self._exit)]

    def _enter(self, part: str):
        def hook(_module, _inputs):
            scope = record_function(part)
            scope.__enter__()
            self._open.append(scope)
        return hook

    def _exit(self, _module, _inputs, _output) -> None:
        self._open.pop().__exit__(None, None, None)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def scoped_step(forward: Callable[[], torch.Tensor], backward: Callable[[torch.Tensor], None],
                step: Callable[[], None]) -> Callable[[], None]:
    """One training step (forward -> loss, backward(loss), step()) under the phase scopes."""

    def run() -> None:
        with record_function("step.forward"):
            loss = forward()
        with record_function("step.backward"):
            backward(loss)
        with record_function("optimizer"):
            step()

    return run


class PartsProfile:
    """``start()`` ... ``stop(steps)``: the parts of the steps run in between on this rank, in ms per
    step (module docstring); ``total`` is their wall time per step under the profiler."""

    def __init__(self, model: nn.Module):
        self.scopes = StepParts(model)
        self._profile = profile(activities=[ProfilerActivity.CPU])
        self._start = 0.0

    def start(self) -> None:
        self._profile.__enter__()
        self._start = time.perf_counter()

    def stop(self, steps: int) -> dict[str, float]:
        total = time.perf_counter() - self._start
        self._profile.__exit__(None, None, None)
        self.scopes.close()
        self_us = attribute(self._profile.events())
        parts = {part: self_us.get(part, 0.0) / 1e3 / steps for part in PARTS}
        parts["other"] += max(0.0, 1e3 * total / steps - sum(parts.values()))
        parts["total"] = 1e3 * total / steps
        return parts


def parts_ms(model: nn.Module, run_step: Callable[[], None], steps: int) -> dict[str, float]:
    """``PartsProfile`` over ``steps`` calls of ``run_step``."""
    prof = PartsProfile(model)
    prof.start()
    for _ in range(steps):
        run_step()
    return prof.stop(steps)


def over_ranks(parts: dict[str, float], device="cpu") -> dict[str, dict[str, float]]:
    """``{"mean": ..., "max": ...}`` of every part over the ranks (collective)."""
    import torch.distributed as dist

    names = [*PARTS, "total"]
    values = torch.tensor([parts[n] for n in names], dtype=torch.float64, device=device)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return {"mean": parts, "max": parts}
    high = values.clone()
    dist.all_reduce(values)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return {"mean": dict(zip(names, (values / dist.get_world_size()).tolist())), "max": dict(zip(names, high.tolist()))}


def table(columns: dict[str, dict[str, float]]) -> str:
    """A markdown table: a row per part, a column per named breakdown (ms per step)."""
    head = "| part | " + " | ".join(columns) + " |\n|---|" + "---:|" * len(columns)
    rows = [f"| {n} | " + " | ".join(f"{c.get(n, 0.0):.1f}" for c in columns.values()) + " |"
            for n in [*PARTS, "total"] if any(c.get(n, 0.0) >= 0.05 for c in columns.values())]
    return "\n".join([head, *rows])


def attribute(events) -> dict[str, float]:
    """Self CPU microseconds of the profiled events by part (module docstring)."""
    forward_scope: dict[int, str] = {}
    for e in events:   # the scope of every forward operator that made an autograd node
        if e.sequence_nr >= 0 and not _in_backward(e):
            forward_scope.setdefault(e.sequence_nr, _scope(e))
    totals: dict[str, float] = defaultdict(float)
    for e in events:
        totals[_part(e, forward_scope)] += e.self_cpu_time_total
    return dict(totals)


def _ancestors(e):
    while e is not None:
        yield e
        e = e.cpu_parent


def _in_backward(e) -> bool:
    return any(a.name.startswith(BACKWARD_NODE) or a.name == "step.backward" for a in _ancestors(e))


def _scope(e) -> str:
    """The innermost part scope around ``e`` (itself included), or its phase."""
    for a in _ancestors(e):
        if a.name in PART_NAMES or a.name.startswith("moe."):
            return a.name
    for a in _ancestors(e):
        if a.name in PHASE_SCOPES:
            return a.name
    return "other"


def _part(e, forward_scope: dict[int, str]) -> str:
    node = next((a for a in _ancestors(e) if a.name.startswith(BACKWARD_NODE)), None)
    # a backward node counts for the scope of the forward operator behind it
    scope = _scope(e) if node is None else forward_scope.get(node.sequence_nr, "backward_other")
    if scope == "moe.all_to_all" or any(mark in e.name for mark in COLLECTIVE_MARKS):
        return "moe.all_to_all" if scope.startswith("moe") else "collectives"
    return {"step.forward": "other", "step.backward": "backward_other"}.get(scope, scope)


PART_NAMES = frozenset(MODULE_PARTS.values()) | frozenset(NAMED_PARTS.values()) | {"optimizer"}
# Every part, in the order of a step; "moe" is the MoE MLP outside the layer's own scopes.
PARTS = ("embedding", "norms", "attention", "mlp", "moe", "moe.router", "moe.dispatch", "moe.all_to_all",
         "moe.experts", "moe.combine", "moe.shared_expert", "moe.overlapped", "output", "collectives",
         "backward_other", "optimizer", "other")


