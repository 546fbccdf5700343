"""The run summary's memory estimate against the peak a run really reaches, and the stop at start
when it does not fit (``moe_plugin/integration/memory_estimate.py``).

The example, under the ``deepspeed`` launcher, trains a Mixtral-shaped model at 2 and 4 layers on 2
ranks (ep 2, ZeRO-1, fp32, sequence 128) and saves at the end; each writes the whole run's peak RSS
per rank beside the estimate (``runs/<name>/memory.json``). The estimate must be within 20% of the
busiest rank's peak at both sizes, and its growth from 2 to 4 layers within 20% of the peak's
growth (that difference has no runtime baseline in it: only what the plugin models per parameter);
the save at the end may add at most 10% to the peak of the steps before it (logged at each step).
A sequence whose attention scores alone would need ~2 TB is refused before any step, in one line.
The three runs go at once (peaks are per process: the others' memory is not in them). Sequence 128,
not 256, halves the steps' work: the activations are 2-3% of the estimate at either length, and the
three ratios measured at 256 and at 128 were the same to 0.005 (0.89, 0.98 and 1.14 at both).
"""
from __future__ import annotations

import json

import pytest

from example_runs import SCRIPT
from launcher import assert_succeeded, jobs
from ds_json import write_ds_config

pytestmark = pytest.mark.slow

SHAPE = ["--hidden-size", "768", "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2",
         "--ffn-hidden-size", "2688", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--eval-interval", "0",
         "--log-interval", "1", "--corpus-bytes", str(192 * 1024), "--valid-fraction", "0.25", "--no-plot"]


def _config(tmp_path, name: str, **moe) -> str:
    return write_ds_config(tmp_path / f"{name}.json", batch=2, micro=1, dp=2, clip=None,
                           optimizer={"type": "AdamW", "params": {"lr": 1e-4}},
                           moe={"num_experts": 8, "top_k": 2, "router": "topk", "ffn_hidden_size": 2688,
                                "activation": "swiglu", "drop_tokens": False, "parallel": {"expert": 2}, **moe})


def _argv(tmp_path, name: str, layers: int, seq: int, config: str, *extra: str) -> list[str]:
    return [str(SCRIPT), "--deepspeed_config", config, "--num-layers", str(layers), "--seq-length", str(seq),
            *SHAPE, "--run-dir", str(tmp_path / name), "--data-cache", str(tmp_path / "data"), *extra]


SIZES = (2, 4)   # layers


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The three jobs at once (independent, each on its own port): the run at each of ``SIZES``, and the
    one that cannot fit. ``(tmp_path, {layers: Done, "refused": Done})``."""
    tmp_path = tmp_path_factory.mktemp("memory")
    config = _config(tmp_path, "ds")
    argvs = {layers: _argv(tmp_path, f"layers{layers}", layers, 128, config, "--train-iters", "2",
                           "--save", str(tmp_path / f"ckpt{layers}")) for layers in SIZES}
    (tmp_path / "refusal").mkdir()   # its data cache (another corpus) and run directory apart
    argvs["refused"] = _argv(tmp_path / "refusal", "refused", 2, 131072, config, "--train-iters", "1",
                             "--max-position-embeddings", "131072", "--corpus-bytes", str(1 << 20),
                             "--valid-fraction", "0.5")
    return tmp_path, dict(zip(argvs, jobs(list(argvs.values()))))


def test_the_estimate_holds_at_two_sizes(launched):
    tmp_path, done = launched
    assert_succeeded(*(done[layers] for layers in SIZES))
    seen = {}
    for layers in SIZES:
        memory = json.loads((tmp_path / f"layers{layers}" / "memory.json").read_text())
        seen[layers] = (max(memory["peak_memory_mb"]), memory["estimate_mb"])
        peak, estimate = seen[layers]
        assert 0.8 <= peak / estimate <= 1.2, (layers, memory)
        lines = (tmp_path / f"layers{layers}" / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        stepped = max(max(r["peak_memory_mb"]) for r in records if "peak_memory_mb" in r)   # before the save
        assert peak <= 1.1 * stepped, (layers, peak, stepped)   # the synchronous save adds at most 10%
    grown, estimated = seen[4][0] - seen[2][0], seen[4][1] - seen[2][1]
    assert 0.8 <= grown / estimated <= 1.2, seen


def test_a_run_that_cannot_fit_stops_at_start_in_one_line(launched):
    tmp_path, jobs_done = launched
    done = jobs_done["refused"]
    assert done.status == 2, done.tail()
    lines = [line for line in done.output.splitlines() if "memory per rank: got an estimated peak" in line]
    assert len(lines) == 1, done.tail()   # rank 0 says it once
    line = lines[0]
    assert "activations" in line and "host memory per rank" in line and '"memory_check": false' in line, line
    assert "neither ZeRO stage 2 nor a smaller reduce bucket would fit" in line, line
    assert not (tmp_path / "refusal" / "refused" / "metrics.jsonl").exists()   # no step ran
