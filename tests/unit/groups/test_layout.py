"""The rank layout against the two libraries that will use its groups.

Megatron-Core is the oracle for every group kind: ``megatron_groups`` builds the decoder and
expert ``RankGenerator`` exactly as ``initialize_model_parallel`` does (context parallel size
1), with its two layout assertions, and the layout must produce the same rank lists, in the
same order, for every layout in ``megatron_combos()``:

* every world size 1..16, every tensor, pipeline, expert and expert-tensor size allowed by
  divisibility, and every order string: the 24 orderings of tp, ep, dp, pp and the default
  order with cp in each of its 5 places. Every choice of which dimensions are > 1, in every
  order, occurs here (all four of the expert grid at 16 = 2 x 2 x 2 x 2).
* every power-of-two world size 32..1024 with tp and etp in {1, 2, 8}, pp in {1, 4} and ep in
  {1, 8, 64}, for the five orders of ``SCALE_ORDERS``: the same code at scale (strides of
  hundreds of ranks, groups of up to 1,024).
* opt-in, ``MOE_PLUGIN_EXHAUSTIVE_LAYOUTS=1`` (minutes): every divisor choice instead of the
  menu at every power-of-two world size 32..1024. Megatron-Core's generator costs ~3 us per
  rank per group kind, ~30 ms per 1,024-rank layout, too slow for every run.

Layouts that Megatron-Core refuses must be refused by ``RankLayout.build`` too, and the other
way round. DeepSpeed's expert groups are compared where DeepSpeed accepts the sizes; see the
comment above ``DEEPSPEED_VARIANTS`` for which layouts it can express.
"""
from __future__ import annotations

import functools
import itertools
import json
import math
import os
import time
from typing import NamedTuple
from unittest import mock

import pytest

from moe_plugin.configs.errors import ConfigError
from moe_plugin.configs.schema import ParallelSizes
from moe_plugin.groups.layout import PUBLIC_KINDS, RankLayout, orthogonal_groups

mps = pytest.importorskip("megatron.core.parallel_state")
ds_groups = pytest.importorskip("deepspeed.utils.groups")

# ---------------------------------------------------------------------------------------
# Enumeration
# ---------------------------------------------------------------------------------------
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
SCALE_ORDERS = ("tp-cp-ep-dp-pp", "tp-ep-dp-pp", "tp-dp-ep-pp", "tp-pp-dp-ep", "ep-tp-dp-pp")
ALL_ORDERS = tuple(dict.fromkeys(
    ["-".join(p) for p in itertools.permutations(("tp", "ep", "dp", "pp"))]
    + ["-".join(["tp", "ep", "dp", "pp"][:i] + ["cp"] + ["tp", "ep", "dp", "pp"][i:]) for i in range(5)]))
SMALL_WORLDS = range(1, 17)
SCALE_WORLDS = tuple(2 ** k for k in range(5, 11))  # 32 .. 1024
SCALE_SIZES = {"tp": (1, 2, 8), "etp": (1, 2, 8), "pp": (1, 4), "ep": (1, 8, 64)}
# Opt-in (MOE_PLUGIN_EXHAUSTIVE_LAYOUTS=1, minutes): every divisor choice at every
# power-of-two world size up to 1,024, for the five orders of SCALE_ORDERS.
EXHAUSTIVE = os.environ.get("MOE_PLUGIN_EXHAUSTIVE_LAYOUTS") == "1"

# The sizes of megatron_combos() and of the DeepSpeed comparison; a change in the
# enumeration must show here.
EXPECTED_MEGATRON_LAYOUTS = 17_716
EXPECTED_DEEPSPEED_COMPARISONS = 61_802
EXPECTED_EXHAUSTIVE_LAYOUTS = 46_131
EXPECTED_EXHAUSTIVE_DEEPSPEED = 158_710


class Combo(NamedTuple):
    world: int
    tp: int
    pp: int
    ep: int
    etp: int
    order: str

    def build(self) -> RankLayout:
        return RankLayout.build(self.world, tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp, order=self.order)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidates(worlds, orders, menu=None) -> list[Combo]:
    """Every size choice (from ``menu`` where given) that passes the divisibility checks;
    the order rules are not applied."""
    def allowed(name, value):
        return menu is None or value in menu[name]

    out = []
    for order in orders:
        for world in worlds:
            for pp in (d for d in _divisors(world) if allowed("pp", d)):
                stage = world // pp
                for tp in (d for d in _divisors(stage) if allowed("tp", d)):
                    for ep in (d for d in _divisors(stage) if allowed("ep", d)):
                        for etp in (d for d in _divisors(stage // ep) if allowed("etp", d)):
                            out.append(Combo(world, tp, pp, ep, etp, order))
    return out


@functools.lru_cache(maxsize=None)
def layout_candidates() -> tuple[Combo, ...]:
    scale = _candidates(SCALE_WORLDS, SCALE_ORDERS, None if EXHAUSTIVE else SCALE_SIZES)
    return tuple(_candidates(SMALL_WORLDS, ALL_ORDERS) + scale)


@functools.lru_cache(maxsize=None)
def megatron_combos() -> tuple[Combo, ...]:
    """The layouts Megatron-Core accepts among ``layout_candidates()``: those compared with it."""
    return tuple(c for c in layout_candidates() if _megatron_accepts(c))


# ---------------------------------------------------------------------------------------
# Megatron-Core, as initialize_model_parallel uses it
# ---------------------------------------------------------------------------------------
class MegatronRefuses(Exception):
    pass


@functools.lru_cache(maxsize=None)
def _megatron_ranks(tp: int, ep: int, dp: int, pp: int, order: str, token: str) -> list[list[int]]:
    return mps.RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=1, order=order, rank_offset=0).get_ranks(token)


def megatron_groups(c: Combo) -> dict[str, list[list[int]]]:
    """Every group kind from Megatron-Core's generators; ``MegatronRefuses`` where
    ``initialize_model_parallel`` would raise or assert (context parallel size 1)."""
    if c.world % (c.tp * c.pp):
        raise MegatronRefuses("world_size is not divisible by tp x pp")
    dp = c.world // (c.tp * c.pp)
    if c.world % (c.etp * c.ep * c.pp):
        raise MegatronRefuses("world_size is not divisible by etp x ep x pp")
    edp = c.world // (c.etp * c.ep * c.pp)

    def attn(token):
        return _megatron_ranks(c.tp, 1, dp, c.pp, c.order, token)

    def expert(token):
        return _megatron_ranks(c.etp, c.ep, edp, c.pp, c.order, token)

    # The two assertions of initialize_model_parallel.
    if not (c.order.endswith("pp") or c.pp == 1 or edp == dp):
        raise MegatronRefuses("order must end in pp unless the expert and dense data-parallel sizes agree")
    if attn("pp") != expert("pp"):
        raise MegatronRefuses("pipeline groups differ between the dense and the expert generator")
    return {
        "tp": attn("tp"), "pp": attn("pp"), "dp": attn("dp"), "mp": attn("tp-pp"), "tp_dp": attn("tp-dp"),
        "ep": expert("ep"), "etp": expert("tp"), "edp": expert("dp"), "etp_ep": expert("tp-ep"),
        "embedding": [mps.default_embedding_ranks(ranks) for ranks in attn("pp")],
    }


def _megatron_accepts(c: Combo) -> bool:
    try:
        megatron_groups(c)
    except MegatronRefuses:
        return False
    return True


# ---------------------------------------------------------------------------------------
# Invariants that need no oracle
# ---------------------------------------------------------------------------------------
# kind -> (grid, the coordinates that vary inside one group)
KIND_DIMS = {
    "tp": ("attn", ("tp",)), "pp": ("attn", ("pp",)), "dp": ("attn", ("dp",)),
    "mp": ("attn", ("tp", "pp")), "tp_dp": ("attn", ("tp", "dp")),
    "ep": ("expert", ("ep",)), "etp": ("expert", ("etp",)), "edp": ("expert", ("edp",)),
    "etp_ep": ("expert", ("etp", "ep")),
}
GRID_DIMS = {"attn": ("tp", "dp", "pp"), "expert": ("etp", "ep", "edp", "pp")}
KINDS = tuple(KIND_DIMS) + ("embedding",)
COORDS_MAX_WORLD = 12  # check_coords on every layout up to this size, and on the 1,024-rank one


def check_structure(layout: RankLayout, groups: dict[str, list[list[int]]]) -> None:
    s, world = layout.sizes, layout.world_size
    assert s.tp * s.dp * s.pp == world
    assert s.etp * s.ep * s.edp * s.pp == world
    size = {"tp": s.tp, "dp": s.dp, "pp": s.pp, "etp": s.etp, "ep": s.ep, "edp": s.edp}
    everyone = list(range(world))
    for kind, (_, dims) in KIND_DIMS.items():
        group_size = math.prod(size[d] for d in dims)
        assert all(len(g) == group_size for g in groups[kind]), kind
        assert sorted(itertools.chain.from_iterable(groups[kind])) == everyone, f"{kind} is no partition"
    assert [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in groups["pp"]] == groups["embedding"]


def check_coords(layout: RankLayout, groups: dict[str, list[list[int]]]) -> None:
    """Ranks that agree on every coordinate outside a kind form its groups, and a rank's
    coordinate along a one-dimension kind is its index in that group."""
    coords = [layout.coords(r) for r in range(layout.world_size)]
    for kind, (grid, dims) in KIND_DIMS.items():
        fixed = [d for d in GRID_DIMS[grid] if d not in dims]
        by_key: dict[tuple, list[int]] = {}
        for rank, c in enumerate(coords):
            by_key.setdefault(tuple(c[d] for d in fixed), []).append(rank)
        assert sorted(by_key.values()) == sorted(groups[kind]), kind
        if len(dims) == 1:
            for group in groups[kind]:
                assert [coords[r][dims[0]] for r in group] == list(range(len(group))), kind


def layout_groups(layout: RankLayout) -> dict[str, list[list[int]]]:
    return {kind: layout.groups(kind) for kind in KINDS}


# ---------------------------------------------------------------------------------------
# Megatron-Core comparisons
# ---------------------------------------------------------------------------------------
def test_enumeration_size():
    combos = megatron_combos()
    refused = len(layout_candidates()) - len(combos)
    print(f"\n{len(combos)} layouts compared with megatron-core ({refused} candidates refused by both)")
    assert len(combos) == (EXPECTED_EXHAUSTIVE_LAYOUTS if EXHAUSTIVE else EXPECTED_MEGATRON_LAYOUTS)
    assert max(c.world for c in combos) == 1024
    assert set(c.order for c in combos) == set(ALL_ORDERS)


def _we_accept(c) -> bool:
    try:
        c.build()
    except ConfigError:
        return False
    return True


def test_refused_exactly_where_megatron_refuses():
    for c in layout_candidates():
        assert _we_accept(c) == _megatron_accepts(c), c


def test_refused_sizes_outside_divisors():
    # Sizes that do not divide: both refuse, never a layout with a fractional dimension.
    for world in range(1, 13):
        for tp, pp, ep, etp in itertools.product(range(1, 7), repeat=4):
            c = Combo(world, tp, pp, ep, etp, DEFAULT_ORDER)
            assert _we_accept(c) == _megatron_accepts(c), c


def test_groups_equal_megatron():
    for c in megatron_combos():
        layout = c.build()
        ours = layout_groups(layout)
        theirs = megatron_groups(c)
        for kind, ranks in theirs.items():
            assert ours[kind] == ranks, (c, kind)
        check_structure(layout, ours)
        if c.world <= COORDS_MAX_WORLD:
            check_coords(layout, ours)


def test_group_of_matches_groups():
    for c in megatron_combos():
        if c.world > 8:
            continue
        layout = c.build()
        for kind in KINDS:
            for group in layout.groups(kind):
                for rank in group:
                    assert layout.group_of(kind, rank) == group, (c, kind, rank)
        for rank in set(range(c.world)) - set(itertools.chain.from_iterable(layout.groups("embedding"))):
            assert layout.group_of("embedding", rank) == [], (c, rank)  # a middle pipeline stage


def test_group_of_edges():
    layout = RankLayout.build(12, pp=3)
    assert layout.group_of("embedding", 0) == [0, 8] and layout.group_of("embedding", 9) == [1, 9]
    assert layout.group_of("embedding", 5) == []  # the middle stage has no embedding
    with pytest.raises(ValueError, match="rank -1 is outside the world of 12 ranks"):
        layout.group_of("tp", -1)
    with pytest.raises(KeyError, match="unknown group kind 'xp'"):
        layout.group_of("xp", 0)


def test_pipeline_stages_must_agree_between_grids():
    # Megatron-Core asserts this; the order rule alone lets it through (EDP == DP here).
    c = Combo(8, tp=2, pp=2, ep=2, etp=1, order="tp-pp-dp-ep")
    with pytest.raises(MegatronRefuses, match="pipeline groups differ"):
        megatron_groups(c)
    with pytest.raises(ConfigError, match=r"moe\.parallel\.order: .*stages 2 ranks apart.* 1 apart"):
        c.build()
    # The layout checks it too, for sizes that did not come through the config.
    sizes = ParallelSizes(world_size=8, tp=2, pp=2, dp=2, ep=2, etp=1, edp=2, order="tp-pp-dp-ep")
    with pytest.raises(ConfigError, match=r"moe\.parallel\.order: .*stages 2 ranks apart.* 1 apart"):
        RankLayout(sizes)
    # Same sizes with pp last are fine.
    assert c._replace(order="tp-dp-ep-pp").build().groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


# ---------------------------------------------------------------------------------------
# DeepSpeed's expert groups
# ---------------------------------------------------------------------------------------
# DeepSpeed (deepspeed/utils/groups.py) lays out its expert groups in fixed patterns, pipeline
# stages outermost (stage = world / pp consecutive ranks, pp from the mpu):
#
#   expert TP on: MoE(enable_expert_tensor_parallelism=True) with an mpu calls
#     _create_expert_data_and_model_parallel -> _get_expert_parallel_ranks. Allowed when
#     tp x pp | world and ep | dp. Experts are split over the TP group (etp = tp), so EP is
#     carved out of DP only.
#       E+D (default):                      EP stride tp,         EDP stride tp*ep
#       D+E (use_data_before_expert_parallel_): EDP stride tp,    EP stride tp*(dp/ep)
#   expert TP off (MoE's default, or no mpu): _create_expert_and_data_parallel. Allowed when
#     ep | world/pp; TP is ignored: experts are whole on every rank (etp = 1) and EP may span
#     TP ranks.
#       E+D:                                EP stride 1,          EDP stride ep
#       D+E:                                EDP stride 1,         EP stride stage/ep
#
# A group kind of a mixed-radix grid is fixed by its size and its stride, so DeepSpeed's groups
# equal ours exactly when etp, and the stride of EP and of EDP (where > 1), agree. With the
# order tp-cp-ep-dp-pp that is: etp == tp (expert TP on, E+D) or etp == 1 (expert TP off, E+D);
# tp-dp-ep-pp gives the D+E forms. EP folded over TP ranks with 1 < etp < tp, or with
# etp == tp and ep not dividing dp, DeepSpeed cannot express: it refuses or its groups differ.
DEEPSPEED_VARIANTS = (("expert_tp", False), ("expert_tp", True), ("no_expert_tp", False), ("no_expert_tp", True))


def deepspeed_model(variant: str, data_before: bool, c: Combo) -> tuple[int, int, int]:
    """(etp, EP stride, EDP stride) of DeepSpeed's groups for these sizes (see above)."""
    stage = c.world // c.pp
    if variant == "expert_tp":
        dp = stage // c.tp
        return (c.tp, c.tp * (dp // c.ep), c.tp) if data_before else (c.tp, c.tp, c.tp * c.ep)
    return (1, stage // c.ep, 1) if data_before else (1, 1, c.ep)


def our_strides(layout: RankLayout) -> tuple[int, int, int]:
    # Computed here from the order string, independently of the layout's grids.
    s = layout.sizes
    size = {"tp": s.etp, "cp": 1, "ep": s.ep, "dp": s.edp, "pp": s.pp}
    tokens = s.order.split("-")
    stride = {t: math.prod(size[u] for u in tokens[:i]) for i, t in enumerate(tokens)}
    return s.etp, stride["ep"], stride["dp"]


def deepspeed_expresses(variant: str, data_before: bool, c: Combo, layout: RankLayout) -> bool:
    etp, ep_stride, edp_stride = deepspeed_model(variant, data_before, c)
    ours = our_strides(layout)
    s = layout.sizes
    return (etp == ours[0] and (s.ep == 1 or ep_stride == ours[1]) and (s.edp == 1 or edp_stride == ours[2]))


class _RecordingDist:
    """Stands in for deepspeed.comm in deepspeed.utils.groups: records every new_group."""

    def __init__(self, world: int, rank: int):
        self.world, self.rank, self.created = world, rank, []

    def is_initialized(self):
        return True

    def get_world_size(self, group=None):
        return self.world

    def get_rank(self, group=None):
        return self.rank

    def new_group(self, ranks):
        self.created.append(list(ranks))
        return ("group", len(self.created) - 1)


class _Mpu:
    def __init__(self, tp: int, pp: int, dp: int):
        self.tp, self.pp, self.dp = tp, pp, dp

    def get_tensor_model_parallel_world_size(self):
        return self.tp

    def get_pipeline_model_parallel_world_size(self):
        return self.pp

    def get_data_parallel_world_size(self):
        return self.dp


@functools.lru_cache(maxsize=4096)
def deepspeed_expert_groups(variant: str, data_before: bool, world: int, tp: int, pp: int, ep: int):
    """(EP groups, EDP groups) from DeepSpeed's real functions on a recording fake of
    deepspeed.comm, for the last rank; ``None`` where DeepSpeed refuses the sizes."""
    fake = _RecordingDist(world, rank=world - 1)
    mpu = _Mpu(tp, pp, world // (tp * pp))
    with mock.patch.multiple(ds_groups, dist=fake, log_dist=lambda *a, **k: None, mpu=mpu, mesh_device=None,
                             expert_tensor_parallel_world_size=1, _EXPERT_PARALLEL_GROUP={},
                             _EXPERT_PARALLEL_GROUP_RANKS={}, _EXPERT_DATA_PARALLEL_GROUP={},
                             _EXPERT_DATA_PARALLEL_GROUP_RANKS={}):
        try:
            if variant == "expert_tp":
                ds_groups._create_expert_data_and_model_parallel(ep, mpu=mpu,
                                                                 use_data_before_expert_parallel_=data_before)
            else:
                ds_groups._create_expert_and_data_parallel(ep, use_data_before_expert_parallel_=data_before)
        except AssertionError:  # DeepSpeed's _ensure_divisibility
            return None
        name = f"ep_size_{ep}"
        mine = list(ds_groups._EXPERT_PARALLEL_GROUP_RANKS[name]), list(ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name])
    # expert TP on creates the EP groups first, expert TP off the EDP groups (pp x ep of them).
    if variant == "expert_tp":
        ep_groups, edp_groups = fake.created[:world // ep], fake.created[world // ep:]
    else:
        edp_groups, ep_groups = fake.created[:pp * ep], fake.created[pp * ep:]
    assert mine == ([g for g in ep_groups if world - 1 in g][0], [g for g in edp_groups if world - 1 in g][0])
    return ep_groups, edp_groups


def _canonical(groups):
    return sorted(map(tuple, groups))


@functools.lru_cache(maxsize=None)
def deepspeed_comparisons() -> dict[tuple[str, bool], dict[str, int]]:
    """Per DeepSpeed variant: layouts compared (DeepSpeed accepts the sizes), equal, different.

    Runs every comparison: the equal/different split must follow ``deepspeed_expresses``, and
    sizes DeepSpeed cannot express with expert TP on (ep not dividing dp) must be refused."""
    counts = {v: {"compared": 0, "equal": 0, "different": 0, "refused": 0} for v in DEEPSPEED_VARIANTS}
    for c in megatron_combos():
        layout = c.build()
        ours = _canonical(layout.groups("ep")), _canonical(layout.groups("edp"))
        for variant, data_before in DEEPSPEED_VARIANTS:
            result = deepspeed_expert_groups(variant, data_before, c.world, c.tp, c.pp, c.ep)
            n = counts[(variant, data_before)]
            if result is None:
                n["refused"] += 1
                if variant == "expert_tp":
                    assert (c.world // c.pp // c.tp) % c.ep, c
                else:
                    raise AssertionError(f"DeepSpeed without expert TP refused {c}")
                continue
            if variant == "expert_tp" and (c.world // c.pp // c.tp) % c.ep:
                raise AssertionError(f"DeepSpeed with expert TP accepted ep not dividing dp: {c}")
            n["compared"] += 1
            equal = (_canonical(result[0]), _canonical(result[1])) == ours
            assert equal == deepspeed_expresses(variant, data_before, c, layout), (variant, data_before, c)
            n["equal" if equal else "different"] += 1
    return counts


def test_deepspeed_expert_groups():
    counts = deepspeed_comparisons()
    total = sum(n["compared"] for n in counts.values())
    print(f"\n{total} (layout, DeepSpeed variant) pairs compared with DeepSpeed:")
    for (variant, data_before), n in counts.items():
        print(f"  {variant:13s} {'D+E' if data_before else 'E+D'}: {n}")
    assert total == (EXPECTED_EXHAUSTIVE_DEEPSPEED if EXHAUSTIVE else EXPECTED_DEEPSPEED_COMPARISONS)
    for n in counts.values():
        assert n["equal"] > 100 and n["different"] > 100
    assert counts[("expert_tp", False)]["refused"] > 0


@pytest.mark.parametrize("world,tp,pp,ep,etp,order,variant,data_before", [
    (16, 2, 2, 2, 2, "tp-cp-ep-dp-pp", "expert_tp", False),    # EP within DP, experts TP-split
    (16, 2, 2, 2, 2, "tp-dp-ep-pp", "expert_tp", True),
    (16, 2, 2, 4, 1, "tp-cp-ep-dp-pp", "no_expert_tp", False),  # EP across the TP pair
    (16, 2, 1, 4, 1, "tp-dp-ep-pp", "no_expert_tp", True),
])
def test_deepspeed_equal_examples(world, tp, pp, ep, etp, order, variant, data_before):
    layout = RankLayout.build(world, tp=tp, pp=pp, ep=ep, etp=etp, order=order)
    ep_groups, edp_groups = deepspeed_expert_groups(variant, data_before, world, tp, pp, ep)
    assert _canonical(ep_groups) == _canonical(layout.groups("ep"))
    assert _canonical(edp_groups) == _canonical(layout.groups("edp"))


def test_deepspeed_cannot_fold_ep_over_tp_with_expert_tp():
    # 8 ranks, tp 4, etp 2, ep 4: EP spans TP ranks and experts are split in two.
    layout = RankLayout.build(8, tp=4, ep=4, etp=2)
    assert layout.groups("ep") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert deepspeed_expert_groups("expert_tp", False, 8, 4, 1, 4) is None      # ep 4 does not divide dp 2
    ep_groups, _ = deepspeed_expert_groups("no_expert_tp", False, 8, 4, 1, 4)  # accepted, but etp = 1
    assert _canonical(ep_groups) == [(0, 1, 2, 3), (4, 5, 6, 7)] != _canonical(layout.groups("ep"))


# ---------------------------------------------------------------------------------------
# Unit tests
# ---------------------------------------------------------------------------------------
def test_orthogonal_groups_tp2_pp2_dp2():
    sizes = [2, 2, 2]  # order tp-pp-dp, tp fastest
    assert orthogonal_groups(sizes, [True, False, False]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert orthogonal_groups(sizes, [False, True, False]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert orthogonal_groups(sizes, [False, False, True]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert orthogonal_groups(sizes, [True, False, True]) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert orthogonal_groups(sizes, [True, True, True]) == [list(range(8))]
    assert orthogonal_groups(sizes, [False, False, False]) == [[r] for r in range(8)]


def test_orthogonal_groups_uneven_sizes():
    # Megatron-Core's docstring example: [tp, dp, pp] = [2, 3, 4], the dp groups.
    dp = orthogonal_groups([2, 3, 4], [False, True, False])
    assert len(dp) == 8 and dp[0] == [0, 2, 4] and dp[1] == [1, 3, 5] and dp[7] == [19, 21, 23]
    assert orthogonal_groups([3, 2], [True, False]) == [[0, 1, 2], [3, 4, 5]]
    assert orthogonal_groups([3, 2], [False, True]) == [[0, 3], [1, 4], [2, 5]]
    # Groups ordered by the fixed coordinates, fastest first: (tp, pp) = (0,0), (1,0), (0,1) ...
    assert orthogonal_groups([2, 3, 2], [False, True, False])[:3] == [[0, 2, 4], [1, 3, 5], [6, 8, 10]]
    assert orthogonal_groups([], []) == [[0]]


def test_coords_with_ep_folded_over_tp():
    # 8 ranks, tp 2, ep 4, etp 1: dp 4, edp 2; EP spans both ranks of a TP pair.
    layout = RankLayout.build(8, tp=2, ep=4, etp=1)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coords(5) == {"tp": 1, "dp": 2, "pp": 0, "ep": 1, "etp": 0, "edp": 1}
    assert layout.group_of("ep", 5) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="rank 8 is outside the world of 8 ranks"):
        layout.coords(8)
    with pytest.raises(KeyError, match="unknown group kind 'xp'"):
        layout.groups("xp")


def test_coords_with_pipeline():
    layout = RankLayout.build(8, tp=2, pp=2, ep=2)  # stage of 4: tp 2 x dp 2; etp 2 x ep 2 x edp 1
    assert layout.coords(5) == {"tp": 1, "dp": 0, "pp": 1, "ep": 0, "etp": 1, "edp": 0}
    assert layout.coords(6) == {"tp": 0, "dp": 1, "pp": 1, "ep": 1, "etp": 0, "edp": 0}
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("embedding") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("mp") == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_table():
    layout = RankLayout.build(8, tp=2, pp=2, ep=2)
    lines = layout.table().splitlines()
    assert lines[0] == ("world 8: tp 2 x dp 2 x pp 2 (attention), etp 2 x ep 2 x edp 1 x pp 2 (experts), "
                        "order tp-cp-ep-dp-pp")
    assert lines[1].split() == ["rank", "tp", "dp", "pp", "etp", "ep", "edp"]
    assert len(lines) == 2 + 8
    for rank, line in enumerate(lines[2:]):
        c = layout.coords(rank)
        assert [int(v) for v in line.split()] == [rank, c["tp"], c["dp"], c["pp"], c["etp"], c["ep"], c["edp"]]


def test_to_json():
    layout = RankLayout.build(16, tp=2, pp=2, ep=4, etp=1)
    out = layout.to_json()
    assert tuple(out) == PUBLIC_KINDS
    assert json.loads(json.dumps(out)) == out
    for kind in PUBLIC_KINDS:
        assert out[kind] == layout.groups(kind)
    assert out["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def test_groups_are_copies():
    layout = RankLayout.build(4, tp=2)
    layout.groups("tp")[0].append(99)
    assert layout.groups("tp") == [[0, 1], [2, 3]]


def test_1024_ranks_every_kind_fast():
    start = time.perf_counter()
    c = Combo(1024, tp=8, pp=4, ep=32, etp=2, order=DEFAULT_ORDER)  # EP 32 over TP 8 x DP 32
    layout = c.build()
    ours = layout_groups(layout)
    check_structure(layout, ours)
    check_coords(layout, ours)
    assert len(layout.table().splitlines()) == 1026
    assert sum(len(g) for g in layout.to_json()["ep"]) == 1024
    for rank in range(0, 1024, 7):
        for kind in KIND_DIMS:
            group = layout.group_of(kind, rank)
            assert rank in group and group in ours[kind], (kind, rank)
    elapsed = time.perf_counter() - start
    assert ours == megatron_groups(c)
    assert layout.sizes.edp == 4 and len(ours["ep"]) == 32 and ours["ep"][0][:3] == [0, 2, 4]
    assert elapsed < 5.0, f"a 1,024-rank layout took {elapsed:.2f} s"
