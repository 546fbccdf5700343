"""Packed conversations (``moe_plugin.data.packing``): the packing itself, the batches, and that a pack
is the same model as each of its conversations run alone, under layouts and attention kinds.

The model checks build the example's model (``pretrain_gpt_moe.build_engine``, the real DeepSpeed
engine) from its flags and compare each conversation's per-token losses inside packs (Megatron's thd
format, ``moe_plugin.packed_losses``) with the same conversation run alone as an ordinary sequence;
under pp2 DeepSpeed's ``PipelineEngine`` runs both (``moe_plugin.packed_pipe_inputs``' input), its last
stage's logits give the per-token losses and its loss weights each conversation's summed loss.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dist import run_distributed
from example_runs import example_script
from ds_json import write_ds_config

VOCAB, SEQ = 64, 24
LENGTHS = [5, 11, 3, 9, 7, 13, 4, 8]   # conversations; packs of SEQ tokens


def write_chat(prefix: Path, lengths, seed: int = 0) -> None:
    """A chat dataset as ``moe-plugin preprocess --chat`` lays it out: tokens, a loss mask beside them."""
    from moe_plugin.data import write_indexed

    rng = np.random.default_rng(seed)
    tokens = [rng.integers(1, VOCAB, n).astype(np.uint16) for n in lengths]
    masks = [(rng.random(n) < 0.6).astype(np.uint8) for n in lengths]
    write_indexed(prefix, tokens, dtype=np.uint16)
    write_indexed(f"{prefix}_loss_mask", masks, dtype=np.uint8)
    Path(f"{prefix}.json").write_text(json.dumps({"format": "chat", "loss_mask": f"{prefix.name}_loss_mask",
                                                  "vocab_size": VOCAB}))


def packed(prefix: Path, seq_length: int = SEQ, **kw):
    from moe_plugin.data import read_indexed
    from moe_plugin.data.packing import PackedConversations

    tokens, mask = read_indexed(prefix), read_indexed(f"{prefix}_loss_mask")
    return PackedConversations(tokens, mask, range(len(tokens)), seq_length, **kw), tokens, mask


def test_best_fit_decreasing_places_every_length_once():
    from moe_plugin.data.packing import pack_lengths

    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 100, 500)
    packs = pack_lengths(lengths, 100)
    placed = np.sort(np.concatenate(packs))
    assert placed.tolist() == list(range(500))
    assert max(lengths[p].sum() for p in packs) <= 100
    assert len(packs) <= int(np.ceil(lengths.sum() / 100 * 1.1)) + 1   # near the bound
    assert [p.tolist() for p in pack_lengths(lengths, 100)] == [p.tolist() for p in packs]   # deterministic
    with pytest.raises(ValueError, match="lengths must be 1..100"):
        pack_lengths(np.array([101]), 100)


def test_a_pack_holds_its_conversations_whole(tmp_path):
    prefix = tmp_path / "chat"
    write_chat(prefix, LENGTHS)
    packs, tokens, mask = packed(prefix)
    assert sum(len(p) for p in packs.packs) == len(LENGTHS)
    assert packs.efficiency == pytest.approx(sum(LENGTHS) / (len(packs) * SEQ))
    batch = packs.batch(range(len(packs)))
    for row, pack in enumerate(packs.packs):
        at = 0
        for k in pack.tolist():
            n, doc = LENGTHS[k], batch.document_ids[row, at].item()
            assert batch.tokens[row, at:at + n].tolist() == tokens[k].tolist()
            assert batch.labels[row, at:at + n - 1].tolist() == tokens[k][1:].tolist()
            assert batch.loss_mask[row, at:at + n - 1].tolist() == mask[k][1:].astype(float).tolist()
            assert batch.loss_mask[row, at + n - 1] == 0      # no label past a conversation's end
            assert batch.position_ids[row, at:at + n].tolist() == list(range(n))
            assert (batch.document_ids[row, at:at + n] == doc).all()
            at += n
        assert (batch.document_ids[row, at:] == -1).all() and (batch.loss_mask[row, at:] == 0).all()
    ids = batch.document_ids[batch.document_ids >= 0]
    assert len(set(ids.tolist())) == len(LENGTHS)    # unique in the batch
    assert packs.loss_tokens(range(len(packs))) == int(batch.loss_mask.sum())
    thd = batch.thd()
    cu = thd.packed_seq_params.cu_seqlens_q.tolist()
    assert thd.tokens.shape == (1, len(packs) * SEQ) and cu[0] == 0 and cu[-1] == len(packs) * SEQ
    runs = np.diff(cu).tolist()
    assert sorted(r for r in runs) == sorted(LENGTHS + [SEQ - sum(LENGTHS[k] for k in p) for p in packs.packs
                                                        if sum(LENGTHS[k] for k in p) < SEQ])


def test_long_conversations_are_truncated_or_refused(tmp_path):
    from moe_plugin.configs import ConfigError

    prefix = tmp_path / "chat"
    write_chat(prefix, [5, 30, 8])
    packs, tokens, _ = packed(prefix, 16)
    assert packs.truncated == 1 and "1 truncated" in packs.describe()
    assert packs.batch(range(len(packs))).tokens.reshape(-1).tolist().count(int(tokens[1][0])) >= 1
    with pytest.raises(ConfigError, match="conversation 1 has 30 tokens, more than a sequence holds"):
        packed(prefix, 16, overflow="refuse")


def test_weights_give_the_global_mean():
    from moe_plugin.data.packing import token_weights

    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    assert token_weights(mask, 8, 4).tolist() == [[0.5, 0.0, 0.5], [0.5, 0.5, 0.0]]


# --- the same model packed and alone -----------------------------------------------------------------------
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
        "--seq-length", str(SEQ), "--max-position-embeddings", "64", "--seed", "5", "--init-method-std", "0.2",
        "--no-plot"]
KINDS = {   # attention kinds: the example's flags
    "learned": [],
    "rope": ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--group-query-attention",
             "--num-query-groups", "2"],
    "yarn": ["--position-embedding-type", "rope", "--rope-scaling",
             json.dumps({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 8})],
    "window": ["--position-embedding-type", "rope", "--window-size", "3,0"],
    "sinks": ["--position-embedding-type", "rope", "--softmax-type", "learnable", "--window-size", "4,0",
              "--window-attn-skip-freq", "2"],
    "mla": ["--position-embedding-type", "rope", "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank",
            "12", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "6", "--normalization", "RMSNorm",
            "--rope-scaling", json.dumps({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 8})],
}
MOE = {"num_experts": 4, "router": "topk", "top_k": 2, "drop_tokens": False, "aux_loss_coeff": 0.01,
       "layer_interval": 1}
LAYOUTS = {   # world size -> (layout, moe.parallel, the attention kinds it runs): every kind on one rank, each
    1: [("one", {}, list(KINDS))],                                           # layout with two of them
    2: [("tp2-sp", {"tensor": 2, "sequence_parallel": True}, ["mla", "window"]),
        ("ep2", {"expert": 2}, ["rope", "sinks"]), ("pp2", {"pipeline": 2}, ["rope", "learned"])],
    4: [("tp2-ep2", {"tensor": 2, "expert": 2}, ["yarn", "learned"])]}


def _ds_config(path: Path, world_size: int, parallel: dict) -> str:
    dp = world_size // (parallel.get("tensor", 1) * parallel.get("pipeline", 1))
    return write_ds_config(path, batch=4, dp=dp, gas=1, clip=None, optimizer={"type": "AdamW", "params": {"lr": 1e-3}},
                           moe=MOE, parallel=parallel)


def _alone_losses(engine, tokens: np.ndarray) -> torch.Tensor:
    """The conversation as an ordinary sequence: positions 0.., causal attention, no packing; right-padded
    to an even length (tensor parallelism splits the sequence), the padding after it masked (Megatron's
    bool ``padding_mask``) and invisible to it (causal)."""
    n = len(tokens) - 1
    t = torch.zeros(1, n + 1 + n % 2, dtype=torch.int64)
    t[0, :n + 1] = torch.from_numpy(tokens.astype(np.int64))
    padding = torch.arange(t.shape[1] - 1)[None] >= n
    losses = engine(t[:, :-1], torch.arange(t.shape[1] - 1)[None], None, labels=t[:, 1:], padding_mask=padding)
    return losses.float()[0, :n]


def _pipe_eval(engine, inputs: tuple, labels_1T: torch.Tensor, weights_1T: torch.Tensor, logits: bool = False):
    """One micro-batch through a ``PipelineEngine`` (one micro-batch a batch: ``eval_batch`` averages over
    them): its loss (``gpt_loss``: the sum of the token losses times their weights; every stage), or, with
    ``logits``, each token's loss from the last stage's logits (None on the others). A pack and a plain
    sequence send different things between the stages: the engine's buffers are reset before each."""
    import torch.nn.functional as F

    engine.reset_activation_shape()
    batch = iter([(inputs, (labels_1T, weights_1T))])
    if not logits:
        return float(engine.eval_batch(batch))
    # compute_loss False: the vocab-parallel cross entropy would work on the logits in place
    _, logits_T1V = engine.eval_batch(batch, return_logits=True, compute_loss=False)
    return None if logits_T1V is None else F.cross_entropy(logits_T1V[:, 0].float(), labels_1T[0], reduction="none")


def _pipeline_worst(engine, packs, tokens) -> dict:
    """The worst relative differences, pack against alone, on a ``PipelineEngine``: each token's loss from
    the logits, and each conversation's summed loss (the pack's weights 1 on its tokens and 0 elsewhere).
    Alone: the plain input (positions 0.., causal, no document ids), right-padded to the pack's length
    (invisible to it: causal) with weight 0. ``eval_batch`` adds each output into a running total that
    only ``train_batch`` resets: all the logits (of one shape) come before the losses."""
    import torch.distributed as dist

    thd = packs.batch(range(len(packs))).thd()
    pack_inputs, length = (thd.tokens, thd.position_ids, thd.document_ids), thd.tokens.shape[1]
    spans, alone = [], []   # (first position in the pack, label positions); the alone micro-batches
    for row, pack in enumerate(packs.packs):
        at = row * SEQ
        for k in pack.tolist():
            n = len(tokens[k])
            t = torch.zeros(1, length + 1, dtype=torch.int64)
            t[0, :n] = torch.from_numpy(tokens[k].astype(np.int64))
            ahead = torch.arange(length)
            positions = torch.where(ahead < n, ahead, 0)[None]   # the padding's: any the embedding has
            spans.append((at, n - 1))
            alone.append(((t[:, :-1], positions), t[:, 1:], (ahead < n - 1).float()[None]))
            at += n
    worst = torch.zeros(2)
    losses_T = _pipe_eval(engine, pack_inputs, thd.labels, thd.loss_mask, logits=True)
    for (at, n), (inputs, labels, weights) in zip(spans, alone):
        alone_T = _pipe_eval(engine, inputs, labels, weights, logits=True)
        if alone_T is not None:
            inside, by_itself = losses_T[at:at + n], alone_T[:n]
            worst[0] = max(worst[0], float(((inside - by_itself).abs() / by_itself.abs()).max()))
    for (at, n), (inputs, labels, weights) in zip(spans, alone):
        only_k = torch.zeros_like(thd.loss_mask)
        only_k[0, at:at + n] = 1
        inside = _pipe_eval(engine, pack_inputs, thd.labels, only_k)
        by_itself = _pipe_eval(engine, inputs, labels, weights)
        worst[1] = max(worst[1], abs(inside - by_itself) / abs(by_itself))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)   # the logits are on the last stage
    return {"per token": float(worst[0]), "summed": float(worst[1])}


def _engine_worst(engine, packs, tokens) -> dict:
    """The worst relative difference of a token's loss, pack against alone, on a DeepSpeed engine around a
    ``GPTModel`` (``moe_plugin.packed_losses`` against ``_alone_losses``)."""
    from moe_plugin.integration.packed import packed_losses

    engine.eval()
    with torch.no_grad():
        losses = packed_losses(engine, packs.batch(range(len(packs))))[0].reshape(len(packs), SEQ)
        worst = 0.0
        for row, pack in enumerate(packs.packs):
            at = 0
            for k in pack.tolist():
                n = len(tokens[k])
                alone = _alone_losses(engine, tokens[k])
                inside = losses[row, at:at + n - 1]
                worst = max(worst, float(((inside - alone).abs() / alone.abs()).max()))
                at += n
    return {"per token": worst}


def _packed_vs_alone(rank: int, world_size: int, tmp: str, layouts: list) -> dict:
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    example = example_script()
    packs, tokens, _ = packed(Path(tmp) / "chat")
    out = {}
    for layout, parallel, kinds in layouts:
        for kind in kinds:
            flags = KINDS[kind]
            args = example.parse_args([*BASE, *flags, "--deepspeed_config",
                                       _ds_config(Path(tmp) / f"{layout}-{kind}-{rank}.json", world_size, parallel)])
            plan = example.check_run(args, world_size)
            run = example.build_engine(args, plan, SimpleNamespace(vocab_size=VOCAB))
            worst = _pipeline_worst if parallel.get("pipeline", 1) > 1 else _engine_worst
            out[(layout, kind)] = worst(run.engine, packs, tokens)
            run.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_a_pack_is_each_conversation_alone(tmp_path, world_size):
    """Each conversation's per-token losses inside packs equal the conversation run alone (fp32, 1e-5
    relative), for learned positions, RoPE (GQA, SwiGLU), YaRN, sliding windows, attention sinks and MLA
    with YaRN, on 1 rank and under tp2 with sequence parallelism, ep2, tp2 x ep2 and pp2 (DeepSpeed's
    PipelineEngine, RoPE and learned positions: the per-token losses from the last stage's logits, and
    each conversation's loss summed by the pipeline's loss weights)."""
    write_chat(tmp_path / "chat", LENGTHS)
    results = run_distributed(_packed_vs_alone, world_size, tmp_path, str(tmp_path), LAYOUTS[world_size],
                              timeout=600)
    for key, worst in results[0].items():
        print(key, {what: f"{value:.1e}" for what, value in worst.items()})
        assert max(worst.values()) < 1e-5, (key, worst)
