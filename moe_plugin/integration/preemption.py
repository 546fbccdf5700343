"""``ExitRequest``: save and leave at a step boundary when the cluster asks (a signal) or the
allocation runs out (a wall-time limit), every rank at the same step.

The handler only sets a flag; ``after_step`` agrees on it in one all-reduce. Such a run exits with
``EXIT_STATUS`` 75 (``EX_TEMPFAIL``): docs/long_runs.md, *Preemption and time limits*.
"""
from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

EXIT_STATUS = 75          # sysexits.h EX_TEMPFAIL: stopped early with a checkpoint; resume with --load
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ExitRequest:
    """Signal flag and wall-time limit, agreed at each step boundary. ``signals``: True (``SIGNALS``), False or
    the signals to catch. ``duration_mins``: the limit from ``start`` (None: none). ``group``: who agrees (default:
    the world); ``device``: the flag tensor's (default: the accelerator's, as NCCL takes no CPU tensor)."""

    EXIT_STATUS = EXIT_STATUS

    def __init__(self, signals: Any = True, duration_mins: Optional[float] = None, *,
                 start: Optional[float] = None, clock: Callable[[], float] = time.monotonic,
                 group: Optional[dist.ProcessGroup] = None, device: Optional[torch.device | str] = None):
        if duration_mins is not None and (isinstance(duration_mins, bool) or not duration_mins > 0):
            raise ValueError(f"duration_mins: got {duration_mins!r}; expected a number of minutes > 0, or None")
        self.duration_s = None if duration_mins is None else 60.0 * float(duration_mins)
        self.clock = clock
        self.start = clock() if start is None else start
        self.group = group
        self.device = device
        self.received: Optional[str] = None   # the name of the first signal this process caught
        self._previous: dict[int, Any] = {}
        chosen = SIGNALS if signals is True else tuple(signals or ())
        for signum in chosen:
            self._previous[signum] = signal.signal(signum, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    @property
    def enabled(self) -> bool:
        return bool(self._previous) or self.duration_s is not None

    def elapsed_s(self) -> float:
        return self.clock() - self.start

    def after_step(self, step: int) -> Optional[str]:
        """The reason to stop after ``step`` (the same on every rank) or None; collective when ``enabled``."""
        if not self.enabled:
            return None
        signum = signal.Signals[self.received].value if self.received is not None else 0
        late = int(self.duration_s is not None and self.elapsed_s() >= self.duration_s)
        if dist.is_available() and dist.is_initialized():
            device = self.device
            if device is None:
                from deepspeed.accelerator import get_accelerator

                device = get_accelerator().current_device_name()
            # the largest signal number any rank caught (the same name everywhere), any rank's clock
            flags = torch.tensor([signum, late], dtype=torch.int32, device=device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            signum, late = (int(v) for v in flags.tolist())
        if not signum and not late:
            return None
        reasons = [f"{signal.Signals(signum).name} received"] if signum else []
        if late:
            reasons.append(f"the wall time passed {self.duration_s / 60:g} minutes")
        return f"step {step}: " + " and ".join(reasons)

    def close(self) -> None:
        """The handlers that were there before (idempotent)."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
