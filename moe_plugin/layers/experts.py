"""Experts: the local experts as one grouped GEMM (``GroupedExperts``, stacked ``weight1`` [L, H, F1]
and ``weight2`` [L, F, H]; under ETP an F-shard of the single-process weights) and the dense
``SharedExpert``. Shape suffixes: see ``moe_plugin.layers``; details: docs/design/layers_experts.md.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_plugin.configs.schema import ExpertsBackend
from moe_plugin.layers import comm
from moe_plugin.layers.expert_backend import check_backend, choose_backend
from moe_plugin.layers.ffn_autograd import GradStore, RowCounts, expert_ffn
from moe_plugin.layers.init import seeded_generator

EXPERT_STREAM = 2
SHARED_STREAM = 3


def _swiglu(h_RF1: Tensor) -> Tensor:
    gate_RF, up_RF = h_RF1.chunk(2, dim=-1)
    return F.silu(gate_RF) * up_RF


def _clamped_swiglu(h_RF1: Tensor, alpha: float, limit: float) -> Tensor:
    """GPT-OSS's ``(up + 1) * gate * sigmoid(alpha * gate)``, gate and up clamped by ``limit``; row by
    row the same whatever rows the call holds (docs/design/layers_experts.md)."""
    width = h_RF1.shape[-1] // 2
    lower_F1 = h_RF1.new_full((2 * width,), -math.inf)
    lower_F1[width:] = -limit
    scale_F1 = h_RF1.new_ones(2 * width)
    scale_F1[:width] = alpha
    clamped_RF1 = torch.clamp(h_RF1, min=lower_F1, max=h_RF1.new_full((2 * width,), limit)) * scale_F1
    gate_RF, up_RF = clamped_RF1[..., :width], clamped_RF1[..., width:]   # the gate times alpha; strided views
    return (up_RF + 1) * (F.silu(gate_RF) / alpha)


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"gelu": F.gelu, "swiglu": _swiglu, "relu": F.relu}
GATED = ("swiglu", "clamped_swiglu")   # the first weight holds the gate half, then the up half


def activation_fn(name: str, alpha: float = 1.702, limit: float = 7.0) -> Callable[[Tensor], Tensor]:
    """The expert activation ``name`` (``alpha``, ``limit``: clamped_swiglu's)."""
    if name == "clamped_swiglu":
        return functools.partial(_clamped_swiglu, alpha=alpha, limit=limit)
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {name!r}; valid: gelu, swiglu, relu, clamped_swiglu")
    return ACTIVATIONS[name]


def ffn_shard(w1_HF1: Tensor, w2_FH: Tensor, activation: str, etp_size: int, etp_rank: int) -> tuple[Tensor, Tensor]:
    """Expert-tensor-parallel shard ``etp_rank`` of ``etp_size`` of one expert's full weights (F cut)."""
    ffn = w2_FH.shape[0]
    if ffn % etp_size:
        raise ValueError(f"expert ffn size {ffn} cannot be split evenly over {etp_size} expert-tensor-parallel ranks")
    part = ffn // etp_size
    cols = slice(etp_rank * part, (etp_rank + 1) * part)
    if activation in GATED:
        gate_HF, up_HF = w1_HF1.chunk(2, dim=-1)
        w1_HF1 = torch.cat([gate_HF[:, cols], up_HF[:, cols]], dim=-1)
    else:
        w1_HF1 = w1_HF1[:, cols]
    return w1_HF1.contiguous(), w2_FH[cols].contiguous()


class GroupedExperts(nn.Module):
    """This rank's expert slots (under ETP their F-shard); the buffer ``placement`` [E] is the slot of
    each expert, whose weights come from ``(seed, e)`` alone: any layout gives the one-process weights."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, activation: str = "gelu", *,
                 ep_size: int = 1, ep_rank: int = 0, etp_size: int = 1, etp_rank: int = 0,
                 group_name: str = "ep_size_1", seed: int = 0, init_std: float = 0.02,
                 output_init_std: float | None = None, backend: ExpertsBackend = "auto", grad_scale: float = 1.0,
                 recompute_pre_activation: bool = False, placement: Optional[Tensor] = None,
                 bias: bool = False, alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        if num_experts % ep_size or not 0 <= ep_rank < ep_size:
            raise ValueError(f"expert-parallel rank {ep_rank} of size {ep_size} cannot hold an equal "
                             f"share of {num_experts} experts")
        if not 0 <= etp_rank < etp_size:
            raise ValueError(f"expert-tensor-parallel rank {etp_rank} is outside a group of {etp_size}")
        check_backend(backend)
        self.num_experts, self.num_local = num_experts, num_experts // ep_size
        self.first_slot = ep_rank * self.num_local
        self.activation, self.act, self.backend = activation, activation_fn(activation, alpha, limit), backend
        self.etp_rank = etp_rank
        self.grad_scale, self.recompute_pre_activation = grad_scale, recompute_pre_activation
        self._grad_stores = (GradStore(), GradStore())   # weight1's and weight2's gradient storage (CPU)
        width = 2 * ffn_hidden_size if activation in GATED else ffn_hidden_size
        out_std = init_std if output_init_std is None else output_init_std
        w1, w2 = [], []
        slot_E = torch.arange(num_experts) if placement is None else torch.as_tensor(placement, dtype=torch.long)
        if sorted(slot_E.tolist()) != list(range(num_experts)):
            raise ValueError(f"placement must give each of the {num_experts} experts its own slot "
                             f"0..{num_experts - 1}; got {slot_E.tolist()}")
        self.register_buffer("placement", slot_E.clone())
        for e in self.local_ids():
            gen = seeded_generator(seed, EXPERT_STREAM, e)
            w1_HF1 = torch.randn(hidden_size, width, generator=gen) * init_std
            w2_FH = torch.randn(ffn_hidden_size, hidden_size, generator=gen) * out_std
            if etp_size > 1:
                w1_HF1, w2_FH = ffn_shard(w1_HF1, w2_FH, activation, etp_size, etp_rank)
            w1.append(w1_HF1)
            w2.append(w2_FH)
        self.weight1 = nn.Parameter(torch.stack(w1))   # [L, H, F1/etp]
        self.weight2 = nn.Parameter(torch.stack(w2))   # [L, F/etp, H]
        self.bias1 = self.bias2 = None
        if bias:   # zeros, as transformers initialises GPT-OSS's; bias2 counts on ETP rank 0 only (``ffn``)
            self.bias1 = nn.Parameter(torch.zeros(self.num_local, self.weight1.shape[-1]))   # [L, F1/etp]
            self.bias2 = nn.Parameter(torch.zeros(self.num_local, hidden_size))              # [L, H]
        for p in self.parameters():
            p.allreduce, p.group_name = False, group_name

    def stacked(self) -> list[nn.Parameter]:
        """The parameters stacked by local expert ([L, ...]): weight1, weight2, then bias1, bias2 if any."""
        return [p for p in (self.weight1, self.weight2, self.bias1, self.bias2) if p is not None]

    def release_grad_storage(self) -> None:
        """Drop the weight gradients' kept storage (``ffn_autograd.GradStore``)."""
        for store in self._grad_stores or ():
            store.release()

    def keep_grad_storage(self, keep: bool) -> None:
        """Whether backward writes the weight gradients into kept storage (off drops it)."""
        self.release_grad_storage()
        self._grad_stores = (GradStore(), GradStore()) if keep else None

    def local_ids(self) -> list[int]:
        """Global ids of the experts in this rank's slots, in slot order (one host sync)."""
        return torch.argsort(self.placement)[self.first_slot:self.first_slot + self.num_local].tolist()

    def pick_backend(self, x_RH: Tensor) -> str:
        """The backend for rows like ``x_RH`` (``expert_backend.choose_backend``)."""
        _, hidden, width = self.weight1.shape
        return choose_backend(self.backend, x_RH.device, x_RH.dtype, (hidden, width, self.weight2.shape[1]))

    def forward(self, x_RH: Tensor, counts_L: RowCounts | list[int] | Tensor,
                gather_R: Optional[Tensor] = None) -> Tensor:
        """Rows of ``x_RH`` (``x_RH[gather_R]`` with ``gather_R``, gathered chunk by chunk) grouped by
        local expert, ``counts_L`` rows each -> [R, H] in the input dtype (under ETP a partial sum)."""
        w1_LHF = self.weight1.to(x_RH.dtype)
        w2_LFH = self.weight2.to(x_RH.dtype)
        own_grads = w1_LHF is self.weight1 and w2_LFH is self.weight2   # no cast in between
        biases = self._biases(x_RH.dtype)
        return self.ffn(x_RH, counts_L, gather_R, w1_LHF, w2_LFH, own_grads, *biases)

    def _biases(self, dtype: torch.dtype) -> tuple[Optional[Tensor], Optional[Tensor]]:
        if self.bias1 is None:
            return None, None
        return self.bias1.to(dtype), self.bias2.to(dtype)

    def split_weights(self, sizes: list[int], dtype: torch.dtype) -> list[tuple[Optional[Tensor], ...]]:
        """(weight1, weight2, bias1, bias2) in ``dtype``, cut into groups of ``sizes`` local experts."""
        parts = [self.weight1.to(dtype).split(sizes), self.weight2.to(dtype).split(sizes)]
        parts += [[None] * len(sizes) if b is None else b.split(sizes) for b in self._biases(dtype)]
        return list(zip(*parts))

    def ffn(self, x_RH: Tensor, counts_L: RowCounts | list[int] | Tensor, gather_R: Optional[Tensor], w1_LHF: Tensor,
            w2_LFH: Tensor, own_grads: bool = False, b1_LF: Optional[Tensor] = None,
            b2_LH: Optional[Tensor] = None) -> Tensor:
        """``forward`` with given weights (all local experts or a group of them); ``own_grads``: they are
        the parameters themselves. ``b2_LH`` is added on ETP rank 0 only."""
        counts = counts_L if isinstance(counts_L, (list, RowCounts)) else RowCounts(counts_L.tolist(), counts_L)
        return expert_ffn(x_RH, w1_LHF, w2_LFH, counts, self.act, self.pick_backend(x_RH), gather_R,
                          save_pre=not self.recompute_pre_activation, grad_scale=self.grad_scale,
                          grad_stores=self._grad_stores if own_grads else None, b1_LF1=b1_LF, b2_LH=b2_LH,
                          add_b2=self.etp_rank == 0)


class SharedExpert(nn.Module):
    """A dense FFN every token passes through, optionally scaled by ``sigmoid(x . gate_weight)``;
    ``grad_group`` (TP) sums its weight gradients."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str = "gelu", *, gate: bool = False,
                 seed: int = 0, init_std: float = 0.02, output_init_std: float | None = None,
                 grad_group: comm.Group = None, alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        self.grad_group = grad_group
        self.act = activation_fn(activation, alpha, limit)
        width = 2 * ffn_hidden_size if activation in GATED else ffn_hidden_size
        out_std = init_std if output_init_std is None else output_init_std
        gen = seeded_generator(seed, SHARED_STREAM)
        self.weight1 = nn.Parameter(torch.randn(hidden_size, width, generator=gen) * init_std)        # [H, F1]
        self.weight2 = nn.Parameter(torch.randn(ffn_hidden_size, hidden_size, generator=gen) * out_std)  # [F, H]
        self.gate_weight = nn.Parameter(torch.randn(hidden_size, generator=gen) * init_std) if gate else None

    def _w(self, w: Tensor, dtype: torch.dtype) -> Tensor:
        return comm.all_reduce_grad(w, self.grad_group).to(dtype)

    def forward(self, x_TH: Tensor) -> Tensor:
        y_TH = self.act(x_TH @ self._w(self.weight1, x_TH.dtype)) @ self._w(self.weight2, x_TH.dtype)
        if self.gate_weight is not None:
            y_TH = y_TH * torch.sigmoid(x_TH @ self._w(self.gate_weight, x_TH.dtype)).unsqueeze(-1)
        return y_TH
