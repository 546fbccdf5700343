"""Where the balance loss is formed (``aux_loss_scope``): per micro-batch, per sequence, or over
the global batch; each scope gives the loss and gradients of one process routing those tokens.

Shape suffixes: see ``moe_plugin.layers``; the scopes: docs/design/layers_router.md.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from moe_plugin.layers.parallel import LayerParallelism
from moe_plugin.layers.router import balance_loss, balance_terms, count_values, real_terms

BalanceFn = Callable[[str, Tensor, Tensor], Tensor]   # (score, expert_TK, scores_TE) -> loss


def sequence_balance_loss(score: str, expert_TK: Tensor, scores_TE: Tensor, *, sequences: int) -> Tensor:
    """The mean over ``sequences`` of each sequence's ``E * sum_e f_e * P_e`` (row t: sequence ``t % B``)."""
    counted_TX, share_TE = balance_terms(score, expert_TK, scores_TE)
    (T, E), B = share_TE.shape, sequences
    seq_T = torch.arange(T, device=share_TE.device) % B
    count_BE = count_values((seq_T[:, None] * E + counted_TX).reshape(-1), B * E).view(B, E).to(share_TE.dtype)
    share_BE = F.pad(share_TE, (0, 0, 0, -T % B)).view(-1, B, E).sum(0)    # pad to whole positions
    counted_B1 = count_BE.sum(1, keepdim=True)                 # choices counted per sequence
    tokens_B1 = counted_B1 / counted_TX.shape[1]
    f_BE = count_BE / counted_B1.clamp(min=1)
    return E * (f_BE * (share_BE / tokens_B1.clamp(min=1))).sum(1).mean()


def document_balance_loss(score: str, expert_TK: Tensor, scores_TE: Tensor, *, document_T: Tensor) -> Tensor:
    """The mean over the documents present (``document_T`` [T], -1: padding) of each document's
    ``E * sum_e f_e * P_e`` over its tokens; no host sync."""
    counted_TX, share_TE = balance_terms(score, expert_TK, scores_TE)
    (T, E), X = share_TE.shape, counted_TX.shape[1]
    real_T = document_T >= 0
    sorted_T, order_T = torch.sort(document_T, stable=True)
    first_T = torch.ones_like(real_T)
    first_T[1:] = sorted_T[1:] != sorted_T[:-1]
    index_T = torch.empty_like(order_T).scatter_(0, order_T, torch.cumsum(first_T, 0) - 1)   # dense, < T
    counted_TX, share_TE = real_terms(counted_TX, share_TE, real_T)
    count_TE = count_values((index_T[:, None] * (E + 1) + counted_TX).reshape(-1), T * (E + 1)).view(T, E + 1)
    share_DE = torch.zeros_like(share_TE).index_add_(0, index_T, share_TE)        # D: documents, by index
    tokens_D = count_values(torch.where(real_T, index_T, T), T + 1)[:T]
    f_DE = count_TE[:, :E].to(share_TE.dtype) / (tokens_D[:, None] * X).clamp(min=1)
    loss_D = E * (f_DE * (share_DE / tokens_D[:, None].clamp(min=1))).sum(1)
    return loss_D.sum() / (first_T & (sorted_T >= 0)).sum().clamp(min=1)


class BalanceScope:
    """The balance loss of one layer under its ``aux_loss_scope`` (``loss_for``: the function a forward
    passes to its router), and the global scope's counts of the current optimizer step."""

    def __init__(self, scope: str, parallel: LayerParallelism):
        self.scope = scope
        self.replica_group = parallel.dp       # the other replicas route the rest of the global batch
        self.replicas = parallel.dp_size
        self.count_E: Optional[Tensor] = None  # global: counts of this step's training forwards

    def reset(self) -> None:
        """Forget the counts of earlier micro-batches: a new optimizer step starts."""
        self.count_E = None

    def loss_for(self, sequences: Optional[int], training: bool, document_T: Optional[Tensor] = None) -> BalanceFn:
        """The balance loss of a forward of ``sequences`` sequences (None: not [S, B, H]) or of its
        documents ``document_T``; a training forward adds its counts (global)."""
        real_T = None if document_T is None else document_T >= 0
        if self.scope == "sequence":
            if document_T is not None:
                return partial(document_balance_loss, document_T=document_T)
            if sequences is None:
                raise ValueError("moe.aux_loss_scope 'sequence' needs the MoE layer input as [S, B, H] "
                                 "(sequence, batch, hidden): it forms the balance loss per sequence")
            return partial(sequence_balance_loss, sequences=sequences)
        if self.scope == "global":
            return partial(self._global_loss, training=training, real_T=real_T)
        return balance_loss if real_T is None else partial(balance_loss, real_T=real_T)

    def _global_loss(self, score: str, expert_TK: Tensor, scores_TE: Tensor, *, training: bool,
                     real_T: Optional[Tensor] = None) -> Tensor:
        counted_TX, share_TE = balance_terms(score, expert_TK, scores_TE)
        T, E = share_TE.shape
        if real_T is None:
            count_E = count_values(counted_TX.reshape(-1), E)
        else:
            counted_TX, share_TE = real_terms(counted_TX, share_TE, real_T)
            count_E = count_values(counted_TX.reshape(-1), E + 1)[:E]
        if self.replica_group is not None:
            dist.all_reduce(count_E, group=self.replica_group)
        # P_e's mean: over T, or over the replicas' real tokens of this micro-batch per replica
        tokens = max(T, 1) if real_T is None else (count_E.sum() / (counted_TX.shape[1] * self.replicas)).clamp(min=1)
        if training:
            if self.count_E is not None:
                count_E = count_E + self.count_E.to(count_E.device)
            self.count_E = count_E
        f_E = count_E.float() / count_E.sum().clamp(min=1).float()
        return E * (f_E * (share_TE.sum(0) / tokens)).sum()
