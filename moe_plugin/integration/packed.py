"""Packed, masked batches (``moe_plugin.data.packing``) through a Megatron-Core GPT, whole or pipelined.

    for batch in micro_batches:                                 # PackedBatch, this rank's share
        loss = packed_loss(engine, batch, global_tokens, replicas=dp * grad_accumulation)
        engine.backward(loss); engine.step()

The model runs the micro-batch in Megatron's ``thd`` format: one row of B * S tokens,
``PackedSeqParams`` whose ``cu_seqlens`` keep attention and RoPE inside each conversation
(``SDPAttention`` on CPU, Megatron's fused attention on GPU), positions restarting at each, and
``padding_mask`` the document ids, -1 on padding, which the MoE layers do not route. The loss is the
sum of each token's loss times ``token_weights``: after the engine's averages over gradient accumulation
and data parallelism, the global batch's mean over its loss tokens, at any layout.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from moe_plugin.data.packing import PackedBatch, token_weights


def packed_losses(model: Any, batch: PackedBatch) -> tuple[Tensor, Tensor]:
    """``(losses, loss_mask)`` of ``batch``, each [1, B * S] (fp32 per-token cross entropy; ``model``: a
    ``GPTModel`` or the DeepSpeed engine around one, on its device)."""
    device = next(model.parameters()).device
    thd = batch.thd().to(device)
    losses = model(thd.tokens, thd.position_ids, None, labels=thd.labels, packed_seq_params=thd.packed_seq_params,
                   padding_mask=thd.document_ids)
    return losses.float(), thd.loss_mask


def packed_loss(model: Any, batch: PackedBatch, global_tokens: int, replicas: int) -> Tensor:
    """The micro-batch's share of the global batch's mean loss over its ``global_tokens`` loss tokens,
    ``replicas`` the micro-batches the engine averages (data-parallel size x accumulation steps)."""
    losses, mask = packed_losses(model, batch)
    return (losses * token_weights(mask, global_tokens, replicas)).sum()


def packed_pipe_inputs(batch: PackedBatch, global_tokens: int, replicas: int) -> tuple:
    """A pipeline micro-batch of ``batch``: ``((tokens, position_ids, document_ids), (labels, weights))``,
    each [1, B * S] (``gpt_pipeline_module``'s packed input; its loss weights each token's loss)."""
    thd = batch.thd()
    weights = token_weights(thd.loss_mask, global_tokens, replicas)
    return (thd.tokens, thd.position_ids, thd.document_ids), (thd.labels, weights)


def weighted_sum(losses_BS: Tensor, weights_BS: Tensor) -> Tensor:
    """``sum(losses * weights)`` in fp32."""
    return (losses_BS.float() * weights_BS.to(torch.float32)).sum()
