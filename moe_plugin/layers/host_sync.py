"""The layer's one host sync per forward: each part of the dispatch adds its device integers
(``HostSync.add``; the finite check's flags: ``check``); ``read`` copies them all in one transfer and
gives the finite verdict before any row leaves the rank. Shape suffixes: see ``moe_plugin.layers``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from moe_plugin.layers import comm
from moe_plugin.layers.router import FiniteCheck


@dataclass(eq=False)
class HostValue:
    """Integers on the device (``device``) and, once the sync is read, on the host (``host``, flattened)."""

    device: Tensor
    host: list[int] = field(default_factory=list)


class HostSync:
    """One forward's host sync (module docstring)."""

    def __init__(self) -> None:
        self._values: list[HostValue] = []
        self._flags: Optional[tuple[HostValue, comm.Group]] = None

    def add(self, device: Tensor) -> HostValue:
        value = HostValue(device)
        self._values.append(value)
        return value

    def check(self, finite: Optional[FiniteCheck], flags: Optional[Tensor] = None, group: comm.Group = None) -> None:
        """Read the router's finite flags too (``flags`` over ``group`` where a wire format carried them)."""
        if finite is None:
            return
        if flags is None:
            flags, group = finite.flags(), finite.group
        self._flags = (self.add(flags), group)

    def read(self) -> None:
        """The one host sync, then the finite verdict (before any row leaves the rank)."""
        dtype = self._values[0].device.dtype
        host = torch.cat([v.device.reshape(-1).to(dtype) for v in self._values]).tolist()
        start = 0
        for value in self._values:
            value.host, start = host[start:start + value.device.numel()], start + value.device.numel()
        if self._flags is not None:
            flags, group = self._flags
            FiniteCheck.verdict(flags.host, group)
