"""The example trains one model under every layout: pipeline and sequence-parallel runs give the 1-rank losses.

``examples/gpt_moe/pretrain_gpt_moe.py`` (its ``main``, on gloo ranks as the launcher would start it)
trains 8 steps of the same global batches, seed 7, with dropless GShard routing whose second expert
is deterministic (``second_expert_policy: "all"``) and the example's optimizer (AdamW warmed up over
20 steps), on 1 rank and under pp2 x ep2 (ZeRO-0), tp2 x pp2
x ep2 and pp2 x dp2 x ep2 (ZeRO-1, the second with 2 micro-batches per replica), and tp2 x ep2
with sequence parallelism (ZeRO-1: Megatron's RNG tracker and sequence-parallel buffers on the CPU
are what ``moe_plugin.initialize`` sets up, ``compat/megatron_cpu.py``). The per-step
training losses must equal the one-rank run's to 1e-4 relative: the pipeline stages hold the
one-rank ``GPTModel``'s weights, the word embedding and output layer tied across the first and last
stage as the one-rank model ties them (the example's default, Megatron-LM's), and the same with
``--untie-embeddings-and-output-weights``. A pp2 x ep2 checkpoint loads into the one-rank
``GPTModel`` and a checkpoint of that loads back into pp2 x ep2, with the one-rank run's losses.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist import run_distributed
from example_runs import MODEL_FLAGS, run_main

pytestmark = pytest.mark.slow   # through the deepspeed launcher or several processes

STEPS = 8
MOE = {"num_experts": 4, "router": "gshard", "second_expert_policy": "all", "drop_tokens": False,
       "aux_loss_coeff": 0.01, "layer_interval": 1}
# name -> world size, moe.parallel, ZeRO stage
LAYOUTS = {
    "pp2-ep2": (4, {"pipeline": 2, "expert": 2}, 0),
    "tp2-pp2-ep2": (4, {"tensor": 2, "pipeline": 2, "expert": 2, "expert_tensor": 1}, 1),
    "pp2-dp2-ep2": (4, {"pipeline": 2, "expert": 2}, 1),
    "tp2sp-ep2": (4, {"tensor": 2, "expert": 2, "sequence_parallel": True}, 1),
}
BATCH, MICRO = 8, 2
# the example's JSON (configs/tiny_cpu_4rank.json): AdamW warmed up over 20 steps
OPTIMIZER = {"optimizer": {"type": "AdamW", "params": {"lr": 0.002, "betas": [0.9, 0.95], "eps": 1e-08,
                                                       "weight_decay": 0.1, "torch_adam": True}},
             "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.002,
                                                          "warmup_num_steps": 20}}}


def _ds_config(path: Path, dp: int, parallel: dict, stage: int) -> Path:
    config = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": MICRO,
              "gradient_accumulation_steps": BATCH // (MICRO * dp), "gradient_clipping": 1.0,
              "steps_per_print": 10 ** 6, **OPTIMIZER,
              "zero_optimization": {"stage": stage}, "moe": {**MOE, "parallel": parallel}}
    path.write_text(json.dumps(config))
    return path


def _losses(tmp_path: Path, name: str, world_size: int, parallel: dict, stage: int, *extra: str,
            first_step: int = 1) -> list[float]:
    tp, pp = parallel.get("tensor", 1), parallel.get("pipeline", 1)
    run_dir = tmp_path / "runs" / name
    flags = [f for f in MODEL_FLAGS]
    flags[flags.index("--train-iters") + 1] = str(STEPS)   # a later --train-iters in extra wins
    flags[flags.index("--eval-interval") + 1] = "0"
    argv = [*flags, "--micro-batch-size", str(MICRO),
            "--deepspeed_config", str(_ds_config(tmp_path / f"{name}.json", world_size // (tp * pp), parallel, stage)),
            "--run-dir", str(run_dir), "--data-cache", str(tmp_path / "data"), *extra]
    results = run_distributed(run_main, world_size, tmp_path, argv, timeout=400)
    assert [r["status"] for r in results] == [0] * world_size
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    last = int(extra[extra.index("--train-iters") + 1]) if "--train-iters" in extra else STEPS
    assert [r["step"] for r in train] == list(range(first_step, last + 1))
    return [r["loss"] for r in train]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts")


@pytest.fixture(scope="module")
def one_rank(data_dir) -> list[float]:
    """The one-rank run (tied embeddings): the reference of the tied layouts and of the checkpoint's
    uninterrupted run."""
    return _losses(data_dir, "one-tied", 1, {}, 1)


@pytest.mark.parametrize("tie", ["tied", "untied"])
def test_pipeline_layouts_give_the_one_rank_losses(data_dir, one_rank, tie):
    extra = ("--untie-embeddings-and-output-weights",) if tie == "untied" else ()
    one = one_rank if tie == "tied" else _losses(data_dir, f"one-{tie}", 1, {}, 1, *extra)
    names = list(LAYOUTS) if tie == "tied" else ["pp2-dp2-ep2"]
    for name in names:
        world, parallel, stage = LAYOUTS[name]
        got = _losses(data_dir, f"{name}-{tie}", world, parallel, stage, *extra)
        assert got == pytest.approx(one, rel=1e-4), (name, got, one)


def test_pipeline_checkpoint_loads_into_the_one_rank_gpt_model_and_back(data_dir, one_rank):
    """pp2 x ep2 saves after 4 steps; the one-rank ``GPTModel`` loads it (weights only: another
    model kind) and its step 5 is the uninterrupted one-rank run's; it saves after step 6, and pp2 x
    ep2 and the one-rank model both load that and compute the same step-7 loss."""
    world, parallel, stage = LAYOUTS["pp2-ep2"]
    uninterrupted = one_rank
    first, second = str(data_dir / "ckpt-pp2"), str(data_dir / "ckpt-one")
    _losses(data_dir, "ckpt-pp2-a", world, parallel, stage, "--train-iters", "4", "--save", first)
    resumed = _losses(data_dir, "ckpt-one-b", 1, {}, 1, "--train-iters", "6", "--load", first, "--no-load-optim",
                      "--save", second, first_step=5)
    assert resumed[0] == pytest.approx(uninterrupted[4], rel=1e-4), (resumed, uninterrupted)
    pipe = _losses(data_dir, "ckpt-pp2-c", world, parallel, stage, "--train-iters", "7", "--load", second,
                   "--no-load-optim", first_step=7)
    one = _losses(data_dir, "ckpt-one-c", 1, {}, 1, "--train-iters", "7", "--load", second, "--no-load-optim",
                  first_step=7)
    assert pipe == pytest.approx(one, rel=1e-5), (pipe, one)
