"""``ExitRequest``: save and leave at a step boundary when the cluster asks (a signal) or the
allocation runs out (a wall-time limit), every rank at the same step.

    exit_request = ExitRequest(signals=True, duration_mins=args.exit_duration_in_mins)   # installs the handler
    try:
        for step in range(start, iters):
            train_step(...)
            reason = exit_request.after_step(step + 1)   # collective: every rank, once per optimizer step
            if reason is not None:                        # the same on every rank
                save_checkpoint(result, "ckpt", tag=f"step{step + 1}")
                return ExitRequest.EXIT_STATUS     # 75, from main: the script ends with exit_process(main())
    finally:
        exit_request.close()                              # the previous handlers back

The handler (SIGTERM and SIGUSR1: SLURM's ``--signal`` sends the latter) only sets a flag, so a
signal never interrupts a collective, a save or a half-done step. ``after_step`` turns the flags
into one all-reduce (MAX, the world group) of two numbers: a signal that reached one rank, or the
wall time that passed on one rank's clock, stops every rank after the same step, with the same
reason. Megatron-LM's ``--exit-signal-handler`` and ``--exit-duration-in-mins``.

``EXIT_STATUS`` (also ``ExitRequest.EXIT_STATUS``) is 75, ``EX_TEMPFAIL`` of sysexits.h ("try again
later"): what a run that left this way exits with, so that a job script can tell it from 0 (finished),
1 (a failure), 2 (bad input) and 143 (killed by SIGTERM) and requeue it. What DeepSpeed's launcher
does with a signal, and which status it returns: docs/long_runs.md, *Preemption and time limits*.
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
    """Signal flag and wall-time limit, agreed across the ranks at each step boundary.

    ``signals``: install the handler for ``SIGNALS`` now (True) or not (False), or the signals to
    catch. ``duration_mins``: stop once this many minutes have passed since ``start`` (default:
    now); None: no limit. ``clock``: seconds (``time.monotonic``), injectable. ``group``: the
    process group that agrees (default: the world). ``device``: where the flag tensor lives for
    the all-reduce (default: DeepSpeed's accelerator's current device: NCCL takes no CPU tensor)."""

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
        """Collective (every rank of ``group``, after each optimizer step) when ``enabled``: the
        reason to stop after ``step``, the same text on every rank, or None. No collective when
        neither a handler nor a limit is set."""
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
