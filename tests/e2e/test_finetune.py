"""Fine-tuning through the example on chat data (``moe-plugin preprocess --chat``'s layout): packed
conversations whose loss is the global batch's masked-token mean at any layout, runs that say what they
do with a checkpoint (``--finetune``, stale resumes refused), and ``--skip-train`` validation."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dist import run_distributed
from example_runs import run_main_printing, train_losses
from tests.unit.data.test_packing import write_chat
from ds_json import ds_config, write_ds_config

pytestmark = pytest.mark.slow   # spawned ranks

STEPS = 3
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
         "--seq-length", "32", "--eval-interval", "0", "--eval-iters", "1", "--log-interval", "1", "--seed", "3",
         "--valid-fraction", "0.25", "--position-embedding-type", "rope", "--no-plot", "--vocab-size", "64"]
# aux-loss-free balancing (the load of real tokens summed over the ranks moves the expert bias every step): a
# balance loss is formed per micro-batch (or, global, from the micro-batches so far), so it depends on the
# micro-batch size and accumulation by definition
MOE = {"num_experts": 4, "router": "topk", "top_k": 2, "drop_tokens": False, "aux_loss_coeff": 0.0,
       "bias_update_rate": 0.01, "layer_interval": 1}


def chat_lengths(n: int = 48, seed: int = 1) -> list[int]:
    """Skewed lengths: many short conversations, a few long ones (up to a whole sequence)."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.geometric(0.12, n) + 2, 3, 32).tolist()


def config(path: Path, world_size: int, micro: int, parallel: dict, scheduler: dict | None = None) -> str:
    dp = world_size // (parallel.get("tensor", 1) * parallel.get("pipeline", 1))
    extra = {} if scheduler is None else {"scheduler": scheduler}
    return write_ds_config(path, batch=8, micro=micro, dp=dp, zero=0 if parallel.get("pipeline", 1) > 1 else 1, moe=MOE,
                           parallel=parallel, **extra)


def run(tmp_path: Path, name: str, world_size: int, micro: int, parallel: dict, *extra: str,
        scheduler: dict | None = None, expect: int = 0) -> dict:
    argv = [*FLAGS, "--data-path", str(tmp_path / "chat"), "--run-dir", str(tmp_path / "runs" / name),
            "--deepspeed_config", config(tmp_path / f"{name}.json", world_size, micro, parallel, scheduler), *extra]
    results = run_distributed(run_main_printing, world_size, tmp_path, argv, timeout=400)
    assert [r["status"] for r in results] == [expect] * world_size, results[0]["out"][-3000:]
    return results[0]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("chat")
    write_chat(directory / "chat", chat_lengths())
    write_chat(directory / "held_out", chat_lengths(12, seed=9), seed=5)
    return directory


LAYOUTS = {   # name -> world size, micro-batch size, moe.parallel (global batch 8 packs)
    "dp2-acc1": (2, 4, {}),
    "dp2-acc2": (2, 2, {}),
    "pp2-acc4": (2, 2, {"pipeline": 2}),
    "ep2-acc1": (2, 4, {"expert": 2}),
}


def test_the_loss_does_not_depend_on_the_layout(chat_dir):
    """Packed chat data: the losses of 3 steps (and so the gradients that made them) and the validation
    loss over every held-out conversation at dp1 with accumulation 2 equal those at dp2 (accumulation 1
    and 2), pp2 (accumulation 4) and ep2: the loss is the global batch's sum over its loss tokens divided
    by their count, not a mean of micro-batch means."""
    one = run(chat_dir, "one-acc2", 1, 4, {}, "--train-iters", str(STEPS))
    assert "packing efficiency" in one["out"] and "validation loss" in one["out"]
    want = train_losses(chat_dir / "runs" / "one-acc2")
    assert len(want) == STEPS
    for name, (world, micro, parallel) in LAYOUTS.items():
        run(chat_dir, name, world, micro, parallel, "--train-iters", str(STEPS))
        got = train_losses(chat_dir / "runs" / name)
        assert list(got.values()) == pytest.approx(list(want.values()), rel=1e-5), (name, got, want)
        assert _valid(chat_dir / "runs" / name) == pytest.approx(_valid(chat_dir / "runs" / "one-acc2"), rel=1e-5)


def _valid(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["split"] == "valid"]


def test_resumes_that_would_train_nothing_are_refused(chat_dir):
    """A --load at or past --train-iters, and one whose scheduler has ended, exit 2 with one line;
    --finetune trains the weights from step 0 with the JSON's schedule; --skip-train validates the
    checkpoint's weights on --valid-data-path, alike on 1 and 2 ranks."""
    decay = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 1,
                                                 "total_num_steps": 3}}   # lr 0 from step 4 on
    ckpt = str(chat_dir / "ckpt")
    run(chat_dir, "first", 1, 8, {}, "--train-iters", "4", "--save", ckpt, scheduler=decay)
    stale = run(chat_dir, "stale", 1, 8, {}, "--train-iters", "4", "--load", ckpt, scheduler=decay, expect=2)
    assert "--train-iters: got 4; --load " in stale["out"] and "has trained 4 steps already" in stale["out"]
    ended = run(chat_dir, "ended", 1, 8, {}, "--train-iters", "6", "--load", ckpt, scheduler=decay, expect=2)
    assert "lr scheduler gives lr 0 for every step to come (steps 5-6" in ended["out"], ended["out"][-2000:]
    tuned = run(chat_dir, "tuned", 1, 8, {}, "--train-iters", "2", "--load", ckpt, "--finetune", scheduler=decay)
    assert "fine-tuning the weights of" in tuned["out"]
    records = [json.loads(line) for line in (chat_dir / "runs" / "tuned" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and train[-1]["lr"] > 0
    fresh = train_losses(chat_dir / "runs" / "first")
    assert train[0]["loss"] < fresh[1]   # the fine-tuned weights start where the first run left them
    values = []
    for world in (1, 2):
        out = run(chat_dir, f"skip{world}", world, 8 // world, {}, "--load", ckpt, "--skip-train",
                  "--valid-data-path", str(chat_dir / "held_out"))["out"]
        line = [x for x in out.splitlines() if "validation loss" in x][-1]
        values.append(float(line.split("validation loss")[1]))
        assert not (chat_dir / "runs" / f"skip{world}" / "metrics.png").exists()
    assert values[0] == pytest.approx(values[1], rel=1e-5)
    own = run_distributed(_own_loop_validation, 2, chat_dir, ckpt, str(chat_dir / "held_out"), timeout=300)
    assert own[0] == pytest.approx(values[0], rel=1e-5)   # a script of one's own: the example's number
    missing = run(chat_dir, "nothing", 1, 8, {}, "--load", str(chat_dir / "none"), "--finetune", expect=2)
    assert "--finetune trains the weights of a checkpoint, and there is none there" in missing["out"]


def test_a_frozen_router_keeps_its_expert_bias(chat_dir):
    """--freeze-router with aux-loss-free balancing: the expert bias does not move (Megatron-LM #4785: it
    kept moving); without it, it does."""
    for name, extra, moves in (("frozen", ("--freeze-router",), False), ("free", (), True)):
        run(chat_dir, name, 1, 8, {}, "--train-iters", "2", *extra)
        records = [json.loads(line) for line in (chat_dir / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        biases = [layer["expert_bias"] for r in records if r["split"] == "train" for layer in r["moe_layers"]]
        assert biases and any(any(b != 0 for b in bias) for bias in biases) == moves, (name, biases)


def _own_loop_validation(rank: int, world_size: int, ckpt: str, held_out: str) -> float:
    """docs/fine_tuning.md's own loop, evaluating: the checkpoint's model built from its record
    (``checkpoint_model_provider``, no model flags, nothing of the example), the held-out conversations
    packed, the loss over all their loss tokens, on ``world_size`` data-parallel ranks."""
    import os

    import torch
    import torch.distributed as dist

    import moe_plugin
    from moe_plugin.data import PackedConversations, micro_batch_rows, read_chat_dataset
    from moe_plugin.data.packing import padded_indices

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    ds = ds_config(batch=8, micro=4, gas=1, zero=None, clip=None, optimizer={"type": "AdamW", "params": {"lr": 1e-3}},
                   moe=MOE, parallel={})
    run = moe_plugin.initialize(ds, moe_plugin.checkpoint_model_provider(ckpt), print_summary=False)
    try:
        moe_plugin.load_checkpoint(run, ckpt, load_optimizer_states=False)
        tokens, mask = read_chat_dataset(held_out)
        packs = PackedConversations(tokens, mask, range(len(tokens)), 32)
        every = padded_indices(len(packs), 8)
        count = packs.loss_tokens(every)
        total = torch.zeros(())
        run.engine.eval()
        with torch.no_grad():
            for first in range(0, len(every), 8):
                rows = micro_batch_rows(every[first:first + 8], rank, world_size, 4)
                total += moe_plugin.packed_loss(run.engine, packs.batch(rows), count, 1)
        dist.all_reduce(total)
        return float(total)
    finally:
        run.close()
