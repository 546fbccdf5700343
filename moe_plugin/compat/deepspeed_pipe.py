"""DeepSpeed 0.19.8's ``PipelineModule`` with its stage boundaries given instead of searched
(``_partition_layers`` overridden; details: docs/design/compat_upstream.md).
"""
from __future__ import annotations

from typing import Any

from deepspeed.runtime.pipe.module import PipelineModule


class GivenPartsPipelineModule(PipelineModule):
    """A ``PipelineModule`` whose stage s runs ``layers[parts[s]:parts[s + 1]]``, the caller's boundaries."""

    def __init__(self, layers: list, *, parts: list[int], **kwargs: Any):
        if not all(hasattr(PipelineModule, name) for name in ("_partition_layers", "_set_bounds")):
            raise RuntimeError("deepspeed.pipe.PipelineModule lacks _partition_layers/_set_bounds: unsupported "
                               "DeepSpeed version")
        if len(parts) != kwargs["topology"].get_dim("pipe") + 1 or parts[-1] != len(layers):
            raise ValueError(f"parts {parts} do not split {len(layers)} pieces into "
                             f"{kwargs['topology'].get_dim('pipe')} stages")
        self._given_parts = list(parts)
        super().__init__(layers, **kwargs)

    def _partition_layers(self, method: str = "uniform") -> None:
        self.parts = list(self._given_parts)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])
