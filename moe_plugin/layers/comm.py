"""Autograd-aware collectives of the MoE layer, each an autograd function whose backward is another
collective. ``group=None`` means a group of size 1: the identity, so one process runs the same code.
Splits are lists of ints: every collective moves exactly the routed rows, never padding.

Shape suffixes: see ``moe_plugin.layers``.
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
    """``send_counts[j, ...]`` (first dimension: the group size) go to rank j; returns what rank j sent."""
    if group is None:
        return send_counts.clone()
    recv = torch.empty_like(send_counts)
    with record_function("moe.all_to_all"):    # the profiler scope covers the wait (``bench step --parts``)
        dist.all_to_all_single(recv, send_counts.contiguous(), group=group)
    return recv


def gather_counts(counts: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's ``counts`` stacked in rank order, [ranks, ...]: an all-gather moved as one all-to-all
    (one round, where gloo's all-gather takes ``ranks - 1`` dependent steps)."""
    n = group_size(group)
    every = exchange_counts(counts.reshape(1, -1).expand(n, -1), group)   # my counts to every peer
    return every.view((n,) + tuple(counts.shape))


class _Mirrored(torch.autograd.Function):
    """A collective whose backward is another: forward ``there(x, *args)``, backward ``back(grad, *args)``."""

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
    """An all-to-all in flight: its handle, the gradient its reverse exchange fills in backward."""

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
    """Uneven all-to-all of rows: ``in_splits[j]`` rows to rank j, ``out_splits[j]`` from it; backward reversed."""
    return _mirrored(x, _all_to_all, _reverse, list(out_splits), list(in_splits), group)


def start_all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> tuple:
    """``all_to_all`` started asynchronously, for ``wait_all_to_all``; backward starts the reverse
    exchange in the wait's backward and waits for it in the start's."""
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
    """The rows of every rank of ``group`` (``counts[j]`` from rank j); backward sums and keeps one's own."""
    return _mirrored(x, _gather_rows, _reduce_scatter_rows, list(counts), group)


def reduce_scatter_rows(x: torch.Tensor, counts: Sequence[int], group: Group) -> torch.Tensor:
    """Sum ``x`` over ``group``, keep this rank's block of ``counts[rank]`` rows (backward: ``gather_rows``)."""
    return _mirrored(x, _reduce_scatter_rows, _gather_rows, list(counts), group)


def split_tokens(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's share of tokens replicated over ``group``; backward all-gathers the shares."""
    if x.shape[0] % group_size(group):
        raise ValueError(f"{x.shape[0]} tokens cannot be split evenly over {group_size(group)} tensor-parallel ranks")
    return _mirrored(x, _own_share, _all_gather_equal, group)


def gather_tokens(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Inverse of ``split_tokens``: the shares all-gathered; backward keeps this rank's share."""
    return _mirrored(x, _all_gather_equal, _own_share, group)


def all_reduce_grad(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; the gradient summed over ``group`` (a weight used by ranks with other tokens)."""
    return _mirrored(x, _same, _summed, group)
