"""Checkpoints through DeepSpeed's engine (``moe_plugin/checkpoint/``) on 4 gloo ranks, one spawn.

The model is a tiny Megatron-Core GPT (2 layers, both MoE) built by ``gpt_moe_spec`` and trained
by ``moe_plugin.initialize``'s engine with Adam/AdamW, so the optimizer state matters; router
jitter, GShard random routing and hidden dropout draw random numbers every step, and the
aux-loss-free bias moves every step (``initialize``'s step boundary: the loops call nothing for it), so RNG
and router state matter too. fp32.

* exact resume: 20 steps with a save after step 10; a fresh engine loads it and runs steps
  11-20: the losses equal the uninterrupted run's bit for bit (dp x ep, ZeRO-0/1/2, tp x etp);
* resharding: the ep 4 checkpoint loads with ep 2 and ep 1 (weights only), tp 2 x ep 2 loads into
  tp 2 x ep 1 with its ZeRO-0 Adam state re-cut by global expert id; TP changes: tp 2 x ep 2 into
  tp 1 x ep 4 and tp 1 x ep 2 into tp 2 x ep 2 (weights only); the eval loss after load equals the
  saved model's, and the ZeRO-0 run resumes the uninterrupted losses (the whole optimizer state
  through every layout change: tests/unit/checkpoint/test_checkpoint_optimizer.py); a checkpoint without the
  optimizer record (as an fp16 run saves) refuses its optimizer state into another layout, naming the way out;
* bad input (other num_experts, other hidden size, a missing expert file) fails with a message
  naming the difference on every rank, leaves weights and files untouched;
* a save killed midway leaves ``latest`` and the previous tag loadable;
* DeepSpeed's PipelineEngine (``gpt_pipeline_module``, 2 layers, one per stage, ``train_batch`` with
  2 micro-batches): exact resume for pp2 x ep2 (ZeRO-0 and 1, in the 4-rank spawn) and, in an 8-rank
  spawn, tp2 x pp2 x ep2 (ZeRO-1, EP folded over TP) and tp2 x pp2 x ep2 x etp2 (ZeRO-0); ep 2 -> 1 at
  the same pp and tp (ZeRO-1 weights only, ZeRO-0 with its Adam state re-cut by expert id), tp 2 x pp2 x
  ep 2 -> pp 2 x ep 4 (TP 2 -> 1, each stage's dense weights joined and cut again) and pp 2 x ep 2 ->
  pp 1 x ep 2 (one stage gathers both stages' weights and experts), weights only; a pipeline
  checkpoint refused by the plain engine, naming the engine kind.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil

import pytest
import torch

from gpt_tiny import eval_losses, replica_micro_batches, shifted_batch
import ds_json

pytestmark = pytest.mark.slow   # through the deepspeed launcher or several processes

VOCAB, SEQ, BATCH, HIDDEN, FFN = 32, 8, 8, 16, 32
STEPS, SAVE_AT = 20, 10
MOE = {"num_experts": 4, "router": "gshard", "jitter_eps": 0.1, "bias_update_rate": 0.01, "aux_loss_coeff": 0.01,
       "capacity_factor": 1.5}
RESUME = {
    "ep2-zero1-adamw": {"parallel": {"expert": 2}, "stage": 1, "opt": "AdamW"},
    "ep4-zero2-adam": {"parallel": {"expert": 4}, "stage": 2, "opt": "Adam"},
    "tp2-ep2-zero0-adamw": {"parallel": {"tensor": 2, "expert": 2}, "stage": 0, "opt": "AdamW"},
}
RESHARD = {  # name -> (saved case, new case, load_optimizer_states)
    "ep4-to-ep2-zero2": ("ep4-zero2-adam", {"parallel": {"expert": 2}, "stage": 2, "opt": "Adam"}, False),
    "ep4-to-ep1-zero1": ("ep4-zero2-adam", {"parallel": {"expert": 1}, "stage": 1, "opt": "Adam"}, False),
    "tp2ep2-to-tp2ep1-zero0": ("tp2-ep2-zero0-adamw", {"parallel": {"tensor": 2, "expert": 1}, "stage": 0,
                                                       "opt": "AdamW"}, True),
    # TP changes: dense weights joined from every saved TP rank and cut again; weights only
    "tp2ep2-to-tp1ep4-zero0": ("tp2-ep2-zero0-adamw", {"parallel": {"expert": 4}, "stage": 0, "opt": "AdamW"}, False),
    "tp1ep2-to-tp2ep2-zero1": ("ep2-zero1-adamw", {"parallel": {"tensor": 2, "expert": 2}, "stage": 1,
                                                   "opt": "AdamW"}, False),
}

GAS, PIPE_STEPS, PIPE_SAVE_AT = 2, 8, 4
PIPE_RESUME = {  # name -> (world size, moe.parallel, ZeRO stage); AdamW everywhere
    "pp2-ep2-zero1": (4, {"pipeline": 2, "expert": 2}, 1),
    "pp2-ep2-zero0": (4, {"pipeline": 2, "expert": 2}, 0),
    "tp2-pp2-ep2-zero1": (8, {"tensor": 2, "pipeline": 2, "expert": 2, "expert_tensor": 1}, 1),
    "tp2-pp2-ep2-etp2-zero0": (8, {"tensor": 2, "pipeline": 2, "expert": 2, "expert_tensor": 2}, 0),
}
PIPE_RESHARD = {  # name -> (saved case, moe.parallel, ZeRO stage, load_optimizer_states)
    "pp2ep2-to-pp2ep1-zero1": ("pp2-ep2-zero1", {"pipeline": 2, "expert": 1}, 1, False),
    "pp2ep2-to-pp2ep1-zero0": ("pp2-ep2-zero0", {"pipeline": 2, "expert": 1}, 0, True),
    "tp2pp2ep2-to-tp2pp2ep1-zero1": ("tp2-pp2-ep2-zero1", {"tensor": 2, "pipeline": 2, "expert": 1,
                                                           "expert_tensor": 1}, 1, False),
    "tp2pp2ep2etp2-to-tp2pp2ep1etp2-zero0": ("tp2-pp2-ep2-etp2-zero0", {"tensor": 2, "pipeline": 2, "expert": 1,
                                                                        "expert_tensor": 2}, 0, True),
    "tp2pp2ep2-to-pp2ep4-zero1": ("tp2-pp2-ep2-zero1", {"pipeline": 2, "expert": 4}, 1, False),   # TP 2 -> 1
    "pp2ep2-to-pp1ep2-zero1": ("pp2-ep2-zero1", {"pipeline": 1, "expert": 2}, 1, False),           # PP 2 -> 1
}


# -- inside the ranks ------------------------------------------------------------------------------
def _provider(hidden: int, positions: str = "learned_absolute", **architecture):
    def provide(moe_config, groups):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer import TransformerConfig

        from moe_plugin.integration.megatron import gpt_moe_spec

        config = TransformerConfig(num_layers=2, hidden_size=hidden, num_attention_heads=2, ffn_hidden_size=FFN,
                                   tensor_model_parallel_size=groups.layout.sizes.tp, use_cpu_initialization=True,
                                   hidden_dropout=0.1, attention_dropout=0.0, bias_dropout_fusion=False,
                                   gradient_accumulation_fusion=False, masked_softmax_fusion=False,
                                   apply_rope_fusion=False, **architecture)
        torch.manual_seed(1234)
        return GPTModel(config, gpt_moe_spec(moe_config, config, groups), vocab_size=VOCAB, max_sequence_length=SEQ,
                        position_embedding_type=positions)
    return provide


def _engine(case: dict, moe: dict = MOE, hidden: int = HIDDEN, **architecture):
    import moe_plugin

    dp = 4 // case["parallel"].get("tensor", 1)
    cfg = ds_json.ds_config(batch=BATCH, dp=dp, zero=case["stage"], moe=moe, parallel=case["parallel"],
                            optimizer={"type": case["opt"], "params": {"lr": 3e-3, "weight_decay": 0.01,
                                                                       "torch_adam": True}},
                            scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 3e-3}})
    return moe_plugin.initialize(cfg, _provider(hidden, **architecture))


def _batch(step: int):
    return shifted_batch(step, BATCH, VOCAB, SEQ)


def _train(run, steps: range) -> list[float]:
    engine = run.engine
    c = run.groups.layout.coords(torch.distributed.get_rank())
    micro = BATCH // run.groups.layout.sizes.dp
    rows = slice(c["dp"] * micro, (c["dp"] + 1) * micro)
    losses = []
    for step in steps:
        ids, pos, labels = (t[rows] for t in _batch(step))
        loss = engine(ids, pos, None, labels=labels).float().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _eval_loss(run) -> float:
    """The loss of one fixed batch, every rank the whole batch (no dropout, no router noise)."""
    return eval_losses(run.engine.module, _batch(999)).mean().item()


def _weights(run) -> dict:
    return {k: v.detach().clone() for k, v in run.engine.module.state_dict().items() if isinstance(v, torch.Tensor)}


def _files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def _entries(directory: str) -> list[str]:
    """What a save leaves in its directory, less DeepSpeed's recovery scripts (zero_to_*.py)."""
    return sorted(e for e in os.listdir(directory) if not e.endswith(".py"))


def _resume(root: str, name: str, case: dict) -> dict:
    from moe_plugin.checkpoint import load_checkpoint, save_checkpoint

    out = {}
    run = _engine(case)
    try:
        first = _train(run, range(SAVE_AT))
        save_checkpoint(run, os.path.join(root, name), client_state={"data_step": SAVE_AT})
        if torch.distributed.get_rank() == 0:
            out["bytes"] = _tensor_bytes(os.path.join(root, name))
        out["eval_at_save"] = _eval_loss(run)
        out["full"] = first + _train(run, range(SAVE_AT, STEPS))
    finally:
        run.close()
    run = _engine(case)
    try:
        _, client = load_checkpoint(run, os.path.join(root, name))
        out["client"] = client["data_step"]
        out["global_steps"] = run.engine.global_steps
        out["resumed"] = _train(run, range(client["data_step"], STEPS))
    finally:
        run.close()
    if name == "ep2-zero1-adamw":  # the test has teeth: without the RNG states the losses differ
        run = _engine(case)
        try:
            load_checkpoint(run, os.path.join(root, name), load_rng_states=False)
            out["without_rng"] = _train(run, range(SAVE_AT, STEPS))
        finally:
            run.close()
    return out


def _tensor_bytes(directory: str) -> dict:
    """The bytes of the tensors in the latest tag's files (each storage once per file: what the
    save wrote, whatever the format's overhead) against the training state's (the 1-rank model's
    numbers of elements from the metadata: every tensor's value, 4 bytes per fp32 element, and two
    Adam moments of 4 bytes per trained element)."""
    from moe_plugin.checkpoint.metadata import read_latest, read_metadata
    from moe_plugin.checkpoint.tensor_files import TensorFile, nbytes
    from moe_plugin.compat.torch_files import LazyTensor, TorchFile

    tag = read_latest(directory)
    meta = read_metadata(directory, tag)
    written = 0
    for name in meta["files"]:
        if name.startswith("rng"):   # random streams: not the training state
            continue
        if name.endswith(".safetensors"):
            with TensorFile(os.path.join(directory, tag, name)) as f:
                written += sum(nbytes(*f.spec(n)) for n in f.names())
        if not name.endswith(".pt"):
            continue
        seen = set()
        stack = [TorchFile(os.path.join(directory, tag, name)).content]
        while stack:
            value = stack.pop()
            if isinstance(value, dict):
                stack.extend(value.values())
            elif isinstance(value, (list, tuple)):
                stack.extend(value)
            elif isinstance(value, LazyTensor) and (value.key, value.offset) not in seen:
                seen.add((value.key, value.offset))
                written += value.numel() * value.dtype.itemsize
    elements = sum(math.prod(shape) for stage in meta["stages"].values()
                   for kind in ("dense", "experts") for shape in stage[kind].values())
    trained = sum(math.prod(shape) for stage in meta["stages"].values() for kind in ("dense", "experts")
                  for key, shape in stage[kind].items() if not key.endswith(("placement", "expert_bias")))
    return {"written": written, "state": 4 * elements + 8 * trained}


def _load_resharded(run, path: str, with_optimizer: bool, evaluate, resume) -> dict:
    """Load ``path`` into ``run`` (another layout), weights only unless ``with_optimizer``. Then
    the eval loss, the step counter and, with optimizer states, the losses of ``resume()``. Closes
    ``run``."""
    from moe_plugin.checkpoint import load_checkpoint

    out = {}
    try:
        load_checkpoint(run, path, load_optimizer_states=with_optimizer)
        out["stale_masters"] = _stale_masters(run)
        out["eval"] = evaluate(run)
        out["global_steps"] = run.engine.global_steps
        if with_optimizer:
            out["resumed"] = resume(run)
    finally:
        run.close()
    return out


def _stale_masters(run) -> list[str]:
    """Parameters whose optimizer master copy (ZeRO's fp32 partition) differs from the weight the
    module holds: the next step would write the stale copy back into the model."""
    from deepspeed.utils import safe_get_full_fp32_param

    if not run.engine.zero_optimization():
        return []
    return [n for n, p in run.engine.module.named_parameters()
            if not torch.equal(safe_get_full_fp32_param(p).float(), p.detach().float())]


def _reshard(root: str, saved: str, case: dict, with_optimizer: bool) -> dict:
    return _load_resharded(_engine(case), os.path.join(root, saved), with_optimizer, _eval_loss,
                           lambda run: _train(run, range(SAVE_AT, STEPS)))


def _bad_inputs(root: str) -> dict:
    """Checkpoints of another model, or incomplete: the error, and nothing changed."""
    from moe_plugin.checkpoint import api as checkpoint
    from moe_plugin.checkpoint import CheckpointError, load_checkpoint

    saved = os.path.join(root, "ep2-zero1-adamw")
    broken, older = os.path.join(root, "broken"), os.path.join(root, "older")
    if torch.distributed.get_rank() == 0:
        shutil.copytree(saved, broken)
        tag = checkpoint.read_latest(broken)
        os.remove(os.path.join(broken, tag, "experts", "expert_00003_pp_00.safetensors"))
        shutil.copytree(saved, older)   # saved before score_function and gate_scale existed
        meta_path = os.path.join(older, tag, "moe_plugin.json")
        with open(meta_path) as f:
            meta = json.load(f)
        for key in ("score_function", "gate_scale"):
            del meta["moe"][key]
        del meta["optimizer_record"]   # as an fp16 run saves: no optimizer record
        with open(meta_path, "w") as f:
            json.dump(meta, f)
    torch.distributed.barrier()
    out = {}
    case = RESUME["ep2-zero1-adamw"]
    run = _engine(case, MOE, HIDDEN)
    try:   # weights only: its optimizer state is in the record it no longer names (DeepSpeed's files hold none)
        load_checkpoint(run, older, load_optimizer_states=False)
        out["older"] = run.engine.global_steps
    finally:
        run.close()
    run = _engine({"parallel": {"expert": 1}, "stage": 1, "opt": "AdamW"})
    try:   # its ZeRO-1 optimizer state cannot follow another layout
        with pytest.raises(CheckpointError) as failure:
            load_checkpoint(run, older)
        out["older_relaid"] = str(failure.value)
    finally:
        run.close()
    sigmoid = {**MOE, "router": "topk", "top_k": 2, "score_function": "sigmoid"}
    grouped = {**MOE, "group_topk": 1, "router_groups": 2}
    for name, (directory, moe, hidden, *arch) in {
            "num_experts": (saved, {**MOE, "num_experts": 8}, HIDDEN), "group_topk": (saved, grouped, HIDDEN),
            "hidden": (saved, MOE, 2 * HIDDEN), "missing": (broken, MOE, HIDDEN),
            "score_function": (saved, sigmoid, HIDDEN),
            "architecture": (saved, MOE, HIDDEN, {"normalization": "RMSNorm", "qk_layernorm": True}),
            "rope": (saved, MOE, HIDDEN, {"positions": "rope"})}.items():
        run = _engine(case, moe, hidden, **(arch[0] if arch else {}))
        try:
            before, files = _weights(run), _files(root)
            with pytest.raises(CheckpointError) as failure:
                load_checkpoint(run, directory)
            out[name] = str(failure.value)
            after = _weights(run)
            out[name + "-unchanged"] = _files(root) == files and all(torch.equal(before[k], after[k]) for k in before)
        finally:
            run.close()
    return out


def _killed_save(root: str) -> dict:
    """A save that fails after DeepSpeed wrote its files: ``latest`` and the previous tag survive."""
    from moe_plugin.checkpoint import api as checkpoint
    from moe_plugin.checkpoint import CheckpointError

    directory = os.path.join(root, "atomic")
    out = {}
    run = _engine(RESUME["ep2-zero1-adamw"])
    try:
        _train(run, range(2))
        checkpoint.save_checkpoint(run, directory, tag="first")
        out["eval_first"] = _eval_loss(run)
        _train(run, range(2, 4))
        write = checkpoint._write

        def failing(obj, path):
            if os.sep + checkpoint.RNG_DIR + os.sep in path:
                raise OSError("disk full (simulated)")
            write(obj, path)

        checkpoint._write = failing
        try:
            with pytest.raises(CheckpointError, match=f"^{re.escape(directory)}: saving tag 'second' failed, nothing was "
                               r"committed \(.*disk full \(simulated\)\); 'latest' still names 'first', as before$"):
                checkpoint.save_checkpoint(run, directory, tag="second")
        finally:
            checkpoint._write = write
        torch.distributed.barrier()
        out["latest"] = checkpoint.read_latest(directory)
        out["entries"] = _entries(directory)
        checkpoint.load_checkpoint(run, directory)
        out["eval_loaded"] = _eval_loss(run)
        checkpoint.save_checkpoint(run, directory, tag="second")  # removes the stale temporary directory
        out["entries_after"] = _entries(directory)
    finally:
        run.close()
    return out


# -- pipeline (DeepSpeed's PipelineEngine) ---------------------------------------------------------
def _pipe_engine(parallel: dict, stage: int, moe: dict = MOE, tied: bool = False, warmup: bool = True):
    import moe_plugin
    from megatron.core.transformer import TransformerConfig

    from moe_plugin.integration.pipeline import gpt_pipeline_module

    tp, pp = parallel.get("tensor", 1), parallel["pipeline"]
    dp = torch.distributed.get_world_size() // (tp * pp)

    def provide(moe_config, groups):
        config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=FFN,
                                   tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                   pipeline_dtype=torch.float32, use_cpu_initialization=True, hidden_dropout=0.1,
                                   attention_dropout=0.0, bias_dropout_fusion=False,
                                   gradient_accumulation_fusion=False, masked_softmax_fusion=False,
                                   apply_rope_fusion=False)
        torch.manual_seed(1234)   # dropout's stream (the pieces are built under their own seeds)
        return gpt_pipeline_module(config, moe_config, groups, vocab_size=VOCAB, max_sequence_length=SEQ, seed=5,
                                   share_embeddings_and_output_weights=tied)

    cfg = ds_json.ds_config(batch=BATCH, dp=dp, gas=GAS, zero=stage, moe=moe, parallel=parallel,
                            optimizer={"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}})
    if warmup:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 3e-3}}
    return moe_plugin.initialize(cfg, provide)


def _micro_batches(run, step: int):
    """This data-parallel replica's ``GAS`` micro-batches of ``_batch(step)``, as the pipe takes them."""
    return iter(replica_micro_batches(_batch(step), run.groups.rank_in("dp"), run.groups.layout.sizes.dp, GAS))


def _pipe_train(run, steps: range) -> list[float]:
    losses = []
    for step in steps:
        losses.append(run.engine.train_batch(_micro_batches(run, step)).item())
    return losses


def _pipe_resume(root: str, name: str, parallel: dict, stage: int) -> dict:
    from moe_plugin.checkpoint import load_checkpoint, save_checkpoint

    out = {}
    run = _pipe_engine(parallel, stage)
    try:
        first = _pipe_train(run, range(PIPE_SAVE_AT))
        sizes = run.groups.layout.sizes
        out["layout"] = {"tensor": sizes.tp, "pipeline": sizes.pp, "expert": sizes.ep, "expert_tensor": sizes.etp}
        saved = save_checkpoint(run, os.path.join(root, name), client_state={"data_step": PIPE_SAVE_AT})
        out["experts"], out["files"] = sorted(os.listdir(os.path.join(saved, "experts"))), _entries(saved)
        out["eval_at_save"] = run.engine.eval_batch(_micro_batches(run, 999)).item()
        out["full"] = first + _pipe_train(run, range(PIPE_SAVE_AT, PIPE_STEPS))
    finally:
        run.close()
    run = _pipe_engine(parallel, stage)
    try:
        _, client = load_checkpoint(run, os.path.join(root, name))
        out["client"], out["global_steps"] = client["data_step"], run.engine.global_steps
        out["resumed"] = _pipe_train(run, range(client["data_step"], PIPE_STEPS))
    finally:
        run.close()
    return out


def _pipe_reshard(root: str, saved: str, parallel: dict, stage: int, with_optimizer: bool) -> dict:
    return _load_resharded(_pipe_engine(parallel, stage), os.path.join(root, saved), with_optimizer,
                           lambda run: run.engine.eval_batch(_micro_batches(run, 999)).item(),
                           lambda run: _pipe_train(run, range(PIPE_SAVE_AT, PIPE_STEPS)))


def _pipe_into_plain_engine(root: str) -> dict:
    """A pipeline checkpoint offered to the plain engine (pp 1, a GPTModel), weights only: it loads
    (names mapped: ``checkpoint/keys.py``; that the loaded model computes the pipeline's function is
    tests/e2e/test_example_layouts.py's; with the optimizer state: tests/unit/checkpoint/test_checkpoint_optimizer.py)."""
    from moe_plugin.checkpoint import load_checkpoint

    run = _engine(RESUME["ep2-zero1-adamw"])
    try:
        fresh = _eval_loss(run)
        load_checkpoint(run, os.path.join(root, "pp2-ep2-zero1"), load_optimizer_states=False)
        return {"fresh": fresh, "loaded": _eval_loss(run)}
    finally:
        run.close()


def _child(rank: int, world_size: int, root: str) -> dict:
    from dist import attempts

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    results = {}
    attempt = attempts(results, rank)

    for name, (size, parallel, stage) in PIPE_RESUME.items():
        if size == world_size:
            attempt(name, _pipe_resume, root, name, parallel, stage)
    for name, (saved, parallel, stage, with_optimizer) in PIPE_RESHARD.items():
        if PIPE_RESUME[saved][0] == world_size:
            attempt(name, _pipe_reshard, root, saved, parallel, stage, with_optimizer)
    if world_size == 8:   # the 8-rank spawn: tp x pp x ep pipelines only
        return results
    attempt("pipe-into-plain", _pipe_into_plain_engine, root)
    for name, case in RESUME.items():
        attempt(name, _resume, root, name, case)
    for name, (saved, case, with_optimizer) in RESHARD.items():
        attempt(name, _reshard, root, saved, case, with_optimizer)
    attempt("bad", _bad_inputs, root)
    attempt("killed", _killed_save, root)
    return results


# -- the checks ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from dist import run_distributed

    root = tmp_path_factory.mktemp("ckpt")
    return run_distributed(_child, 4, root, str(root / "checkpoints"), timeout=600)


@pytest.fixture(scope="module")
def results8(tmp_path_factory):
    from dist import run_distributed

    root = tmp_path_factory.mktemp("ckpt8")
    return run_distributed(_child, 8, root, str(root / "checkpoints"), timeout=600)


def _per_rank(results, name) -> list:
    from dist import case_results

    return case_results(results, name)


@pytest.mark.parametrize("name", list(RESUME))
def test_resume_is_bit_exact(results, name):
    for rank, r in enumerate(_per_rank(results, name)):
        assert r["client"] == SAVE_AT and r["global_steps"] == SAVE_AT
        assert r["resumed"] == r["full"][SAVE_AT:], (
            f"rank {rank}: resumed {r['resumed']} vs uninterrupted {r['full'][SAVE_AT:]}")
        if "without_rng" in r:
            assert r["without_rng"] != r["full"][SAVE_AT:], "router noise and dropout should depend on the RNG"


@pytest.mark.parametrize("name", list(RESUME))
def test_a_checkpoint_holds_the_training_state_once(results, name):
    counted = _per_rank(results, name)[0]["bytes"]
    # TP ranks each write the entries they hold alike (norms, biases of row-parallel layers): a few
    # percent of this tiny model (hidden 16), nothing at real sizes
    assert 0.98 * counted["state"] <= counted["written"] <= 1.1 * counted["state"], counted


@pytest.mark.parametrize("name", list(RESHARD))
def test_reshard_computes_the_same_function(results, name):
    saved_case, _, with_optimizer = RESHARD[name]
    saved = _per_rank(results, saved_case)
    for rank, r in enumerate(_per_rank(results, name)):
        assert r["global_steps"] == SAVE_AT
        assert r["stale_masters"] == [], f"rank {rank}: optimizer master copies not updated: {r['stale_masters'][:4]}"
        torch.testing.assert_close(r["eval"], saved[0]["eval_at_save"], rtol=1e-6, atol=0)
        if with_optimizer:   # ZeRO-0: Adam moments re-cut by expert id, RNG streams kept (same tp x dp)
            torch.testing.assert_close(torch.tensor(r["resumed"]), torch.tensor(saved[rank]["full"][SAVE_AT:]),
                                       rtol=1e-5, atol=0)


def test_bad_checkpoints_fail_clearly_and_change_nothing(results):
    for r in _per_rank(results, "bad"):
        assert "moe.num_experts: 4 in the checkpoint, 8 in the model" in r["num_experts"], r["num_experts"]
        hidden = "dense embedding.word_embeddings.weight: shape [32, 16] in the checkpoint, [32, 32] in the model"
        assert hidden in r["hidden"], r["hidden"]
        assert "experts/expert_00003_pp_00.safetensors: missing" in r["missing"], r["missing"]
        assert "moe.score_function: 'softmax' in the checkpoint, 'sigmoid' in the model" in r["score_function"], \
            r["score_function"]
        assert "moe.group_topk: None in the checkpoint, 1 in the model" in r["group_topk"], r["group_topk"]
        assert "moe.router_groups: None in the checkpoint, 2 in the model" in r["group_topk"], r["group_topk"]
        for line in ("normalization: 'LayerNorm' in the checkpoint, 'RMSNorm' in the model",
                     "qk_layernorm: False in the checkpoint, True in the model"):
            assert line in r["architecture"], r["architecture"]
        assert "position_embedding_type: 'learned_absolute' in the checkpoint, 'rope' in the model" in r["rope"], r["rope"]
        assert all(r[k + "-unchanged"] for k in ("num_experts", "hidden", "missing", "score_function", "group_topk",
                                                 "architecture", "rope"))
        assert r["older"] == SAVE_AT   # a checkpoint without the newer keys loads as their defaults
        assert "load_optimizer_states=False" in r["older_relaid"] and "ep 2 -> 1" in r["older_relaid"] \
            and "no optimizer record" in r["older_relaid"], r["older_relaid"]


def test_killed_save_leaves_previous_checkpoint(results):
    for r in _per_rank(results, "killed"):
        assert r["latest"] == "first"
        assert r["entries"] == ["first", "latest"], r["entries"]   # the failed save removed its .tmp-second
        assert r["eval_loaded"] == r["eval_first"]
        assert r["entries_after"] == ["first", "latest", "second"], r["entries_after"]


@pytest.mark.parametrize("name", list(PIPE_RESUME))
def test_pipeline_resume_is_bit_exact(request, name):
    world_size, parallel, _ = PIPE_RESUME[name]
    per_rank = _per_rank(request.getfixturevalue("results" if world_size == 4 else "results8"), name)
    stages, mp_slices = parallel["pipeline"], parallel["pipeline"] * parallel.get("tensor", 1)
    for rank, r in enumerate(per_rank):
        assert r["layout"] == {"tensor": 1, "expert_tensor": 1, **parallel}, r["layout"]
        assert r["client"] == PIPE_SAVE_AT and r["global_steps"] == PIPE_SAVE_AT
        assert r["resumed"] == r["full"][PIPE_SAVE_AT:], (
            f"rank {rank}: resumed {r['resumed']} vs uninterrupted {r['full'][PIPE_SAVE_AT:]}")
        # Experts by global id per stage; DeepSpeed's module state per (stage, TP rank), no layer files.
        assert r["experts"] == [f"expert_{e:05d}_pp_{s:02d}.safetensors" for e in range(4) for s in range(stages)]
        assert [f for f in r["files"] if f.startswith("mp_rank_")] == [
            f"mp_rank_{m:02d}_model_states.pt" for m in range(mp_slices)], r["files"]
        assert not [f for f in r["files"] if f.startswith("layer_")], r["files"]


@pytest.mark.parametrize("name", list(PIPE_RESHARD))
def test_pipeline_reshard_computes_the_same_function(request, name):
    saved_case, _, _, with_optimizer = PIPE_RESHARD[name]
    results = request.getfixturevalue("results" if PIPE_RESUME[saved_case][0] == 4 else "results8")
    saved = _per_rank(results, saved_case)
    for rank, r in enumerate(_per_rank(results, name)):
        assert r["global_steps"] == PIPE_SAVE_AT
        torch.testing.assert_close(r["eval"], saved[rank]["eval_at_save"], rtol=1e-6, atol=0)
        if with_optimizer:
            torch.testing.assert_close(torch.tensor(r["resumed"]), torch.tensor(saved[rank]["full"][PIPE_SAVE_AT:]),
                                       rtol=1e-5, atol=0)


def test_pipeline_checkpoint_into_the_plain_engine_loads_weights_only(results):
    for r in _per_rank(results, "pipe-into-plain"):
        assert math.isfinite(r["loaded"]) and r["loaded"] != r["fresh"], r
