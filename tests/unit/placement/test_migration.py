"""Expert migration (``placement/migration.py``) on DeepSpeed's engine, 4 gloo ranks, one spawn.

The proof: with the same seed in fp32, a run that trains ``BEFORE`` steps under the static
placement, migrates both MoE layers to new placements and trains ``AFTER`` more steps gives the
losses and final parameters of a run whose experts started at the new places
(``MoELayer(..., placement=NEW)``). So weights, Adam moments (ZeRO-0: the basic optimizer's
per-parameter state; ZeRO-1/2: the fp32 master partitions and their moments in DeepSpeed's flat
buffers) and the placement buffer all moved together. Right after the migration the model
computes the same outputs as right before (atol 1e-6).

The model: ``tanh(Linear) -> MoE a (F 12) -> MoE b (F 4) -> Linear``, 8 experts, residual MoE
layers with different F, so ZeRO's partition boundaries fall inside experts (ep 2: edp 2).
Layouts ep2, ep4, tp2 x ep2 x etp2 and tp2 x ep2 (EP folded over TP, edp 2) under ZeRO-0/1/2
with Adam or AdamW (torch's); the GPT also in bf16 under ZeRO-1 and ZeRO-2 (fp32 master
partitions and moments move with the bf16 weights; agreement to bf16 rounding). Also: bad placements fail on every rank with a message naming the
value, migrating inside a ZeRO-1/2 step is refused, and a checkpoint saved one step after the
migration loads into a fresh (static) model with the checkpoint's placement and weights and
resumes the migrated run's losses bit for bit (so the ZeRO optimizer state fits the placement).

The same proof on DeepSpeed's ``PipelineEngine`` (pp 2 x ep 2, ZeRO-1, the tiny GPT cut into
stages): each stage migrates its own layer, at the step boundary after ``train_batch``.

``test_migration_cost`` measures one migration of a realistic layer (64 experts, H 512, F 1024,
ep 4, half the experts changing rank, weights and gradients) and prints bytes and seconds per byte.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist import attempts, case_results, run_distributed
from moe_plugin.configs import MoEConfig
from moe_plugin.layers import MoELayer
from moe_plugin.placement.migration import check_placement, moved_bytes
import ds_json

S, B, H, E = 4, 8, 8, 8
BEFORE, AFTER = 2, 3
TOL = dict(rtol=1e-5, atol=1e-6)
MOE = {"num_experts": E, "router": "topk", "top_k": 2, "drop_tokens": False, "aux_loss_coeff": 0.0,
       "z_loss_coeff": 0.1}
# slot of expert e, per layer: experts change EP rank and local index at ep 2 and ep 4
NEW = {"moe_a": [5, 0, 2, 7, 1, 4, 3, 6], "moe_b": [1, 0, 6, 7, 4, 5, 2, 3]}
LAYOUTS = {"ep2": {"expert": 2}, "ep4": {"expert": 4}, "tp2-ep2-etp2": {"tensor": 2, "expert": 2},
           "tp2-ep2": {"tensor": 2, "expert": 2, "expert_tensor": 1}}
CASES = {"ep2/zero0/adamw": ("ep2", 0, "AdamW"), "ep2/zero1/adam": ("ep2", 1, "Adam"),
         "ep2/zero2/adamw": ("ep2", 2, "AdamW"), "ep4/zero0/adam": ("ep4", 0, "Adam"),
         "ep4/zero1/adamw": ("ep4", 1, "AdamW"), "ep4/zero2/adam": ("ep4", 2, "Adam"),
         "tp2-ep2-etp2/zero0/adamw": ("tp2-ep2-etp2", 0, "AdamW"),
         "tp2-ep2-etp2/zero1/adam": ("tp2-ep2-etp2", 1, "Adam"), "tp2-ep2/zero2/adamw": ("tp2-ep2", 2, "AdamW"),
         "gpt/tp2-ep2/zero1/adamw": ("tp2-ep2", 1, "AdamW"), "gpt/ep2/zero1/adamw/bf16": ("ep2", 1, "AdamW"),
         "gpt/ep4/zero2/adam/bf16": ("ep4", 2, "Adam")}
# bf16 (DeepSpeed's ZeRO optimizer keeps fp32 master partitions and moments; the model computes in
# bf16): the two runs sum expert gradients in other orders, so they agree to bf16 rounding
BF16_TOL = dict(rtol=2e-2, atol=2e-2)
# the GPT case: tests/gpt_tiny.py's 4-layer GPT, every layer MoE; two of them migrate
GPT_NEW = {1: NEW["moe_a"], 3: NEW["moe_b"]}


class TwoMoE(nn.Module):
    def __init__(self, moe_config: MoEConfig, groups=None, placements: dict | None = None):
        super().__init__()
        placements = placements or {}
        self.inp = nn.Linear(H, H)
        self.moe_a = MoELayer(moe_config, H, 12, groups, seed=3, init_std=0.3, placement=placements.get("moe_a"))
        self.moe_b = MoELayer(moe_config, H, 4, groups, seed=4, init_std=0.3, placement=placements.get("moe_b"))
        self.out = nn.Linear(H, H)
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in (*self.inp.parameters(), *self.out.parameters()):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)

    def predict(self, x_SBH):
        h = torch.tanh(self.inp(x_SBH))
        h = h + self.moe_a(h)[0]
        return self.out(h + self.moe_b(h)[0])

    def forward(self, x_SBH, y_SBH):
        return F.mse_loss(self.predict(x_SBH), y_SBH)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)


def _gpt(placements: dict | None):
    def build(moe_config, groups):
        from megatron.core.models.gpt import GPTModel

        from gpt_tiny import MODEL, SEQ, VOCAB, transformer_config
        from moe_plugin.integration.megatron import gpt_moe_spec

        config = transformer_config(MODEL, groups.layout.sizes.tp)
        torch.manual_seed(0)
        indices = None if placements is None else {int(k.split(".")[2]): v for k, v in placements.items()}
        return GPTModel(config, gpt_moe_spec(moe_config, config, groups, placements=indices), vocab_size=VOCAB,
                        max_sequence_length=SEQ)
    return build


def _new(gpt: bool) -> dict:
    return {f"decoder.layers.{i}.mlp": slots for i, slots in GPT_NEW.items()} if gpt else NEW


def _engine(layout: str, stage: int, opt: str, placements: dict | None = None, gpt: bool = False,
            bf16: bool = False):
    import moe_plugin

    dp = 4 // LAYOUTS[layout].get("tensor", 1)
    cfg = ds_json.ds_config(batch=B, dp=dp, zero=stage, moe=MOE, parallel=LAYOUTS[layout],
                            optimizer={"type": opt, "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
                            zero_allow_untested_optimizer=True)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if gpt:
        return moe_plugin.initialize(cfg, _gpt(placements))
    return moe_plugin.initialize(cfg, lambda moe_config, groups: TwoMoE(moe_config, groups, placements))


def _inputs(run, step: int, rows: slice):
    """(args, kwargs) of the model on this rank's share of batch ``step``."""
    if isinstance(run.engine.module, TwoMoE):
        x, y = batch(step)
        return (x[:, rows], y[:, rows]), {}
    from gpt_tiny import global_batch

    tokens, positions, labels = (t[rows] for t in global_batch(step, B))
    return (tokens, positions, None), {"labels": labels}


def _train(run, steps: range) -> list[float]:
    engine = run.engine
    c = run.groups.layout.coords(torch.distributed.get_rank())
    micro = B // run.groups.layout.sizes.dp
    losses = []
    for step in steps:
        args, kwargs = _inputs(run, step, slice(c["dp"] * micro, (c["dp"] + 1) * micro))
        loss = engine(*args, **kwargs).float().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _predict(run) -> torch.Tensor:
    model = run.engine.module
    with torch.no_grad():
        if isinstance(model, TwoMoE):
            return model.predict(batch(999)[0]).clone()
        args, _ = _inputs(run, 999, slice(0, B))
        return model(*args).clone()   # logits


def _state(run) -> dict:
    return {k: v.detach().clone() for k, v in run.engine.module.state_dict().items() if isinstance(v, torch.Tensor)}


def _case(root: str, name: str, layout: str, stage: int, opt: str) -> dict:
    from moe_plugin.checkpoint import load_checkpoint, save_checkpoint
    from moe_plugin.placement.migration import migrate

    out = {}
    gpt, bf16 = name.startswith("gpt"), name.endswith("bf16")
    new = _new(gpt)
    run = _engine(layout, stage, opt, gpt=gpt, bf16=bf16)
    try:
        out["losses"] = _train(run, range(BEFORE))
        before = _predict(run)
        report = migrate(run, {k: torch.tensor(v) for k, v in new.items()})
        out["report"] = report
        out["same_function"] = (before - _predict(run)).abs().max().item()
        out["losses"] += _train(run, range(BEFORE, BEFORE + 1))
        save_checkpoint(run, os.path.join(root, name.replace("/", "-")))
        out["saved_state"] = _state(run)
        out["losses"] += _train(run, range(BEFORE + 1, BEFORE + AFTER))
        out["state"] = _state(run)
        if stage == 0 and layout == "ep2":
            out["errors"] = _bad_placements(run)
    finally:
        run.close()
    run = _engine(layout, stage, opt, new, gpt=gpt, bf16=bf16)
    try:
        out["reference"] = _train(run, range(BEFORE + AFTER))
        out["reference_state"] = _state(run)
        if stage > 0:
            out["inside_step"] = _inside_step(run)
    finally:
        run.close()
    run = _engine(layout, stage, opt, gpt=gpt, bf16=bf16)   # static placement: the checkpoint's must win
    try:
        load_checkpoint(run, os.path.join(root, name.replace("/", "-")))
        out["loaded_state"] = _state(run)
        out["resumed"] = _train(run, range(BEFORE + 1, BEFORE + AFTER))
    finally:
        run.close()
    return out


def _bad_placements(run) -> dict:
    from moe_plugin.placement.migration import migrate

    out = {}
    bad = {"size": {"moe_a": torch.arange(E - 1)}, "dup": {"moe_a": torch.tensor([0, 0, 2, 3, 4, 5, 6, 7])},
           "layer": {"moe_c": torch.arange(E)}, "float": {"moe_b": torch.arange(E).float()}}
    for key, placements in bad.items():
        with pytest.raises(ValueError) as failure:
            migrate(run, placements)
        out[key] = str(failure.value)
    return out


def _inside_step(run) -> str:
    from moe_plugin.placement.migration import migrate

    args, kwargs = _inputs(run, 0, slice(0, B // run.groups.layout.sizes.dp))
    run.engine.backward(run.engine(*args, **kwargs).float().mean())
    with pytest.raises(ValueError) as failure:
        migrate(run, {next(iter(_new(not isinstance(run.engine.module, TwoMoE)))): torch.arange(E)})
    return str(failure.value)


# -- DeepSpeed's PipelineEngine: pp 2 x ep 2, ZeRO-1; every layer MoE, layer 1 (stage 0) and 3 (stage 1) migrate
PIPE_BATCH, PIPE_GAS = 8, 2


def _pipeline_engine(placements: dict | None):
    import moe_plugin

    from gpt_tiny import MODEL, SEQ, VOCAB, transformer_config
    from moe_plugin.integration.pipeline import gpt_pipeline_module

    cfg = ds_json.ds_config(batch=PIPE_BATCH, dp=2, gas=PIPE_GAS, moe=MOE, parallel={"pipeline": 2, "expert": 2},
                            optimizer={"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}})

    def build(moe_config, groups):
        return gpt_pipeline_module(transformer_config(MODEL, 1, 2), moe_config, groups, vocab_size=VOCAB,
                                   max_sequence_length=SEQ, seed=0, placements=placements)
    return moe_plugin.initialize(cfg, build)


def _pipeline_batches(run, step: int):
    from gpt_tiny import micro_batches

    c, sizes = run.groups.layout.coords(torch.distributed.get_rank()), run.groups.layout.sizes
    return iter(micro_batches(step, PIPE_BATCH, c["dp"], sizes.dp, PIPE_GAS))


def _pipeline_case() -> dict:
    """Train, migrate this stage's layer (``<piece>.layer.mlp``, piece = 1 + layer), train on;
    then the reference run built with the experts at their new places."""
    import re

    from moe_plugin.layers.moe_layer import moe_layers
    from moe_plugin.placement.migration import migrate

    out = {}
    run = _pipeline_engine(None)
    try:
        out["losses"] = [float(run.engine.train_batch(_pipeline_batches(run, s))) for s in range(BEFORE)]
        before = run.engine.eval_batch(_pipeline_batches(run, 999)).item()
        names = {name: int(re.match(r"^(\d+)\.layer\.mlp$", name).group(1)) - 1
                 for name in moe_layers(run.engine.module)}
        moves = {name: torch.tensor(GPT_NEW[i]) for name, i in names.items() if i in GPT_NEW}
        out["moved_layers"] = sorted(names[n] for n in moves)
        out["report"] = migrate(run, moves)
        out["same_function"] = abs(before - run.engine.eval_batch(_pipeline_batches(run, 999)).item())
        out["losses"] += [float(run.engine.train_batch(_pipeline_batches(run, s)))
                          for s in range(BEFORE, BEFORE + AFTER)]
        out["state"] = _state(run)
    finally:
        run.close()
    run = _pipeline_engine(GPT_NEW)
    try:
        out["reference"] = [float(run.engine.train_batch(_pipeline_batches(run, s))) for s in range(BEFORE + AFTER)]
        out["reference_state"] = _state(run)
    finally:
        run.close()
    return out


def _cases_child(rank: int, world_size: int, root: str, cases: dict) -> dict:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    results = {}
    jobs = {name: (lambda case=case, name=name: _case(root, name, *case)) for name, case in cases.items()}
    jobs["pipe/pp2-ep2/zero1/adamw"] = _pipeline_case
    attempt = attempts(results, rank)
    for name, job in jobs.items():
        attempt(name, job)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("migration")
    return run_distributed(_cases_child, 4, root, str(root), CASES, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_migration_matches_a_run_started_at_the_new_placement(name, results):
    for rank, r in enumerate(case_results(results, name)):
        tol = BF16_TOL if name.endswith("bf16") else TOL
        assert r["same_function"] <= tol["atol"], f"rank {rank}: outputs changed by {r['same_function']} at migration"
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["reference"]), **tol)
        for key, value in r["reference_state"].items():
            if name.endswith("bf16") and value.dtype == torch.bfloat16:   # compare the values, not the rounding
                value, r["state"][key] = value.float(), r["state"][key].float()
            torch.testing.assert_close(r["state"][key], value, **tol, msg=lambda m: f"rank {rank} {key}: {m}")
        key = "decoder.layers.1.mlp.experts.placement" if name.startswith("gpt") else "moe_a.experts.placement"
        assert r["state"][key].tolist() == NEW["moe_a"]
        assert r["report"].moved_experts == 13  # NEW leaves expert 2 of moe_a, 4 and 5 of moe_b in place


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_checkpoint_load_takes_the_saved_placement(name, results):
    for rank, r in enumerate(case_results(results, name)):
        for key, value in r["saved_state"].items():
            assert torch.equal(r["loaded_state"][key], value), f"rank {rank} {key}"
        assert r["resumed"] == r["losses"][BEFORE + 1:], f"rank {rank}"   # optimizer state too, bit for bit


@pytest.mark.slow
def test_bad_placements_fail_on_every_rank(results):
    for per_rank in results:
        errors = per_rank["ep2/zero0/adamw"]["errors"]
        assert "expected 8 integer slots" in errors["size"] and "moe_a" in errors["size"]
        assert "[0, 0, 2, 3, 4, 5, 6, 7] is not a permutation" in errors["dup"]
        assert "unknown MoE layer(s) ['moe_c']" in errors["layer"] and "['moe_a', 'moe_b']" in errors["layer"]
        assert "dtype torch.float32" in errors["float"]


@pytest.mark.slow
def test_zero_refuses_to_migrate_inside_a_step(results):
    for per_rank in results:
        for name, r in per_rank.items():
            if "inside_step" in r:
                assert "needs a step boundary" in r["inside_step"], r["inside_step"]


@pytest.mark.slow
def test_pipeline_engine_migration_matches_a_run_started_at_the_new_placement(results):
    """PipelineEngine (pp 2 x ep 2, ZeRO-1): each stage migrates its own MoE layer; the losses
    (every rank sees the batch loss) and every stage's parameters follow the reference run."""
    for rank, r in enumerate(case_results(results, "pipe/pp2-ep2/zero1/adamw")):
        assert r["moved_layers"] == ([1] if rank < 2 else [3]), (rank, r["moved_layers"])   # stage 0: ranks 0, 1
        assert r["same_function"] <= 1e-6, f"rank {rank}: the loss changed by {r['same_function']} at migration"
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["reference"]), **TOL)
        assert r["reference_state"].keys() == r["state"].keys()
        for key, value in r["reference_state"].items():
            torch.testing.assert_close(r["state"][key], value, **TOL, msg=lambda m: f"rank {rank} {key}: {m}")
        assert r["report"].moved_experts > 0


def test_check_placement_and_moved_bytes():
    assert check_placement([1, 0, 2], 3).tolist() == [1, 0, 2]
    with pytest.raises(ValueError, match=r"placement: \[1, 1, 2\] is not a permutation"):
        check_placement([1, 1, 2], 3)
    # ep 2, L 2: expert 0 stays on rank 0 (slot 0 -> 1), experts 1 and 2 swap ranks, 3 stays
    assert moved_bytes([0, 1, 2, 3], [1, 2, 0, 3], 2, 10) == 20


@pytest.mark.slow
def test_a_rank_with_nothing_to_move_joins_on_the_accelerators_device(monkeypatch):
    """A rank without a tensor of a dtype (a stage without MoE layers) still joins that dtype's
    all-to-all: its empty buffers live on DeepSpeed's accelerator's device (NCCL takes no CPU
    tensor), here a faked one; a rank with tensors uses theirs."""
    import deepspeed.accelerator
    from moe_plugin.placement.pieces import Pieces, exchange

    class FakeAccelerator:
        def current_device_name(self):
            return "meta"

    calls = []
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", FakeAccelerator)
    monkeypatch.setattr(torch.distributed, "all_to_all_single",
                        lambda out, inp, out_splits, in_splits: calls.append((out.device, inp.device, out.dtype)))
    exchange(Pieces(), 2, [torch.float32, torch.bfloat16])
    meta = torch.device("meta")
    assert calls == [(meta, meta, torch.float32), (meta, meta, torch.bfloat16)]
    calls.clear()
    pieces = Pieces()
    pieces.add_tensor(torch.zeros(4))
    exchange(pieces, 2, [torch.float32])
    assert calls == [(torch.device("cpu"), torch.device("cpu"), torch.float32)]


# -- cost ------------------------------------------------------------------------------------------
COST = dict(E=64, H=512, F=1024)


def _cost_child(rank: int, world_size: int) -> dict:
    from moe_plugin.groups.builder import build_process_groups, destroy_process_groups
    from moe_plugin.groups.layout import RankLayout
    from moe_plugin.placement.migration import expert_bytes, migrate

    groups = build_process_groups(RankLayout.build(world_size, ep=world_size))
    try:
        config = MoEConfig.from_dict({"num_experts": COST["E"], "router": "topk", "top_k": 2,
                                      "parallel": {"expert": world_size}})
        layer = MoELayer(config, COST["H"], COST["F"], groups)
        for w in (layer.experts.weight1, layer.experts.weight2):
            w.grad = torch.ones_like(w)
        # half the experts change EP rank: the odd experts rotate by one rank
        local = COST["E"] // world_size
        new = torch.tensor([e if e % 2 == 0 else (e + local) % COST["E"] for e in range(COST["E"])])
        old = layer.placement.clone()
        torch.distributed.barrier()
        start = time.perf_counter()
        report = migrate(layer, {"": new}, groups=groups)
        torch.distributed.barrier()
        wall = time.perf_counter() - start
        per_expert = expert_bytes(layer, zero_stage=0, with_grads=True, state_tensors=0)
        return {"report": report, "wall": wall, "predicted": moved_bytes(old, new, world_size, per_expert)}
    finally:
        destroy_process_groups(groups)


@pytest.mark.slow
def test_migration_cost(tmp_path):
    results = run_distributed(_cost_child, 4, tmp_path, timeout=300)
    sent = sum(r["report"].sent_bytes for r in results)
    wall = max(r["wall"] for r in results)
    assert sent == results[0]["predicted"] == 32 * 2 * 2 * COST["H"] * COST["F"] * 4
    print(f"\nmigration of {COST['E']} experts H {COST['H']} F {COST['F']} on 4 ranks (ep 4), 32 changing rank, "
          f"weights + grads: {sent / 2 ** 20:.0f} MiB sent, {wall:.3f} s wall (slowest rank, collectives "
          f"included), {wall / sent * 1e9:.2f} s/GB")


class OneMoE(nn.Module):
    def __init__(self, moe_config: MoEConfig, groups=None):
        super().__init__()
        self.moe = MoELayer(moe_config, COST["H"], COST["F"], groups)

    def forward(self, x_SBH, y_SBH):
        return F.mse_loss(self.moe(x_SBH)[0], y_SBH)


def _cost_engine_child(rank: int, world_size: int, ep: int, stage: int) -> dict:
    """A training state (one AdamW step under ZeRO ``stage``: weights, fp32 master, moments) of
    the realistic layer; half the experts change EP rank."""
    import moe_plugin
    from moe_plugin.placement.migration import expert_bytes, migrate

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    cfg = ds_json.ds_config(batch=4, micro=1, dp=world_size, zero=stage, clip=None,
                    optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                    moe={"num_experts": COST["E"], "router": "topk", "top_k": 2, "drop_tokens": False},
                    parallel={"expert": ep})
    run = moe_plugin.initialize(cfg, OneMoE)
    try:
        gen = torch.Generator().manual_seed(rank)
        x, y = torch.randn(16, 1, COST["H"], generator=gen), torch.randn(16, 1, COST["H"], generator=gen)
        run.engine.backward(run.engine(x, y))
        run.engine.step()
        local = COST["E"] // ep
        new = torch.tensor([e if e % 2 == 0 else (e + local) % COST["E"] for e in range(COST["E"])])
        layer = run.engine.module.moe
        old = layer.placement.clone()
        torch.distributed.barrier()
        start = time.perf_counter()
        report = migrate(run, {"moe": new})
        torch.distributed.barrier()
        wall = time.perf_counter() - start
        per_expert = expert_bytes(layer, zero_stage=stage, state_tensors=2)
        return {"report": report, "wall": wall, "predicted": moved_bytes(old, new, ep, per_expert)}
    finally:
        run.close()


@pytest.mark.slow
@pytest.mark.parametrize("ep, stage", [(4, 0), (2, 1)])
def test_migration_cost_of_a_training_state(tmp_path, ep, stage):
    results = run_distributed(_cost_engine_child, 4, tmp_path, ep, stage, timeout=300)
    sent = sum(r["report"].sent_bytes for r in results)
    wall = max(r["wall"] for r in results)
    assert sent == results[0]["predicted"]
    print(f"\nmigration under ZeRO-{stage}, ep {ep} x edp {4 // ep}, {COST['E']} experts H {COST['H']} F {COST['F']}, "
          f"{results[0]['report'].crossing_experts} changing rank, weights + AdamW state: {sent / 2 ** 20:.0f} MiB "
          f"sent, {wall:.3f} s wall, {wall / sent * 1e9:.2f} s/GB")
