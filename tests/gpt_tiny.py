"""A tiny Megatron-Core GPT-MoE for the multi-rank tests: its config, its data, its model providers.

    config = transformer_config(MODEL, tp=2, pp=2)
    tokens_BS, positions_BS, labels_BS = global_batch(step, batch_size)
    micro = micro_batches(step, batch_size, dp_rank, dp, gas)   # [((tokens, positions), labels)] * gas
    tokens_BS, positions_BS, labels_BS = shifted_batch(step, batch_size, vocab, seq)   # labels: tokens one on
    losses_BS = eval_losses(model, (tokens_BS, positions_BS, labels_BS))   # eval mode, no gradients
    provider = gpt_provider(MODEL, tp)                          # GPTModel(config, gpt_moe_spec(...))
    provider = pipeline_provider(MODEL, tp, pp, seed)           # gpt_pipeline_module(...)
    with one_rank_groups() as groups: ...                       # the one-rank oracle's groups, registered
    losses, norms = torch_steps(model, optimizer, batches, clip)   # the oracle's plain torch training

Both providers take ``initial``: full single-process weights under ``GPTModel`` names, loaded by
name into whatever this rank holds (pipeline pieces mapped with ``pipeline_state_dict_key``,
tensor/expert shards cut by ``shard_state_dict``), so that every layout starts from the same model.
Used inside the ranks (fp32, dropout off, CPU initialisation, no fused kernels).
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterable, Iterator, Optional

import torch

VOCAB, SEQ = 64, 8
MODEL = dict(num_layers=4, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32)


def transformer_config(model: dict, tp: int = 1, pp: int = 1, sp: bool = False):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**model, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                             sequence_parallel=sp, pipeline_dtype=torch.float32, use_cpu_initialization=True,
                             hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
                             gradient_accumulation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False)


@contextlib.contextmanager
def one_rank_groups() -> Iterator:
    """The one-rank layout's process groups, registered with Megatron and DeepSpeed while the block runs
    (inside a spawned rank of world size 1: the oracle of the multi-rank tests)."""
    from moe_plugin.groups import RankLayout, build_process_groups, destroy_process_groups, register, unregister

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    groups = build_process_groups(RankLayout.build(1))
    register(groups)
    try:
        yield groups
    finally:
        unregister()
        destroy_process_groups(groups)


def torch_steps(model: torch.nn.Module, optimizer, batches: Iterable, clip: float) -> tuple[list, list]:
    """The oracle's training in plain torch: for each (tokens, positions, labels), the mean loss, backward,
    ``clip_grad_norm_`` (a tied weight counts once) and an optimizer step. Returns the losses and the
    gradient norms before clipping, one per batch."""
    losses, norms = [], []
    for tokens, positions, labels in batches:
        optimizer.zero_grad()
        loss = model(tokens, positions, None, labels=labels).float().mean()
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        optimizer.step()
    return losses, norms


def global_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: tokens, positions, labels, each [batch_size, SEQ]."""
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen)
    return tokens, torch.arange(SEQ).expand(batch_size, SEQ).contiguous(), labels


def micro_batches(step: int, batch_size: int, dp_rank: int, dp: int, gas: int) -> list:
    """One data-parallel replica's ``gas`` micro-batches of ``step``, ((tokens, positions), labels) each:
    replica d takes rows ``d * gas + m`` (in micro-batch units), so the replicas cover the batch."""
    return replica_micro_batches(global_batch(step, batch_size), dp_rank, dp, gas)


def replica_micro_batches(batch: tuple, dp_rank: int, dp: int, gas: int) -> list:
    """``micro_batches`` of any global ``batch`` (tokens, positions, labels)."""
    tokens, positions, labels = batch
    micro = tokens.shape[0] // (dp * gas)
    rows = [slice((dp_rank * gas + m) * micro, (dp_rank * gas + m + 1) * micro) for m in range(gas)]
    return [((tokens[r], positions[r].contiguous()), labels[r]) for r in rows]


def shifted_batch(step: int, batch_size: int, vocab: int, seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` for next-token prediction: ``seq + 1`` random tokens a row, the
    labels the tokens one on; tokens, positions, labels, each [batch_size, seq]."""
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (batch_size, seq + 1), generator=gen)
    return ids[:, :-1], torch.arange(seq).expand(batch_size, seq), ids[:, 1:]


def eval_losses(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    """The per-token losses [B, S] of ``batch`` (tokens, positions, labels) in eval mode, without
    gradients (no dropout, no router noise); the model is back in training mode after."""
    tokens, positions, labels = batch
    model.eval()
    with torch.no_grad():
        losses = model(tokens, positions, None, labels=labels).float()
    model.train()
    return losses


def shard_full(model: torch.nn.Module, full: dict, groups, *, pipelined: bool, num_layers: int) -> dict:
    """This rank's part of the full ``GPTModel``-named tensors ``full``, under ``model``'s own names
    (a pipeline stage's pieces, tensor and expert shards)."""
    from moe_plugin.integration.pipeline import pipeline_state_dict_key
    from moe_plugin.checkpoint.reshard import shard_state_dict

    if pipelined:
        full = {pipeline_state_dict_key(k, num_layers): v for k, v in full.items()}
    return shard_state_dict(full, model, groups.layout, groups.rank)


def load_full(model: torch.nn.Module, initial: dict, groups, *, pipelined: bool, num_layers: int) -> None:
    """Load the full ``GPTModel``-named weights ``initial`` into this rank's part of ``model``."""
    model.load_state_dict(shard_full(model, initial, groups, pipelined=pipelined, num_layers=num_layers))


def gpt_provider(model: dict, tp: int = 1, *, seed: int = 0, initial: Optional[dict] = None):
    """``model_provider`` of a ``GPTModel`` with the plugin's MoE spec (pp = 1), built under ``seed``."""
    def build(moe_config, groups):
        from megatron.core.models.gpt import GPTModel

        from moe_plugin.integration.megatron import gpt_moe_spec

        config = transformer_config(model, tp, sp=moe_config.parallel.sequence_parallel)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)   # Megatron's dense init draws from the default generator
            gpt = GPTModel(config, gpt_moe_spec(moe_config, config, groups, seed=seed), vocab_size=VOCAB,
                           max_sequence_length=SEQ)
        if initial is not None:
            load_full(gpt, initial, groups, pipelined=False, num_layers=model["num_layers"])
        return gpt
    return build


def pipeline_provider(model: dict, tp: int, pp: int, *, seed: int = 0, initial: Optional[dict] = None):
    """``model_provider`` of ``gpt_pipeline_module`` (any pp)."""
    def build(moe_config, groups):
        from moe_plugin.integration.pipeline import gpt_pipeline_module

        config = transformer_config(model, tp, pp, moe_config.parallel.sequence_parallel)
        pipe = gpt_pipeline_module(config, moe_config, groups, vocab_size=VOCAB,
                                   max_sequence_length=SEQ, seed=seed)
        if initial is not None:
            load_full(pipe, initial, groups, pipelined=True, num_layers=model["num_layers"])
        return pipe
    return build
