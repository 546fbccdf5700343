"""Packed, masked batches (``moe_plugin.data.packing``) through a Megatron-Core GPT, whole or pipelined.

    loss = packed_loss(engine, batch, global_tokens, replicas=dp * grad_accumulation)

Attention and RoPE stay inside each conversation, padding is not routed, and after the engine's averages
the loss is the global batch's mean over its loss tokens, at any layout.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from moe_plugin.data.packing import PackedBatch, token_weights


def packed_losses(model: Any, batch: PackedBatch) -> tuple[Tensor, Tensor]:
    """``(losses, loss_mask)`` of ``batch``, each [1, B * S] (``model``: a ``GPTModel`` or the engine around one)."""
    device = next(model.parameters()).device
    thd = batch.thd().to(device)
    losses = model(thd.tokens, thd.position_ids, None, labels=thd.labels, packed_seq_params=thd.packed_seq_params,
                   padding_mask=thd.document_ids)
    return losses.float(), thd.loss_mask


def packed_loss(model: Any, batch: PackedBatch, global_tokens: int, replicas: int) -> Tensor:
    """The micro-batch's share of the global batch's mean loss over ``global_tokens``; ``replicas``: dp x gas."""
    losses, mask = packed_losses(model, batch)
    return (losses * token_weights(mask, global_tokens, replicas)).sum()


def packed_pipe_inputs(batch: PackedBatch, global_tokens: int, replicas: int) -> tuple:
    """A pipeline micro-batch of ``batch``: ``((tokens, position_ids, document_ids), (labels, weights))``."""
    thd = batch.thd()
    weights = token_weights(thd.loss_mask, global_tokens, replicas)
    return (thd.tokens, thd.position_ids, thd.document_ids), (thd.labels, weights)


def weighted_sum(losses_BS: Tensor, weights_BS: Tensor) -> Tensor:
    return (losses_BS.float() * weights_BS.to(torch.float32)).sum()
