"""``TrainingGuard``: a run that stops learning stops, with one message on every rank.

fp32/bf16 stop at the first non-finite gradient, fp16 after ``max_skipped_steps`` skipped steps in a row;
the message names the step, the parameter and rank, and the last checkpoint. ``after_step`` is collective,
once per optimizer step. The rules in full: docs/long_runs.md.
"""
from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from moe_plugin.compat.deepspeed_engine import optimizer_loss_scale

SLOW_FACTOR = 10.0     # a step this many times the median so far is logged
SLOW_MIN_STEPS = 3     # steps timed before the median counts
SLOW_MIN_S = 1.0       # and never for a step under a second (a busy machine's jitter on tiny steps)


class TrainingStopped(RuntimeError):
    """Raised on every rank by ``StepHealth.raise_if_stopped`` / ``TrainingGuard.check``."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class GradientWatch:
    """Gradient hooks keeping each parameter's largest gradient norm since ``reset`` (``norm_W``), without a sync."""

    def __init__(self, model: nn.Module):
        from moe_plugin.layers import MoELayer

        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        moe_layers = [prefix for prefix, module in model.named_modules() if isinstance(module, MoELayer)]
        self.moe_layer = [next((m for m in moe_layers if name.startswith(m + ".")), None) for name in self.names]
        # follows the gradients' device at the first collect (DeepSpeed moves the model after this)
        self.norm_W = torch.zeros(len(named), dtype=torch.float32)
        self._index: list[int] = []               # queued since the last collect: parameter index,
        self._norms: list[torch.Tensor] = []      # and the norm of the gradient its hook saw
        self._queue_limit = max(64, 4 * len(named))
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, (_, p) in enumerate(named)]

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if param.grad is not None:
                self._norms.append(torch.linalg.vector_norm(param.grad, dtype=torch.float32))
                self._index.append(index)
                if len(self._norms) >= self._queue_limit:   # a loop that never asks: the queue stays short
                    self.collect()
        return hook

    def collect(self) -> None:
        """Fold the queued norms into ``norm_W``: the max per parameter, a NaN or inf kept."""
        if not self._norms:
            return
        norms = torch.stack(self._norms)
        if self.norm_W.device != norms.device:
            self.norm_W = self.norm_W.to(norms.device)
        index = torch.tensor(self._index, dtype=torch.long).to(norms.device, non_blocking=True)
        self.norm_W.scatter_reduce_(0, index, norms, reduce="amax", include_self=True)
        self._norms.clear()
        self._index.clear()

    def any_bad(self) -> bool:
        """Whether any parameter's gradient norm is non-finite since the last ``reset`` (syncs)."""
        self.collect()
        return not bool(torch.isfinite(self.norm_W).all())

    def first_bad(self) -> Optional[int]:
        """Index (model order) of the first parameter with a non-finite gradient norm, or None (syncs)."""
        if not self.any_bad():
            return None
        flagged = (~torch.isfinite(self.norm_W)).nonzero()
        return int(flagged[0, 0])

    def largest(self) -> tuple[Optional[int], float]:
        """(index, norm) of the parameter with the largest gradient norm; (None, 0.0) without any."""
        if not len(self.names):
            return None, 0.0
        self.collect()
        value, index = self.norm_W.max(dim=0)
        return int(index), float(value)

    def describe(self, index: int) -> str:
        layer = self.moe_layer[index]
        return self.names[index] + (f" (an expert weight of the MoE layer {layer})"
                                     if layer and ".experts." in self.names[index] else
                                     f" (in the MoE layer {layer})" if layer else "")

    def reset(self) -> None:
        self._norms.clear()
        self._index.clear()
        self.norm_W.zero_()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


@dataclass
class StepHealth:
    """What ``after_step`` found: ``skipped`` (this step), ``skipped_steps`` (the engine's total),
    ``consecutive_skips``, ``step_s``, ``slow`` (the slow-step line) and ``stopped`` (the message), or None."""

    step: int
    skipped: bool
    skipped_steps: int
    consecutive_skips: int
    step_s: Optional[float] = None
    slow: Optional[str] = None
    stopped: Optional[str] = None

    def raise_if_stopped(self) -> None:
        if self.stopped is not None:
            raise TrainingStopped(self.stopped, self.step)


class TrainingGuard:
    """Checks ``engine`` after each optimizer step; ``watch`` None names no parameter; ``log``: the slow-step line."""

    def __init__(self, engine: Any, watch: Optional[GradientWatch] = None, *, max_skipped_steps: int = 10,
                 checkpoint_dir: Optional[str] = None, slow_factor: float = SLOW_FACTOR,
                 log: Optional[Callable[[str], None]] = None, clock: Callable[[], float] = time.perf_counter):
        if isinstance(max_skipped_steps, bool) or not isinstance(max_skipped_steps, int) or max_skipped_steps < 1:
            raise ValueError(f"max_skipped_steps: got {max_skipped_steps!r}; expected an integer >= 1")
        self.engine = engine
        self.watch = watch
        self.max_skipped_steps = max_skipped_steps
        self.checkpoint_dir = checkpoint_dir
        self.slow_factor = slow_factor
        self.log = log if log is not None else _print_on_rank0
        self.clock = clock
        self.consecutive_skips = 0
        self._times: list[float] = []   # sorted step times so far
        self._last = clock()

    def check(self, step: int, step_s: Optional[float] = None) -> StepHealth:
        """``after_step`` and ``raise_if_stopped``."""
        health = self.after_step(step, step_s)
        health.raise_if_stopped()
        return health

    def after_step(self, step: int, step_s: Optional[float] = None) -> StepHealth:
        """Collective: every rank, after each optimizer step. ``step``: the step just done, for the messages;
        ``step_s``: its time (default: since the previous call)."""
        fp16 = bool(self.engine.fp16_enabled())
        skipped = not self.engine.was_step_applied()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else None
        first = self.watch.first_bad() if self.watch is not None else None
        rank, world = _rank_and_world()
        # Agree: the lowest rank that saw a non-finite gradient, any skipped step, any bad norm.
        bad_norm = norm is not None and not math.isfinite(norm)
        flags = [world - rank if first is not None else 0, int(skipped), int(bad_norm)]
        if world > 1:
            flags = _all_max(flags)
        culprit_rank = world - flags[0] if flags[0] else None
        skipped, bad_norm = bool(flags[1]), bool(flags[2])
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        health = StepHealth(step, skipped, int(self.engine.skipped_steps), self.consecutive_skips)
        health.step_s, health.slow = self._time(step, step_s)
        if health.slow is not None:
            self.log(health.slow)
        if fp16:
            failed = self.consecutive_skips >= self.max_skipped_steps
        else:
            failed = culprit_rank is not None or skipped or bad_norm
        if failed:
            where = self._where(culprit_rank, first, rank, world)
            if fp16:
                what = (f"{self.consecutive_skips} steps in a row skipped for overflowing fp16 gradients "
                        f"(max_skipped_steps {self.max_skipped_steps}{_loss_scale(self.engine)})")
            else:
                shown = norm if norm is not None else "not computed"
                what = f"non-finite gradients (global gradient norm {shown}{', the step was skipped' if skipped else ''})"
            health.stopped = (f"step {step}: {what}; {where}; last checkpoint: "
                              f"{self._last_checkpoint()}. Training stopped: lower the learning rate or check the "
                              "data, and resume from the checkpoint")
        if self.watch is not None:
            self.watch.reset()
        return health

    def _time(self, step: int, step_s: Optional[float]) -> tuple[float, Optional[str]]:
        now = self.clock()
        if step_s is None:
            step_s = now - self._last
        self._last = now
        slow = None
        if len(self._times) >= SLOW_MIN_STEPS:
            n = len(self._times)
            median = (self._times[(n - 1) // 2] + self._times[n // 2]) / 2
            if step_s > self.slow_factor * median and step_s > SLOW_MIN_S:
                slow = (f"step {step}: took {step_s:.2f} s, {step_s / median:.0f}x the median step so far "
                        f"({median:.3f} s); a rank may have stalled (swapping, a stopped process, a slow disk)")
        bisect.insort(self._times, step_s)
        return step_s, slow

    def _where(self, culprit_rank: Optional[int], first: Optional[int], rank: int, world: int) -> str:
        """The parameter to name (collective when ``world`` > 1; only on the way to a stop)."""
        if self.watch is None:
            return "parameter not tracked (no GradientWatch)"
        if culprit_rank is not None:
            name = self.watch.describe(first) if culprit_rank == rank and first is not None else None
            if world > 1:
                box = [name]
                dist.broadcast_object_list(box, src=culprit_rank)
                name = box[0]
            return f"first parameter with a non-finite gradient norm: {name} on rank {culprit_rank}"
        # No parameter's own norm overflowed, their sum did (or the reduction did): the largest one.
        index, value = self.watch.largest()
        mine = [(value, rank, self.watch.describe(index) if index is not None else None)]
        if world > 1:
            every = [None] * world
            dist.all_gather_object(every, mine[0])
            mine = every
        value, where, name = max(mine, key=lambda item: (item[0], -item[1]))
        return (f"no parameter's gradient norm alone is non-finite; the largest: {name} on rank {where} "
                f"({value:.3g})")

    def _last_checkpoint(self) -> str:
        if self.checkpoint_dir is None:
            return "none (no checkpoint directory)"
        from moe_plugin.checkpoint import CheckpointError, read_latest

        try:
            return f"{self.checkpoint_dir}/{read_latest(self.checkpoint_dir)}"
        except CheckpointError:
            return f"none saved in {self.checkpoint_dir}"


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_max(values: list[int]) -> list[int]:
    from deepspeed.accelerator import get_accelerator

    flags = torch.tensor(values, dtype=torch.int64, device=get_accelerator().current_device_name())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return flags.tolist()


def _loss_scale(engine: Any) -> str:
    scale = optimizer_loss_scale(engine)
    return f", loss scale now {scale:g}" if scale is not None else ""


def _print_on_rank0(text: str) -> None:
    if _rank_and_world()[0] == 0:
        print(text, flush=True)
