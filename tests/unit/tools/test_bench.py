"""``moe-plugin bench layer`` at tiny sizes: the record's fields, the memory method, the traffic formulas.
No timing assertions."""
from __future__ import annotations

import gc
import json
import math

import pytest
import torch

from dist import attempts, case_results, run_distributed

from moe_plugin_tools.bench.layer import LayerBenchSpec, bench_layer
from moe_plugin_tools.bench.layer_ep import rank_main
from moe_plugin_tools.bench.memory import memory_profile, peak_allocated_bytes
from moe_plugin_tools.bench.traffic import deepspeed_bytes_sent, ours_bytes_sent, ours_rows_sent, token_rank_rows_sent
from moe_plugin_tools.cli import main

MiB = 2**20
TINY = dict(tokens=64, experts=4, hidden=16, ffn=32, iters=1, warmup=1)


@pytest.fixture(scope="module", autouse=True)
def _heap_frozen_for_the_bench():
    """The layer bench collects garbage before each memory measurement (``gc.collect()``, a dozen per
    configuration); in the test process that walks every object of the session (torch, DeepSpeed,
    Megatron-Core, the collected tests), ~0.4 s each, most of these tests' time. What exists before
    this module goes to the collector's permanent generation for its tests (``gc.freeze``) and back after
    (``gc.unfreeze``): the bench's own garbage, made in the tests, is collected as before."""
    gc.freeze()
    yield
    gc.unfreeze()


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


EP_SPEC = LayerBenchSpec(**dict(TINY, experts=8), dropless=True, vs_deepspeed=True)
EP_GROUPED = LayerBenchSpec(**dict(TINY, experts=8), dropless=True, vs_deepspeed=False, group_topk=1)
EP_TOKEN = LayerBenchSpec(**dict(TINY, experts=8), dropless=True, vs_deepspeed=False, group_topk=1, exchange="token")
EP_BF16 = LayerBenchSpec(**dict(TINY, experts=8), vs_deepspeed=True, dtype="bf16")
# the expert-parallel tests' cases: one spawn of 2 ranks runs them all, each case one rank_main call
# (its groups made and torn down, as the command does) in the same ranks
EP_CASES = {"three": [EP_SPEC, EP_GROUPED, EP_TOKEN], "bf16": [EP_BF16]}


def _ep_child(rank, world_size, cases):
    results = {}
    attempt = attempts(results, rank)
    for name, specs in cases.items():
        attempt(name, rank_main, rank, world_size, specs, 1, "unused: the harness made the group")
    return results


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory):
    """Each case of ``EP_CASES`` on 2 ranks: {case: [records of rank 0, of rank 1]} (a rank's traceback
    fails the test that asks for the case, through ``case_results``)."""
    return run_distributed(_ep_child, 2, tmp_path_factory.mktemp("bench_ep"), EP_CASES)


@pytest.mark.slow
def test_bench_layer_expert_parallel(ep_results):
    spec = EP_SPEC
    record, limited, once = case_results(ep_results, "three")[0]
    # one row per route: a top-2 token sends both rows when its experts are remote; group_topk 1 of the
    # 2 groups (the EP ranks) puts both on one rank, so it reaches one rank, twice
    for r in (record, limited):
        assert abs(r["ours_a2a_step_bytes"] - 4 * r["ours_a2a_bytes"]) <= 4
        assert 0 < r["token_rank_a2a_step_bytes"] <= r["ours_a2a_step_bytes"]
    assert limited["ours_a2a_step_bytes"] == 2 * limited["token_rank_a2a_step_bytes"]
    assert record["token_rank_a2a_step_bytes"] > limited["token_rank_a2a_step_bytes"]
    assert limited["group_topk"] == 1 and limited["routed_rows"] == 2 * spec.tokens * spec.k
    # exchange token: the dispatch sends each token once per remote rank, H values + one mask column (4 local
    # experts), the combine still one row per route; the same routing as the counts layer beside it
    H = spec.hidden
    assert once["exchange"] == "token" and once["token_rank_a2a_step_bytes"] == limited["token_rank_a2a_step_bytes"]
    assert once["ours_dispatch_step_bytes"] * H == once["token_rank_dispatch_step_bytes"] * (H + 1)
    assert once["ours_a2a_step_bytes"] - once["ours_dispatch_step_bytes"] == limited["ours_a2a_step_bytes"] // 2
    assert limited["ours_dispatch_step_bytes"] == 2 * limited["token_rank_dispatch_step_bytes"]
    assert record["ep"] == 2
    for field in FIELDS_POSITIVE + ["ours_a2a_bytes", "deepspeed_a2a_bytes"]:
        value = record[field]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (field, value)
    # both layers exchange rows over EP and still compute the same thing
    assert record["routing_agrees"] and record["max_abs_diff"] < 1e-5
    assert record["routed_rows"] == 2 * spec.tokens * spec.k


def test_token_rank_rows_count_each_remote_rank_of_a_token_once():
    token_R = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    slot_R = torch.tensor([2, 3, 0, 5, 4, 5, 1])      # 2 experts per rank on 3 ranks; this is rank 0
    # token 0 -> rank 1 twice, token 1 -> rank 0 (own) and rank 2, token 2 -> rank 2 twice, token 3 -> own
    assert token_rank_rows_sent(token_R, slot_R, num_local=2, ep_size=3, ep_rank=0) == 3
    assert ours_rows_sent(torch.tensor([1, 1, 1, 1, 1, 2]), 3, 0) == 5


def test_traffic_formulas():
    kept_E = torch.tensor([5, 1, 0, 2, 7, 3, 4, 6])   # 8 experts, 2 per rank on 4 ranks
    assert ours_rows_sent(kept_E, 4, 0) == 28 - 6
    assert ours_rows_sent(kept_E, 4, 2) == 28 - 10
    assert ours_bytes_sent(kept_E, 4, 2, hidden=16, element_size=4) == 18 * 16 * 4
    assert ours_rows_sent(kept_E, 1, 0) == 0
    # DeepSpeed: 8 experts x capacity 10 slots, 3/4 of them leave the rank
    assert deepspeed_bytes_sent(8, 10, 4, hidden=16, element_size=4) == 60 * 16 * 4
    assert deepspeed_bytes_sent(8, 10, 1, hidden=16, element_size=4) == 0


def test_bench_layer_bf16_on_the_cpu():
    record = bench_layer(LayerBenchSpec(**TINY, dropless=True, vs_deepspeed=True, device="cpu", dtype="bf16"))
    assert record["dtype"] == "bfloat16" and record["device"] == "cpu"
    assert record["ours_ms"] > 0 and record["deepspeed_ms"] > 0 and record["ours_peak_bytes"] > 0
    assert record["routing_agrees"] and record["max_abs_diff"] < 0.1   # bf16 rounding of the same sums
    assert record["megatron_ms"] is None


def test_cli_layer_device_and_dtype_reach_the_record(capsys):
    assert main(["bench", "layer", "--experts", "4", "--tokens", "64", "--hidden", "16", "--ffn", "32", "--iters",
                 "1", "--device", "cpu", "--dtype", "bf16", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["device"] == "cpu" and record["dtype"] == "bfloat16"


def test_cli_layer_deterministic_runs_under_torchs_mode_and_restores_it(capsys, monkeypatch):
    """``--deterministic``: the layers run under ``torch.use_deterministic_algorithms(True)``
    (seen from the experts' forward), the record says so, and the mode is off again afterwards."""
    from moe_plugin.layers.experts import GroupedExperts

    seen, forward = [], GroupedExperts.forward
    monkeypatch.setattr(GroupedExperts, "forward", lambda self, *args: seen.append(
        torch.are_deterministic_algorithms_enabled()) or forward(self, *args))
    argv = ["bench", "layer", "--experts", "4", "--tokens", "64", "--hidden", "16", "--ffn", "32", "--iters", "1",
            "--json"]
    assert main(argv + ["--deterministic"]) == 0 and main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    records = [json.loads(line) for line in out if line.startswith("{")]    # not DeepSpeed's first log line
    assert [r["deterministic"] for r in records] == [True, False]
    assert seen and seen.count(True) == len(seen) // 2 and seen[0] and not seen[-1]
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda", "--dtype", "bf16"], "error: --device cuda: torch finds no cuda device on this machine"),
    (["--vs", "megatron"], "error: --vs megatron needs CUDA (Megatron-Core's MoELayer with grouped GEMM), "
                           "got --device cpu"),
])
def test_cli_layer_refuses_what_needs_cuda(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as caught:
        main(["bench", "layer", "--experts", "4", "--tokens", "64", *argv])
    assert caught.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err


@pytest.mark.parametrize("argv, message", [
    (["--group-topk", "1", "--vs", "deepspeed"], "error: --group-topk needs --vs none"),
    (["--router-groups", "2"], "error: moe.router_groups: got 2; has no effect without group_topk"),
    (["--group-topk", "1"], "error: moe.router_groups: got 1; one group holds every expert"),   # --ep 1
    (["--group-topk", "2", "--ep", "2"], "error: moe.group_topk: got 2; must be less than router_groups (2)"),
])
def test_cli_layer_refuses_a_bad_group_limit(capsys, argv, message):
    with pytest.raises(SystemExit) as caught:
        main(["bench", "layer", "--experts", "4", "--tokens", "64", *argv])
    assert caught.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err


class FakeAccelerator:
    """DeepSpeed's accelerator interface, as much as device.py uses, counting its calls."""

    def __init__(self, name="xpu"):
        self.name, self.syncs, self.allocated, self.peak = name, 0, 100, 100

    def device_name(self):
        return self.name

    def synchronize(self):
        self.syncs += 1

    def reset_peak_memory_stats(self):
        self.peak = self.allocated

    def memory_allocated(self):
        return self.allocated

    def max_memory_allocated(self):
        return self.peak


def test_device_defaults_to_the_accelerator_and_syncs_and_measures_through_it(monkeypatch):
    from moe_plugin_tools.bench import device

    fake = FakeAccelerator("xpu")
    monkeypatch.setattr(device, "accelerator", lambda: fake)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^--device xpu: torch finds no xpu device"):
        device.check_device(None)                   # the default is the accelerator's device, checked
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    assert device.check_device(None) == "xpu"
    target = device.Target("xpu", "bf16")
    assert target.torch_dtype == torch.bfloat16 and not target.on_cpu

    def work():
        fake.peak, fake.allocated = 100 + 5000, 100 + 300   # 5000 bytes at the peak, 300 kept

    profile = target.memory_profile(work)
    assert (profile.peak_bytes, profile.retained_bytes) == (5000, 300)
    assert fake.syncs == 2                          # before and after the measured call
    device.Target("cpu").sync()
    assert fake.syncs == 2                          # nothing to wait for on the CPU
    target.reset_peak()
    assert target.peak_bytes() == fake.allocated == 400 and device.Target("cpu").peak_bytes() is None


def test_timed_steps_are_bracketed_by_syncs(monkeypatch):
    from moe_plugin_tools.bench import device
    from moe_plugin_tools.bench.layer import Ranks, _Run, _time_rotating

    fake = FakeAccelerator("cuda")
    monkeypatch.setattr(device, "accelerator", lambda: fake)
    seen = []
    run = _Run(step=lambda: seen.append(fake.syncs), forward=lambda: None, tensors=[])
    times = _time_rotating({"ours": run}, warmup=1, iters=2, ranks=Ranks(), target=device.Target("cuda"))
    assert len(times["ours"]) == 2
    assert seen == [1, 3, 5] and fake.syncs == 6    # one sync before each step, one after


@pytest.mark.parametrize("dropless", [False, True], ids=["capacity", "dropless"])
def test_megatron_config_matches_the_spec(dropless):
    from moe_plugin_tools.bench.layer import AUX_LOSS_COEFF
    from moe_plugin_tools.bench.megatron_moe import megatron_config

    spec = LayerBenchSpec(experts=16, hidden=64, ffn=96, k=2, capacity_factor=1.5, dropless=dropless, device="cuda",
                          dtype="bf16")
    c = megatron_config(spec, AUX_LOSS_COEFF)
    assert (c.num_moe_experts, c.moe_router_topk, c.hidden_size, c.moe_ffn_hidden_size) == (16, 2, 64, 96)
    assert c.moe_token_dispatcher_type == "alltoall" and c.moe_grouped_gemm and not c.add_bias_linear
    assert c.moe_expert_capacity_factor == (None if dropless else 1.5) and not c.moe_pad_expert_input_to_capacity
    assert c.bf16 and c.params_dtype == torch.bfloat16 and c.moe_aux_loss_coeff == AUX_LOSS_COEFF


def test_distributed_backend_sets_the_local_device(monkeypatch):
    from moe_plugin_tools.bench import device

    fake = FakeAccelerator("cuda")
    fake.set_device = lambda index: setattr(fake, "device_index", index)
    fake.communication_backend_name = lambda: "nccl"
    monkeypatch.setattr(device, "accelerator", lambda: fake)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device.distributed_backend(rank=11) == "nccl" and fake.device_index == 3
    monkeypatch.delenv("LOCAL_RANK")
    assert device.distributed_backend(rank=1) == "nccl" and fake.device_index == 1


def test_breakdown_runs_on_the_layers_dtype():
    record = bench_layer(LayerBenchSpec(**TINY, vs_deepspeed=False, breakdown=True, dtype="bf16"))
    parts = record["ours_parts_ms"]
    assert set(parts) == {"router", "route_topk", "route_argsort", "permute", "experts_gathering", "experts",
                          "combine"}
    assert all(v >= 0 for v in parts.values()) and parts["experts"] > 0


@pytest.mark.slow
def test_bench_layer_expert_parallel_bf16_sends_two_bytes_a_value(ep_results):
    spec = EP_BF16
    record, = case_results(ep_results, "bf16")[0]
    assert record["dtype"] == "bfloat16" and record["routing_agrees"]
    assert record["deepspeed_a2a_bytes"] == deepspeed_bytes_sent(8, record["deepspeed_capacity"], 2, spec.hidden, 2)
