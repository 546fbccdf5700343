"""Rank layout: which ranks form which group. Pure arithmetic, no torch.distributed.

Two grids over the same ranks, the attention grid TP x CP x DP x PP (CP 1) and the expert grid
ETP x EP x EDP x PP, laid out by one order string, fastest-varying dimension first (default
``tp-cp-ep-dp-pp``), so EP may be carved out of TP x DP. Groups are listed in the same order as
Megatron-Core's ``RankGenerator``. Derivation: docs/design/groups_layout.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from pydantic import ValidationError

from moe_plugin.configs.errors import from_validation_error
from moe_plugin.configs.schema import DEFAULT_ORDER, ROOT_KEY, ParallelConfig, ParallelSizes

# kind -> (grid, dimensions); "mp" is DeepSpeed's model parallelism, TP x PP.
GROUP_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tp": ("attn", ("tp",)),
    "pp": ("attn", ("pp",)),
    "dp": ("attn", ("dp",)),
    "mp": ("attn", ("tp", "pp")),
    "tp_dp": ("attn", ("tp", "dp")),
    "ep": ("expert", ("ep",)),
    "etp": ("expert", ("tp",)),
    "edp": ("expert", ("dp",)),
    "etp_ep": ("expert", ("tp", "ep")),
}
# What `moe-plugin layout --json` prints.
PUBLIC_KINDS = ("tp", "pp", "dp", "ep", "etp", "edp", "mp")


def _offsets(sizes: list[int], dims: list[int]) -> list[int]:
    """Rank offsets of every combination of coordinates over ``dims``, the first fastest."""
    out = [0]
    for d in dims:  # each later dimension repeats the offsets so far once per coordinate
        stride = math.prod(sizes[:d])
        out = [base + k * stride for k in range(sizes[d]) for base in out]
    return out


def orthogonal_groups(sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """Rank groups of a grid whose dimension i has ``sizes[i]`` (dimension 0 fastest): each varies the
    masked dimensions and fixes the others, ordered fastest-dimension-first."""
    inner = _offsets(sizes, [i for i, m in enumerate(mask) if m])
    return [[base + off for off in inner] for base in _offsets(sizes, [i for i, m in enumerate(mask) if not m])]


@dataclass(frozen=True)
class Grid:
    """One factorisation of the ranks: named dimensions in layout order."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    def groups(self, dims: tuple[str, ...]) -> list[list[int]]:
        return orthogonal_groups(list(self.sizes), [n in dims for n in self.names])

    def group_of(self, dims: tuple[str, ...], rank: int) -> list[int]:
        """The group varying ``dims`` that holds ``rank``, without listing the others."""
        varying = [i for i, n in enumerate(self.names) if n in dims]
        first = rank  # the member whose varying coordinates are all 0
        for i in varying:
            stride = math.prod(self.sizes[:i])
            first -= (rank // stride) % self.sizes[i] * stride
        return [first + off for off in _offsets(list(self.sizes), varying)]

    def coords(self, rank: int) -> dict[str, int]:
        out = {}
        for name, size in zip(self.names, self.sizes):
            out[name] = rank % size
            rank //= size
        return out

    def stride(self, name: str) -> int:
        """Distance in ranks between neighbours along dimension ``name``."""
        return math.prod(self.sizes[:self.names.index(name)])


@dataclass(frozen=True)
class RankLayout:
    """The attention grid and the expert grid of one job, and every group's rank lists."""

    sizes: ParallelSizes

    def __post_init__(self) -> None:
        self.sizes.check_pipeline_span()   # also for sizes that did not come through ``resolve``

    @classmethod
    def build(cls, world_size: int, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
              order: str = DEFAULT_ORDER) -> "RankLayout":
        """A layout from sizes alone, with the same checks as the config's ``parallel`` block."""
        try:
            parallel = ParallelConfig(tensor=tp, pipeline=pp, expert=ep, expert_tensor=etp, order=order)
        except ValidationError as err:
            raise from_validation_error(err, ParallelConfig, f"{ROOT_KEY}.parallel") from None
        return cls(ParallelSizes.resolve(parallel, world_size))

    @property
    def world_size(self) -> int:
        return self.sizes.world_size

    @cached_property
    def _order(self) -> list[str]:
        tokens = self.sizes.order.split("-")
        return [t for t in tokens if t != "cp"]

    @cached_property
    def attention_grid(self) -> Grid:
        size = {"tp": self.sizes.tp, "ep": 1, "dp": self.sizes.dp, "pp": self.sizes.pp}
        return Grid(tuple(self._order), tuple(size[t] for t in self._order))

    @cached_property
    def expert_grid(self) -> Grid:
        size = {"tp": self.sizes.etp, "ep": self.sizes.ep, "dp": self.sizes.edp, "pp": self.sizes.pp}
        return Grid(tuple(self._order), tuple(size[t] for t in self._order))

    def _grid_and_dims(self, kind: str) -> tuple[Grid, tuple[str, ...]]:
        if kind not in GROUP_KINDS:
            raise KeyError(f"unknown group kind {kind!r}; known: {', '.join(list(GROUP_KINDS) + ['embedding'])}")
        grid, dims = GROUP_KINDS[kind]
        return (self.attention_grid if grid == "attn" else self.expert_grid), dims

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of ``kind`` (see ``GROUP_KINDS``, plus ``embedding``) as fresh rank lists."""
        if kind == "embedding":
            return [[ranks[0], ranks[-1]] if len(ranks) > 1 else [ranks[0]] for ranks in self.groups("pp")]
        grid, dims = self._grid_and_dims(kind)
        return grid.groups(dims)

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The ranks of the ``kind`` group holding ``rank``, from its coordinates (embedding: ``[]`` off the
        first and last pipeline stages)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        if kind == "embedding":
            stage = self.group_of("pp", rank)
            group = [stage[0], stage[-1]] if len(stage) > 1 else [stage[0]]
            return group if rank in group else []
        grid, dims = self._grid_and_dims(kind)
        return grid.group_of(dims, rank)

    def coords(self, rank: int) -> dict[str, int]:
        """Rank coordinates in both grids: tp, dp, pp, ep, etp, edp."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        a = self.attention_grid.coords(rank)
        e = self.expert_grid.coords(rank)
        return {"tp": a["tp"], "dp": a["dp"], "pp": a["pp"], "ep": e["ep"], "etp": e["tp"], "edp": e["dp"]}

    def to_json(self) -> dict[str, list[list[int]]]:
        return {kind: self.groups(kind) for kind in PUBLIC_KINDS}

    def table(self) -> str:
        """One line per rank with its coordinates; sizes in the header."""
        s = self.sizes
        head = (f"world {s.world_size}: tp {s.tp} x dp {s.dp} x pp {s.pp} (attention), "
                f"etp {s.etp} x ep {s.ep} x edp {s.edp} x pp {s.pp} (experts), order {s.order}")
        cols = ("rank", "tp", "dp", "pp", "etp", "ep", "edp")
        lines = [head, "  ".join(f"{c:>4}" for c in cols)]
        for rank in range(self.world_size):
            c = self.coords(rank)
            lines.append("  ".join(f"{v:>4}" for v in (rank, c["tp"], c["dp"], c["pp"], c["etp"], c["ep"], c["edp"])))
        return "\n".join(lines)
