"""The MoE layer under ``torch.use_deterministic_algorithms(True)``, what a GPU run sets to be
reproducible, checked on CPU.

On CUDA a float scatter-add over repeated indices (``index_add_``; the backward of
``index_select``, of ``gather`` and of advanced indexing) adds by atomics in no fixed order.
When deterministic algorithms are asked for, torch runs those ops deterministically
(``index_add_`` and ``scatter_add_`` through a sort; ``index_put_`` with ``accumulate`` sorts
on CUDA anyway) and raises on the ops it has no deterministic CUDA kernel for (a float
``cumsum``, ``histc``, a weighted ``bincount``, ``put_``, ...). The layer's own repeated-row sum
is the experts' backward (``ffn_autograd``: a token's routes to several experts of one chunk);
the combine is a gather and deterministic everywhere.

So: every accumulating op a training step of the layer runs (single process, and the
expert-parallel exchanges on 2 ranks) must be one that mode makes deterministic, or sum integers
(exact in any order), and none may be one it refuses on CUDA. And on CPU a step under the mode
gives the same output and gradients, bit for bit (the mode also fills fresh memory with NaN:
a tensor read before it is written would show).
"""
from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dist import attempts, case_results, run_distributed
from moe_plugin.configs import MoEConfig
from moe_plugin.layers import MoELayer
from tests.unit.layers.test_layers_single import capacity_if_dropping

H, F, E = 16, 16, 8
# accumulating ops that torch.use_deterministic_algorithms(True) makes deterministic on CUDA
# (its documentation; index_put with accumulate sorts on CUDA in any mode)
DETERMINISTIC_WHEN_ASKED = {"index_add", "index_add_", "scatter_add", "scatter_add_", "index_put", "index_put_",
                            "_index_put_impl_", "index_copy", "index_copy_", "scatter", "scatter_"}
# ops that raise under the mode on CUDA (for floats where the condition says so)
REFUSED_ON_CUDA = {"cumsum", "cumsum_", "histc", "bincount", "put", "put_", "median", "nll_loss_forward",
                   "nll_loss2d_forward", "scatter_reduce", "scatter_reduce_", "_embedding_bag", "index_reduce",
                   "index_reduce_", "embedding_dense_backward"}
ROUTERS = {
    "top2": dict(router="topk", top_k=2, aux_loss_coeff=0.1, z_loss_coeff=1e-2),
    "gshard": dict(router="gshard", jitter_eps=0.1, aux_loss_coeff=0.1),
    "sigmoid": dict(router="topk", top_k=3, score_function="sigmoid", aux_loss_coeff=0.1),
    "probability": dict(router="topk", top_k=2, drop_policy="probability", capacity_factor=0.5),
}


def _where() -> str:
    for frame in reversed(traceback.extract_stack()):
        if "/moe_plugin/" in frame.filename:
            return f"{frame.filename.split('/moe_plugin/')[-1]}:{frame.lineno}"
    return "autograd"


class AccumulatingOps(TorchDispatchMode):
    """Records ``(op, dtype, where)`` of every op of the two sets above (for ``bincount`` the
    weights' dtype where it has weights)."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[str, str, str]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name in DETERMINISTIC_WHEN_ASKED | REFUSED_ON_CUDA:
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if name == "bincount":      # what it sums: the weights where given
                first = kwargs.get("weights") if kwargs else (args[1] if len(args) > 1 else None)
                first = first if first is not None else args[0]
            self.seen.add((name, str(first.dtype) if first is not None else "?", _where()))
        return func(*args, **(kwargs or {}))


def unasked(seen: set) -> list:
    """The recorded ops the mode neither makes deterministic on CUDA nor can leave alone: a
    refused op on floats (a weighted ``bincount`` counts as float; an integer ``cumsum`` is fine),
    or an accumulating op the sets do not know."""
    bad = []
    for name, dtype, where in sorted(seen):
        floating = dtype.startswith("torch.float") or dtype.startswith("torch.bfloat")
        if name in REFUSED_ON_CUDA and (floating or name not in ("cumsum", "cumsum_", "bincount")):
            bad.append((name, dtype, where))
    return bad


def _layer(router: str, drop: bool, parallel=None, groups=None, **moe) -> MoELayer:
    block = {"num_experts": E, "capacity_factor": 1.0, "min_capacity": 1, "drop_tokens": drop,
             "activation": "swiglu", **ROUTERS[router], **moe}
    if parallel is not None:
        block["parallel"] = parallel
    return MoELayer(MoEConfig.from_dict(capacity_if_dropping(block)), H, F, groups, seed=3, init_std=0.3).train()


def _step(layer: MoELayer, seed: int = 11, deterministic: bool = False) -> tuple[set, dict]:
    """One forward and backward of a new layer under the mode or not (a new layer: its router's
    noise starts alike): the accumulating ops it ran, and the output and every gradient."""
    x = torch.randn(8, 2, H, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
    grad = torch.randn(8, 2, H, generator=torch.Generator().manual_seed(7))
    before = torch.are_deterministic_algorithms_enabled()
    ops = AccumulatingOps()
    torch.use_deterministic_algorithms(deterministic)
    try:
        with ops:
            out, _ = layer(x)
            out.backward(grad)
    finally:
        torch.use_deterministic_algorithms(before)
    values = {"out": out.detach(), "x.grad": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    return ops.seen, values


def _same(a: dict, b: dict) -> list:
    return [n for n in a if (a[n] is None) != (b[n] is None) or (a[n] is not None and not torch.equal(a[n], b[n]))]


def test_the_check_sees_what_the_mode_refuses():
    """A float cumsum and a weighted bincount are flagged; integer ones and index_add_ are not."""
    ops = AccumulatingOps()
    x, i = torch.arange(4.0), torch.tensor([0, 1, 1, 3])
    with ops:
        x.cumsum(0), i.cumsum(0), torch.bincount(i), torch.bincount(i, weights=x), torch.zeros(4).index_add_(0, i, x)
    assert [name for name, *_ in unasked(ops.seen)] == ["bincount", "cumsum"]
    assert {name for name, *_ in ops.seen} == {"cumsum", "bincount", "index_add_"}


@pytest.mark.parametrize("drop", [True, False], ids=["capacity", "dropless"])
@pytest.mark.parametrize("router", list(ROUTERS))
def test_deterministic_mode_runs_the_same_step(router, drop):
    """Under the mode: only ops it makes deterministic (the experts' backward ``index_add_`` among
    them), and on CPU the same output and gradients, bit for bit."""
    _, plain = _step(_layer(router, drop, shared_expert_ffn_hidden_size=8))
    seen, asked = _step(_layer(router, drop, shared_expert_ffn_hidden_size=8), deterministic=True)   # same noise
    assert not unasked(seen), unasked(seen)
    assert ("index_add_", "torch.float32", "layers/ffn_autograd.py") in {(n, d, w.split(":")[0]) for n, d, w in seen}
    assert not _same(plain, asked), _same(plain, asked)


# -- expert parallelism on 2 gloo ranks: the exchanges' backward (index_select of repeated tokens) --------
DIST_CASES = {"dp2-ep2/counts": ("top2", 1, "counts"), "dp2-ep2/overlap2": ("top2", 2, "counts"),
              "dp2-ep2/token": ("sigmoid", 1, "token"), "dp2-ep2/padded": ("gshard", 1, "padded")}


def _dist_case(rank: int, groups, router: str, chunks: int, exchange: str) -> tuple[list, list]:
    moe = dict(overlap_chunks=chunks, exchange=exchange)
    _, plain = _step(_layer(router, True, {"expert": 2}, groups, **moe), seed=11 + rank)
    seen, asked = _step(_layer(router, True, {"expert": 2}, groups, **moe), seed=11 + rank, deterministic=True)
    return unasked(seen), _same(plain, asked)


def _dist_child(rank: int, world_size: int, cases: dict) -> dict:
    from moe_plugin.groups.builder import build_process_groups, destroy_process_groups
    from moe_plugin.groups.layout import RankLayout

    results = {}
    attempt = attempts(results, rank)
    for name, (router, chunks, exchange) in cases.items():
        groups = build_process_groups(RankLayout.build(world_size, ep=2))
        try:
            attempt(name, _dist_case, rank, groups, router, chunks, exchange)
        finally:
            destroy_process_groups(groups)
    return results


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    return run_distributed(_dist_child, 2, tmp_path_factory.mktemp("deterministic"), DIST_CASES)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DIST_CASES))
def test_deterministic_mode_expert_parallel(dist_results, name):
    for bad, differ in case_results(dist_results, name):
        assert not bad and not differ, (bad, differ)
