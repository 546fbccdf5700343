"""The grouped expert FFN as one autograd function that keeps no [rows, ffn] tensor for backward::

    y_RH[r] = act(rows_RH[r] @ w1[l(r)] (+ b1[l(r)])) @ w2[l(r)] (+ b2[l(r)])      rows_RH = x_NH[gather_R] (or x_NH)

Backward gathers the rows again and recomputes the rest, chunk by chunk of whole experts.
Shape suffixes: see ``moe_plugin.layers``; why and how: docs/design/layers_experts.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Optional

import torch
from torch import Tensor

from moe_plugin.layers.expert_backend import GROUPED_MM

CHUNK_BYTES = 4 << 20
REUSE_MIN_BYTES = 32 << 20   # glibc's largest mmap threshold: bigger blocks are always fresh pages


class GradStore:
    """The storage of one large weight gradient on CPU, handed out again while nobody else holds it
    (no fresh pages per backward; a gradient still held is never written to)."""

    def __init__(self) -> None:
        self._buf: Optional[Tensor] = None

    def empty_like(self, w: Tensor) -> Tensor:
        if w.device.type != "cpu" or w.nbytes < REUSE_MIN_BYTES or not hasattr(torch._C, "_storage_Use_Count"):
            return torch.empty_like(w)
        buf = self._buf   # held elsewhere: a use count above 2 (``buf`` and the storage object made here)
        if buf is None or buf.shape != w.shape or buf.dtype != w.dtype or (
                torch._C._storage_Use_Count(buf.untyped_storage()._cdata) > 2):
            buf = self._buf = torch.empty_like(w, memory_format=torch.contiguous_format)
        return buf.view(buf.shape)

    def release(self) -> None:
        """Drop the buffer (the gradient handed out last, if still held, stays valid)."""
        self._buf = None


@dataclass(frozen=True)
class RowCounts:
    """Rows per local expert, on the host (read in the layer's one host sync) and on the device
    (the chunks' row offsets are cut from it: no host-to-device copy)."""

    host: list[int]
    device_L: Tensor

    def __getitem__(self, experts: slice) -> "RowCounts":
        return RowCounts(self.host[experts], self.device_L[experts])


@dataclass(frozen=True)
class Chunk:
    """Experts ``[l0, l1)`` and their rows ``[r0, r1)``; ``offs`` the int32 row offsets within."""

    l0: int
    l1: int
    r0: int
    r1: int
    counts: list[int]
    offs: Tensor


def row_ends(counts: list[int], device: torch.device, counts_L: Optional[Tensor] = None) -> Tensor:
    """[L] int32: where each expert's rows end, on ``device`` (from ``counts_L``: no copy)."""
    if counts_L is not None and counts_L.device == device:
        return counts_L.cumsum(0, dtype=torch.int32)
    ends_L = torch.tensor(list(accumulate(counts)), dtype=torch.int32)
    return ends_L if device.type == "cpu" else ends_L.pin_memory().to(device, non_blocking=True)


def expert_chunks(counts: list[int], row_bytes: int, chunk_bytes: int = CHUNK_BYTES,
                  device: torch.device = torch.device("cpu"), counts_L: Optional[Tensor] = None) -> list[Chunk]:
    """Consecutive experts grouped until their rows reach ``chunk_bytes`` (an expert with more alone)."""
    chunks, l0, r0, rows = [], 0, 0, 0
    ends_L = row_ends(counts, device, counts_L) if counts else None
    for l, n in enumerate(counts):
        rows += n
        if rows * row_bytes >= chunk_bytes or l == len(counts) - 1:
            chunks.append(Chunk(l0, l + 1, r0, r0 + rows, counts[l0:l + 1], ends_L[l0:l + 1] - r0))
            l0, r0, rows = l + 1, r0 + rows, 0
    return chunks


def _rows_at_weights(a_RX: Tensor, w_LXY: Tensor, chunk: Chunk, backend: str) -> Tensor:
    """``a_r @ w[l(r)]`` for the chunk's rows grouped by expert -> [R, Y]."""
    if backend == "grouped_mm":
        return GROUPED_MM(a_RX, w_LXY, offs=chunk.offs)
    if backend == "bmm":
        slot_R, pad = _pad_slots(chunk)
        y_LCY = torch.bmm(_padded(a_RX, slot_R, len(chunk.counts), pad), w_LXY)
        return y_LCY.flatten(0, 1).index_select(0, slot_R)
    parts = [a @ w for a, w in zip(a_RX.split(chunk.counts), w_LXY.unbind(0))]
    return torch.cat(parts) if parts else a_RX.new_zeros(0, w_LXY.shape[-1])


def _weight_grad_into(out_LXY: Tensor, a_RX: Tensor, g_RY: Tensor, chunk: Chunk, scale: float, backend: str) -> None:
    """``out[l] = scale * a_l^T @ g_l`` over each expert's rows, written in place (zero for no rows)."""
    if backend == "bmm":
        slot_R, pad = _pad_slots(chunk)
        L = len(chunk.counts)
        torch.bmm(_padded(a_RX, slot_R, L, pad).transpose(1, 2), _padded(g_RY, slot_R, L, pad), out=out_LXY)
        if scale != 1.0:
            out_LXY.mul_(scale)
        return
    for out_XY, a, g, n in zip(out_LXY.unbind(0), a_RX.split(chunk.counts), g_RY.split(chunk.counts), chunk.counts):
        if n:
            torch.mm(a.t(), g, out=out_XY)
            if scale != 1.0:
                out_XY.mul_(scale)
        else:
            out_XY.zero_()


def _pad_slots(chunk: Chunk) -> tuple[Tensor, int]:
    """(each row's place in an [L, C, X] buffer padded to C, the largest count; C). No host sync."""
    pad = max(chunk.counts)
    offs_L = chunk.offs.long()
    counts_L = torch.diff(offs_L, prepend=offs_L.new_zeros(1))
    shift_L = torch.arange(len(chunk.counts), device=offs_L.device) * pad - (offs_L - counts_L)
    rows = chunk.r1 - chunk.r0
    return torch.arange(rows, device=offs_L.device) + shift_L.repeat_interleave(counts_L, output_size=rows), pad


def _padded(a_RX: Tensor, slot_R: Tensor, experts: int, pad: int) -> Tensor:
    """The rows in an [L, C, X] buffer, zeros after each expert's rows."""
    return a_RX.new_zeros(experts * pad, a_RX.shape[-1]).index_copy_(0, slot_R, a_RX).view(experts, pad, -1)


class ExpertFFN(torch.autograd.Function):
    """The grouped FFN of the module docstring (inputs: ``expert_ffn``'s); output ``y_RH``."""

    @staticmethod
    def forward(ctx, x_NH, w1_LHF1, w2_LFH, gather_R, chunks, act, backend, save_pre, grad_scale, grad_stores,
                b1_LF1, b2_LH, add_b2):
        R = chunks[-1].r1 if chunks else 0
        y_RH = x_NH.new_empty(R, w2_LFH.shape[-1])
        pre_chunks = []
        for c in chunks:
            if c.r1 == c.r0:
                pre_chunks.append(None)
                continue
            rows_RH = _rows(x_NH, gather_R, c)
            expert_R = _expert_of_rows(c) if b1_LF1 is not None or b2_LH is not None else None
            pre_RF1 = _pre_activation(rows_RH, w1_LHF1, b1_LF1, c, backend, expert_R)
            del rows_RH
            y_RH[c.r0:c.r1] = _rows_at_weights(act(pre_RF1), w2_LFH[c.l0:c.l1], c, backend)
            if b2_LH is not None and add_b2:
                y_RH[c.r0:c.r1] += b2_LH[c.l0:c.l1].index_select(0, expert_R)
            pre_chunks.append(pre_RF1 if save_pre else None)
        ctx.save_for_backward(x_NH, w1_LHF1, w2_LFH, gather_R, b1_LF1, b2_LH)
        ctx.pre_chunks = pre_chunks   # intermediates, dropped chunk by chunk in backward
        ctx.chunks, ctx.act, ctx.backend, ctx.R, ctx.grad_scale = chunks, act, backend, R, grad_scale
        ctx.grad_stores, ctx.add_b2 = grad_stores, add_b2
        return y_RH

    @staticmethod
    def backward(ctx, grad_y_RH):
        x_NH, w1_LHF1, w2_LFH, gather_R, b1_LF1, b2_LH = ctx.saved_tensors
        need_x, need_w1, need_w2 = ctx.needs_input_grad[:3]
        need_b1, need_b2 = ctx.needs_input_grad[10:12]
        grad_y_RH = grad_y_RH.contiguous()
        store1, store2 = ctx.grad_stores or (GradStore(), GradStore())
        grad_w1 = store1.empty_like(w1_LHF1) if need_w1 else None
        grad_w2 = store2.empty_like(w2_LFH) if need_w2 else None
        grad_b1 = torch.zeros_like(b1_LF1) if need_b1 else None
        grad_b2 = torch.zeros_like(b2_LH) if need_b2 else None
        grad_x = None
        if need_x:
            grad_x = torch.zeros_like(x_NH) if gather_R is not None else x_NH.new_empty(ctx.R, x_NH.shape[-1])
        for i, c in enumerate(ctx.chunks):
            pre_RF1, ctx.pre_chunks[i] = ctx.pre_chunks[i], None
            if c.r1 == c.r0:
                for grad in (grad_w1, grad_w2):
                    if grad is not None:
                        grad[c.l0:c.l1].zero_()
                continue
            w1c, w2c, g_y = w1_LHF1[c.l0:c.l1], w2_LFH[c.l0:c.l1], grad_y_RH[c.r0:c.r1]
            expert_R = _expert_of_rows(c) if b1_LF1 is not None or b2_LH is not None else None
            if need_b2 and ctx.add_b2:
                grad_b2[c.l0:c.l1].index_add_(0, expert_R, g_y, alpha=ctx.grad_scale)
            rows_RH = _rows(x_NH, gather_R, c) if (need_w1 or pre_RF1 is None) else None
            if pre_RF1 is None:
                pre_RF1 = _pre_activation(rows_RH, w1_LHF1, b1_LF1, c, ctx.backend, expert_R)
            with torch.enable_grad():
                pre_leaf = pre_RF1.detach().requires_grad_(True)
                act_RF = ctx.act(pre_leaf)
            del pre_RF1
            if need_w2:
                _weight_grad_into(grad_w2[c.l0:c.l1], act_RF.detach(), g_y, c, ctx.grad_scale, ctx.backend)
            if not (need_x or need_w1 or need_b1):
                continue
            grad_act_RF = _rows_at_weights(g_y, w2c.transpose(1, 2), c, ctx.backend)
            (grad_pre_RF1,) = torch.autograd.grad(act_RF, pre_leaf, grad_act_RF)
            del act_RF, pre_leaf, grad_act_RF
            if need_b1:
                grad_b1[c.l0:c.l1].index_add_(0, expert_R, grad_pre_RF1, alpha=ctx.grad_scale)
            if need_w1:
                _weight_grad_into(grad_w1[c.l0:c.l1], rows_RH, grad_pre_RF1, c, ctx.grad_scale, ctx.backend)
            del rows_RH
            if need_x:
                grad_rows_RH = _rows_at_weights(grad_pre_RF1, w1c.transpose(1, 2), c, ctx.backend)
                if gather_R is None:
                    grad_x[c.r0:c.r1] = grad_rows_RH
                else:
                    grad_x.index_add_(0, gather_R[c.r0:c.r1], grad_rows_RH)
        return grad_x, grad_w1, grad_w2, None, None, None, None, None, None, None, grad_b1, grad_b2, None


def _expert_of_rows(chunk: Chunk) -> Tensor:
    """[rows of the chunk]: each row's expert, counted from the chunk's first (from its row ends)."""
    rows = torch.arange(chunk.r1 - chunk.r0, device=chunk.offs.device, dtype=chunk.offs.dtype)
    return torch.bucketize(rows, chunk.offs, right=True)


def _pre_activation(rows_RH: Tensor, w1_LHF1: Tensor, b1_LF1: Optional[Tensor], chunk: Chunk, backend: str,
                    expert_R: Optional[Tensor]) -> Tensor:
    """The chunk's rows times their experts' first weight, plus their first bias if any."""
    pre_RF1 = _rows_at_weights(rows_RH, w1_LHF1[chunk.l0:chunk.l1], chunk, backend)
    if b1_LF1 is not None:
        pre_RF1 += b1_LF1[chunk.l0:chunk.l1].index_select(0, expert_R)
    return pre_RF1


def _rows(x_NH: Tensor, gather_R: Optional[Tensor], chunk: Chunk) -> Tensor:
    """The chunk's input rows, contiguous: gathered from ``x_NH``, or a slice of it."""
    if gather_R is None:
        return x_NH[chunk.r0:chunk.r1].contiguous()
    return x_NH.index_select(0, gather_R[chunk.r0:chunk.r1])


def expert_ffn(x_NH: Tensor, w1_LHF1: Tensor, w2_LFH: Tensor, counts: list[int] | RowCounts,
               act: Callable[[Tensor], Tensor], backend: str, gather_R: Optional[Tensor] = None, *,
               save_pre: bool = False, grad_scale: float = 1.0, chunk_bytes: int = CHUNK_BYTES,
               grad_stores: Optional[tuple[GradStore, GradStore]] = None, b1_LF1: Optional[Tensor] = None,
               b2_LH: Optional[Tensor] = None, add_b2: bool = True) -> Tensor:
    """``y_RH`` of the module docstring, ``counts`` rows per local expert; ``save_pre`` keeps the
    pre-activation, ``grad_stores`` only where the weights are the parameters themselves."""
    counts, counts_L = (counts.host, counts.device_L) if isinstance(counts, RowCounts) else (counts, None)
    if len(counts) != w1_LHF1.shape[0]:
        raise ValueError(f"{len(counts)} expert row counts for {w1_LHF1.shape[0]} local experts")
    rows = sum(counts)
    available = x_NH.shape[0] if gather_R is None else gather_R.numel()
    if rows != available:
        raise ValueError(f"expert row counts sum to {rows} but {available} rows were given")
    chunks = expert_chunks(counts, w1_LHF1.shape[-1] * x_NH.element_size(), chunk_bytes, x_NH.device, counts_L)
    return ExpertFFN.apply(x_NH.contiguous(), w1_LHF1, w2_LFH, gather_R, chunks, act, backend, save_pre,
                           grad_scale, grad_stores, b1_LF1, b2_LH, add_b2)
