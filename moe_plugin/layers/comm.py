"""Autograd-aware collectives of the MoE layer.

Shape suffixes: see ``moe_plugin.layers``.

Every function takes ``group=None`` to mean "a group of size 1" and then is the identity,
so the single-process path and a size-1 dimension run the same code. Splits are Python
lists of ints: the counts are exchanged first (``exchange_counts``) and then every
collective moves exactly the routed rows, never padding.

bf16 and fp16 rows go over the wire as they are: gloo's all_to_all, all_gather and all_reduce
accept them in torch 2.13 (``tests/test_layers_dist.py`` runs bf16 MoE layers over gloo).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

Group = Optional[dist.ProcessGroup]


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def exchange_counts(send_counts: torch.Tensor, group: Group) -> torch.Tensor:
    """``send_counts[j, ...]`` rows go to rank j; returns ``recv[j, ...]`` rows that come from rank j.

    ``send_counts`` is an integer tensor whose first dimension is the group size (for
    example [ranks, local experts]); one all-to-all of that small tensor.
    """
    if group is None:
        return send_counts.clone()
    recv = torch.empty_like(send_counts)
    with record_function("moe.all_to_all"):    # the profiler scope covers the wait (``bench step --parts``)
        dist.all_to_all_single(recv, send_counts.contiguous(), group=group)
    return recv


def gather_counts(counts: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's ``counts`` (same shape everywhere) stacked in rank order: [ranks, ...]. An
    all-gather, moved as one all-to-all of the small tensor repeated once per peer: every pair of
    ranks exchanges directly in one round, where gloo's all-gather passes the blocks around a
    ring in ``ranks - 1`` dependent steps (each a wake-up of the next process when ranks share
    cores)."""
    n = group_size(group)
    every = exchange_counts(counts.reshape(1, -1).expand(n, -1), group)   # my counts to every peer
    return every.view((n,) + tuple(counts.shape))


class _Mirrored(torch.autograd.Function):
    """A collective whose backward is another: forward ``there(x, *args)``, backward
    ``back(grad, *args)``. Every autograd-aware collective here is such a pair."""

    @staticmethod
    def forward(ctx, x, there, back, *args):
        ctx.back, ctx.args = back, args
        return there(x, *args)

    @staticmethod
    def backward(ctx, grad):
        return (ctx.back(grad, *ctx.args), None, None) + (None,) * len(ctx.args)


def _mirrored(x: torch.Tensor, there, back, *args) -> torch.Tensor:
    """``_Mirrored`` on ``x``; ``x`` itself where the group (the last argument) is None."""
    return x if args[-1] is None else _Mirrored.apply(x, there, back, *args)


def _all_to_all(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group,
                pending: Optional["Pending"] = None) -> torch.Tensor:
    """The exchange itself; with ``pending`` started asynchronously (its handle kept there)."""
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    if pending is not None:
        pending.handle = dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group,
                                                async_op=True)
        return out
    with record_function("moe.all_to_all"):
        dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
    return out


def _reverse(grad: torch.Tensor, out_splits, in_splits, group, pending: Optional["Pending"] = None) -> torch.Tensor:
    """The exchange back (started, with ``pending``)."""
    return _all_to_all(grad, in_splits, out_splits, group, pending)


class Pending:
    """An all-to-all in flight (``start_all_to_all``): its handle, the gradient buffer its reverse
    exchange fills in backward, and the halves of the two ``_Mirrored`` pairs that use them."""

    handle: Optional[dist.Work] = None
    grad: Optional[torch.Tensor] = None

    def arrived(self, out: torch.Tensor, *_) -> torch.Tensor:
        """The wait's forward: the started exchange's output, once filled."""
        self.handle.wait()
        return out.view_as(out)

    def start_back(self, grad: torch.Tensor, out_splits, in_splits, group, _) -> torch.Tensor:
        """The wait's backward: start the reverse exchange of ``grad``; pass it on as a token."""
        self.grad = _reverse(grad, out_splits, in_splits, group, self)
        return grad

    def back_arrived(self, _grad: torch.Tensor, *_) -> torch.Tensor:
        """The start's backward: the reverse exchange's result, once it arrived."""
        self.handle.wait()
        grad, self.grad = self.grad, None
        return grad


def all_to_all(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group: Group) -> torch.Tensor:
    """Uneven all-to-all of rows: ``in_splits[j]`` rows of ``x`` go to rank j, ``out_splits[j]``
    rows arrive from rank j. Backward runs the reverse exchange."""
    return _mirrored(x, _all_to_all, _reverse, list(out_splits), list(in_splits), group)


def start_all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> tuple:
    """``all_to_all`` started asynchronously, with the same autograd: what ``wait_all_to_all`` takes
    (the output, not yet filled, and the exchange). Backward: the reverse exchange starts in the
    wait's backward and is waited for in the start's (``overlap.py``)."""
    pending = Pending()
    args = (out_splits, in_splits, group, pending)
    return _Mirrored.apply(x, _all_to_all, pending.back_arrived, *args), args


def wait_all_to_all(started: tuple) -> torch.Tensor:
    """The output of ``start_all_to_all``, once it arrived."""
    out, args = started
    pending = args[-1]
    return _Mirrored.apply(out, pending.arrived, pending.start_back, *args)


def _gather_rows(x: torch.Tensor, counts: Sequence[int], group) -> torch.Tensor:
    n = group_size(group)
    return _all_to_all(x.repeat((n,) + (1,) * (x.dim() - 1)), counts, [x.shape[0]] * n, group)


def _reduce_scatter_rows(x: torch.Tensor, counts: Sequence[int], group) -> torch.Tensor:
    n, me = group_size(group), group_rank(group)
    received = _all_to_all(x, [counts[me]] * n, counts, group)
    return received.view((n, counts[me]) + tuple(x.shape[1:])).sum(0)


def _own_share(x: torch.Tensor, group) -> torch.Tensor:
    return x.chunk(group_size(group))[group_rank(group)].contiguous()


def _all_gather_equal(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def _same(x: torch.Tensor, group) -> torch.Tensor:
    return x.view_as(x)


def _summed(grad: torch.Tensor, group) -> torch.Tensor:
    grad = grad.contiguous()
    dist.all_reduce(grad, group=group)
    return grad


def gather_rows(x: torch.Tensor, counts: Sequence[int], group: Group) -> torch.Tensor:
    """Concatenate the rows of every rank of ``group`` (``counts[j]`` rows from rank j). Backward:
    the gradients of all ranks summed, each rank keeps its own rows."""
    return _mirrored(x, _gather_rows, _reduce_scatter_rows, list(counts), group)


def reduce_scatter_rows(x: torch.Tensor, counts: Sequence[int], group: Group) -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's block of ``counts[rank]`` rows (backward:
    ``gather_rows``)."""
    return _mirrored(x, _reduce_scatter_rows, _gather_rows, list(counts), group)


def split_tokens(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's share of tokens replicated over ``group`` (TP without sequence parallelism).
    Backward all-gathers the shares, so the input gradient is whole (and replicated) again."""
    if x.shape[0] % group_size(group):
        raise ValueError(f"{x.shape[0]} tokens cannot be split evenly over {group_size(group)} tensor-parallel ranks")
    return _mirrored(x, _own_share, _all_gather_equal, group)


def gather_tokens(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Inverse of ``split_tokens``: the shares all-gathered; backward keeps this rank's share (the
    gradient of a replicated activation is itself replicated)."""
    return _mirrored(x, _all_gather_equal, _own_share, group)


def all_reduce_grad(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; the gradient is summed over ``group``. For a weight replicated over
    ranks that each see different tokens, so that its gradient is whole on every rank."""
    return _mirrored(x, _same, _summed, group)
