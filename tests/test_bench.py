"""``moe-plugin bench layer`` at tiny sizes: the record's fields, the memory method, the traffic formulas.
No timing assertions."""
from __future__ import annotations

import json
import math

import pytest
import torch

from moe_plugin_tools.bench.layer import LayerBenchSpec, bench_layer
from moe_plugin_tools.bench.layer_ep import rank_main
from moe_plugin_tools.bench.memory import memory_profile, peak_allocated_bytes
from moe_plugin_tools.bench.traffic import deepspeed_bytes_sent, ours_bytes_sent, ours_rows_sent
from moe_plugin_tools.cli import main

MiB = 2**20
TINY = dict(tokens=64, experts=4, hidden=16, ffn=32, iters=1, warmup=1)


def test_peak_memory_of_a_known_allocation():
    kept = []

    def allocate():
        kept.append(torch.empty(MiB, dtype=torch.float32))   # 4 MiB, still live at the end

    profile = memory_profile(allocate)
    assert profile.peak_bytes == pytest.approx(4 * MiB, abs=4096)
    assert profile.retained_bytes == pytest.approx(4 * MiB, abs=4096)


def test_peak_memory_counts_temporaries_and_not_the_baseline():
    baseline = torch.ones(4 * MiB)  # 16 MiB live before the call: not counted

    def work():
        a = torch.empty(2 * MiB)                 # 8 MiB
        b = torch.empty(MiB)                     # 4 MiB -> 12 MiB live: the peak
        del a
        c = torch.empty(MiB // 2)                # 2 MiB -> 6 MiB
        return float(baseline[0] + b[0] * 0 + c[0] * 0)

    assert peak_allocated_bytes(work) == pytest.approx(12 * MiB, abs=64 * 1024)


def test_peak_memory_sees_backward():
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(1024, 256)

    def step():
        (x @ w).relu().sum().backward()

    # at least the [1024, 256] output saved for backward and the [256, 256] gradient
    assert peak_allocated_bytes(step) >= (1024 * 256 + 256 * 256) * 4


FIELDS_POSITIVE = ["ours_ms", "deepspeed_ms", "floor_ms", "deepspeed_over_ours", "ours_over_floor",
                   "deepspeed_over_floor",
                   "ours_peak_bytes", "deepspeed_peak_bytes", "floor_peak_bytes", "ours_over_deepspeed_peak",
                   "tokens", "experts", "hidden", "ffn", "k", "capacity_factor", "threads", "routed_rows",
                   "deepspeed_capacity"]


@pytest.mark.parametrize("dropless", [False, True], ids=["capacity", "dropless"])
def test_bench_layer_record(dropless):
    record = bench_layer(LayerBenchSpec(**TINY, dropless=dropless, vs_deepspeed=True))
    for field in FIELDS_POSITIVE:
        value = record[field]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (field, value)
    assert len(record["loadavg"]) == 3
    assert record["routing_agrees"]
    if dropless:  # same routes, same weights, no drop to renormalise differently: same output
        assert record["capacity"] is None
        assert record["max_abs_diff"] < 1e-5
        assert record["deepspeed_capacity"] == record["max_load"]
    json.dumps(record)


def test_bench_layer_without_deepspeed():
    record = bench_layer(LayerBenchSpec(**TINY, vs_deepspeed=False, skew=2.0))
    assert record["ours_ms"] > 0 and record["floor_ms"] > 0 and record["ours_peak_bytes"] > 0
    assert record["deepspeed_ms"] is None and record["deepspeed_over_ours"] is None


def test_cli_prints_one_json_line_per_configuration(capsys):
    assert main(["bench", "layer", "--experts", "4,8", "--tokens", "64", "--hidden", "16", "--ffn", "32",
                 "--iters", "1", "--vs", "deepspeed", "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["experts"] for line in lines] == [4, 8]


def test_cli_ep_checks_the_launcher_world_size(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as caught:
        main(["bench", "layer", "--experts", "4", "--tokens", "64", "--ep", "2"])
    assert caught.value.code == 2
    assert "--ep 2 but the launcher started WORLD_SIZE=3" in capsys.readouterr().err


def _ep_child(rank, world_size, spec):
    return rank_main(rank, world_size, [spec], threads=1, init_method="unused: the harness made the group")[0]


def test_bench_layer_expert_parallel(dist_run):
    spec = LayerBenchSpec(**dict(TINY, experts=8), dropless=True, vs_deepspeed=True)
    record = dist_run(_ep_child, 2, spec)[0]
    assert record["ep"] == 2
    for field in FIELDS_POSITIVE + ["ours_a2a_bytes", "deepspeed_a2a_bytes"]:
        value = record[field]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (field, value)
    # both layers exchange rows over EP and still compute the same thing
    assert record["routing_agrees"] and record["max_abs_diff"] < 1e-5
    assert record["routed_rows"] == 2 * spec.tokens * spec.k


def test_traffic_formulas():
    kept_E = torch.tensor([5, 1, 0, 2, 7, 3, 4, 6])   # 8 experts, 2 per rank on 4 ranks
    assert ours_rows_sent(kept_E, 4, 0) == 28 - 6
    assert ours_rows_sent(kept_E, 4, 2) == 28 - 10
    assert ours_bytes_sent(kept_E, 4, 2, hidden=16, element_size=4) == 18 * 16 * 4
    assert ours_rows_sent(kept_E, 1, 0) == 0
    # DeepSpeed: 8 experts x capacity 10 slots, 3/4 of them leave the rank
    assert deepspeed_bytes_sent(8, 10, 4, hidden=16, element_size=4) == 60 * 16 * 4
    assert deepspeed_bytes_sent(8, 10, 1, hidden=16, element_size=4) == 0
