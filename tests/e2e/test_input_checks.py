"""Every input check runs before any process group, with a message naming the key, the value and
what is valid: the DeepSpeed JSON read as DeepSpeed reads it, near-miss key names, absurd sizes,
DeepSpeed's batch arithmetic, MoE layers past the model's depth, the report on rank 0 only."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest

import moe_plugin
from moe_plugin.configs import ConfigError, MoEConfig, batch_sizes, load_ds_config

MOE = {"num_experts": 8, "parallel": {"expert": 2}}


def write(tmp_path, text: str) -> str:
    path = tmp_path / "ds.json"
    path.write_text(text)
    return str(path)


# -- the JSON file, as deepspeed.initialize reads it ---------------------------------------------

def test_duplicate_key_is_refused_with_its_path_and_values(tmp_path):
    path = write(tmp_path, '{"train_batch_size": 8, "moe": {"num_experts": 8, "num_experts": 16}}')
    with pytest.raises(ConfigError, match=r"^moe\.num_experts: got 8 and 16; the key appears 2 times in ds\.json; "
                                          r"DeepSpeed refuses duplicate keys: keep one$"):
        load_ds_config(path)


def test_duplicate_key_at_the_top_level_and_in_a_list(tmp_path):
    with pytest.raises(ConfigError, match=r"^train_batch_size: got 8 and 16; the key appears 2 times"):
        load_ds_config(write(tmp_path, '{"train_batch_size": 8, "moe": {"num_experts": 8}, "train_batch_size": 16}'))
    with pytest.raises(ConfigError, match=r"^a\[1\]\.b: got 1 and 2;"):
        load_ds_config(write(tmp_path, '{"a": [{}, {"b": 1, "b": 2}]}'))


def test_comments_are_accepted_as_deepspeed_accepts_them(tmp_path):
    text = ('{\n  // line comment\n  "train_batch_size": 8,  # hash comment\n'
            '  /* block */ "moe": {"num_experts": 8, "parallel": {"expert": 2},},\n}\n')
    assert load_ds_config(write(tmp_path, text)) == {"train_batch_size": 8, "moe": MOE}
    assert type(load_ds_config(write(tmp_path, text))["moe"]) is dict


# -- near misses ------------------------------------------------------------------------------

def test_misspelt_required_key_names_the_near_miss():
    with pytest.raises(ConfigError, match=r"^moe\.num_experts: missing; required: an integer >= 1 .*; the block has "
                                          r"'num_expert' \(did you mean 'num_experts'\?\)$"):
        MoEConfig.from_dict({"num_expert": 8})


@pytest.mark.parametrize("block, path, hint", [
    ({"num_experts": 8, "capacity_factr": 1.0}, "moe.capacity_factr", "capacity_factor"),
    ({"num_experts": 8, "parallel": {"expret": 2}}, "moe.parallel.expret", "expert"),
    ({"num_experts": 8, "placement": {"polcy": "greedy"}}, "moe.placement.polcy", "policy"),
])
def test_unknown_key_at_any_depth_names_the_near_miss(block, path, hint):
    with pytest.raises(ConfigError, match=rf"^{path.replace('.', '[.]')}: got .*; unknown key \(did you mean "
                                          rf"'{hint}'\?\)"):
        MoEConfig.from_dict(block)


# -- absurd sizes answer at once --------------------------------------------------------------

def test_huge_sizes_are_refused_in_milliseconds():
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=r"^moe\.num_experts: got 1000000000000; expected at most 1,048,576"):
        MoEConfig.from_dict({"num_experts": 10 ** 12, "parallel": {"expert": 3}})
    with pytest.raises(ConfigError, match=r"^world_size: got 1000000000000; expected at most 1,048,576 ranks"):
        MoEConfig.from_dict({"num_experts": 8}).check_world_size(10 ** 12)
    with pytest.raises(ConfigError, match=r"valid: 1, 2, 3, 4, .*, 720720 \(240 divisors\)$"):
        MoEConfig.from_dict({"num_experts": 720720, "parallel": {"expert": 720719}})
    assert time.perf_counter() - started < 5.0     # a generous bound: these once enumerated 10^12 divisors


def test_cli_answers_huge_sizes_at_once(tmp_path):
    """The console command, as a user runs it (a hang would hit the timeout)."""
    path = write(tmp_path, json.dumps({"train_batch_size": 8, "moe": {"num_experts": 10 ** 12,
                                                                      "parallel": {"expert": 3}}}))
    for argv, line in ((["check-config", path], "error: moe.num_experts: got 1000000000000; expected at most "),
                       (["layout", "--world-size", str(10 ** 12)], "error: --world-size: got 1000000000000; "
                                                                    "expected at most 1,048,576 ranks")):
        done = subprocess.run([sys.executable, "-m", "moe_plugin_tools.cli", *argv], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 2 and done.stdout == "" and done.stderr.startswith(line), done.stderr


# -- DeepSpeed's batch arithmetic against the layout's data-parallel size -------------------------

@pytest.mark.parametrize("ds, dp, message", [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}, 2,
     r"^train_batch_size: got 16; must equal train_micro_batch_size_per_gpu \(4\) x gradient_accumulation_steps "
     r"\(1\) x data-parallel size \(2\) = 8; the JSON does not fit"),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 0}, 4,
     r"^gradient_accumulation_steps: got 0; expected an integer >= 1$"),
    ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1.5}, 2,
     r"^gradient_accumulation_steps: got 1\.5; expected an integer >= 1$"),
    ({"train_batch_size": 20, "train_micro_batch_size_per_gpu": 4}, 2,
     r"^train_batch_size: got 20; must be a multiple of train_micro_batch_size_per_gpu \(4\) x data-parallel size "
     r"\(2\) = 8"),
    ({"train_batch_size": 12, "gradient_accumulation_steps": 2}, 4, r"^train_batch_size: got 12; must be a multiple "
     r"of gradient_accumulation_steps \(2\) x data-parallel size \(4\) = 8"),
    ({"gradient_accumulation_steps": 2}, 2, r"^train_batch_size: missing; DeepSpeed needs train_batch_size or "
     r"train_micro_batch_size_per_gpu"),
    ({"train_batch_size": True}, 1, r"^train_batch_size: got True; expected an integer >= 1$"),
    ({"train_batch_size": 16, "gradient_accumulation_step": 2}, 2, r"^gradient_accumulation_step: got 2; unknown "
     r"key \(did you mean 'gradient_accumulation_steps'\?\): DeepSpeed ignores it"),
])
def test_batch_arithmetic(ds, dp, message):
    with pytest.raises(ConfigError, match=message):
        batch_sizes(ds, dp)


def test_batch_numbers_are_derived_as_deepspeed_derives_them():
    sizes = batch_sizes({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, 2)
    assert (sizes.micro, sizes.gas, sizes.total, sizes.derived) == (4, 2, 16, ("gradient_accumulation_steps",))
    assert batch_sizes({"train_micro_batch_size_per_gpu": 4}, 3).total == 12
    assert batch_sizes({"train_batch_size": 16, "gradient_accumulation_steps": 2}, 4).micro == 2
    assert batch_sizes({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                        "gradient_accumulation_steps": 2}, 2).derived == ()


def test_initialize_refuses_a_json_for_another_world_size_before_any_group(monkeypatch):
    """The 4-rank JSON on 2 ranks: ConfigError from moe_plugin.initialize itself, no group made."""
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "moe": {"num_experts": 4, "parallel": {"expert": 2}}}
    with pytest.raises(ConfigError, match=r"^train_batch_size: got 16; must equal .* = 8"):
        moe_plugin.initialize(ds, lambda config, groups: None)
    assert not dist.is_initialized()


# -- the model's depth ------------------------------------------------------------------------

def test_moe_layer_beyond_the_model():
    config = MoEConfig.from_dict({"num_experts": 8, "layers": [1, 3, 5]})
    config.check_num_layers(6)
    with pytest.raises(ConfigError, match=r"^moe\.layers: got \[1, 3, 5\]; names layer 5, but the model has 4 "
                                          r"layers \(--num-layers\); indices are 0-based: 0\.\.3$"):
        config.check_num_layers(4, "--num-layers")


# -- one line, on rank 0 only -----------------------------------------------------------------

@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_exit_on_config_error_prints_on_rank_0_and_exits_2_everywhere(monkeypatch, capsys, rank, printed):
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as caught:
        with moe_plugin.exit_on_config_error():
            MoEConfig.from_dict({"num_experts": 8, "parallel": {"expert": 3}})
    assert caught.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("error: moe.parallel.expert: got 3; must divide num_experts (8); valid: 1, 2, 4, "
                                 "8\n" if printed else "")


@pytest.mark.parametrize("rank, launcher, waits", [("1", "CROSS_RANK", True), ("1", "TORCHELASTIC_RUN_ID", True),
                                                   ("0", "CROSS_RANK", False), ("1", None, False)])
def test_under_a_launcher_other_ranks_wait_for_rank_0_to_print(monkeypatch, capsys, rank, launcher, waits):
    """The deepspeed launcher (and torchrun) ends every rank once one exits: a rank other than 0 that
    exits first with the error would have rank 0 killed before it printed the line. Those ranks wait
    ``LAUNCHER_GRACE_S`` before exiting (the launcher ends them once rank 0 has); elsewhere none waits."""
    from moe_plugin.configs import report

    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setenv("RANK", rank)
    for name in ("CROSS_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    if launcher:
        monkeypatch.setenv(launcher, "0")
    status = report.report_error(ConfigError("moe.top_k", 9, "bad"))
    assert status == 2 and slept == ([report.LAUNCHER_GRACE_S] if waits else [])
    assert (capsys.readouterr().err != "") == (rank == "0")


# -- the example: data and model flags, before any group ----------------------------------------

def _example_error(tmp_path, monkeypatch, capsys, *argv, ds_change=None, rank="0"):
    """Run the example's main on 'rank' of 2 (no group is made on the paths tested); its stderr."""
    from example_runs import MODEL_FLAGS, ds_config, example_script

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    config = json.loads(ds_config(tmp_path / "ds.json", 2, expert=2).read_text())
    config.update(ds_change or {})
    (tmp_path / "ds.json").write_text(json.dumps(config))
    status = example_script().main([*MODEL_FLAGS, "--deepspeed_config", "ds.json", *argv])
    out, err = capsys.readouterr()
    assert status == 2, (out, err)
    return err


def _dataset(tmp_path, largest: int):
    import numpy as np

    from moe_plugin.data import write_indexed

    docs = [np.arange(i, i + 200) % (largest + 1) for i in range(0, 4000, 200)]
    docs[-1][-1] = largest
    write_indexed(tmp_path / "tokens", docs)
    return str(tmp_path / "tokens")


@pytest.mark.parametrize("argv, ds_change, message", [
    (["--num-layers", "2"], {"moe": {"num_experts": 4, "layers": [0, 2], "parallel": {"expert": 2}}},
     r"^error: moe\.layers: got \[0, 2\]; names layer 2, but the model has 2 layers \(--num-layers\)"),
    ([], {"gradient_accumulation_steps": 1.5}, r"^error: gradient_accumulation_steps: got 1\.5; expected an integer"),
    ([], {"gradient_accumulation_steps": 0}, r"^error: gradient_accumulation_steps: got 0; expected an integer"),
    (["--num-query-groups", "2"], None, r"^error: --num-query-groups: got 2; needs --group-query-attention"),
    (["--group-query-attention", "--num-query-groups", "3"], None,
     r"^error: --num-query-groups: got 3; must divide --num-attention-heads \(2\)"),
    (["--swiglu"], None, r"^error: --swiglu: got True; every layer's MLP is an MoE layer, so there is no dense MLP"),
    (["--rotary-base", "5000"], None, r"^error: --rotary-base: got 5000\.0; needs --position-embedding-type rope"),
    (["--group-query-attention"], {"moe": {"num_experts": 4, "parallel": {"tensor": 2}}},
     r"^error: --num-query-groups: got 1; must be a multiple of moe\.parallel\.tensor \(2\)"),
])
def test_example_refuses_before_anything_is_written(tmp_path, monkeypatch, capsys, argv, ds_change, message):
    import re

    err = _example_error(tmp_path, monkeypatch, capsys, *argv, ds_change=ds_change)
    assert re.match(message, err) and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json"]


def test_example_vocab_smaller_than_the_data(tmp_path, monkeypatch, capsys):
    prefix = _dataset(tmp_path, largest=300)
    err = _example_error(tmp_path, monkeypatch, capsys, "--data-path", prefix, "--vocab-size", "256")
    assert err == (f"error: --vocab-size: got 256; the data's largest token id is 300 ({prefix}.bin): the vocabulary "
                   "must be at least 301\n")
    cache = json.loads((tmp_path / "data" / "max_token_ids.json").read_text())
    assert [entry["max"] for entry in cache.values()] == [300]     # the next start reads no token
    assert _example_error(tmp_path, monkeypatch, capsys, "--data-path", prefix, "--vocab-size", "256",
                          rank="1") == ""                          # rank 1: the same status, quietly


def test_example_truncated_bin_names_the_file(tmp_path, monkeypatch, capsys):
    prefix = _dataset(tmp_path, largest=300)
    size = (tmp_path / "tokens.bin").stat().st_size
    with open(tmp_path / "tokens.bin", "r+b") as f:
        f.truncate(size - 100)
    err = _example_error(tmp_path, monkeypatch, capsys, "--data-path", prefix)
    assert err == (f"error: {prefix}.bin: got {size - 100:,} bytes; expected {size:,}: {prefix}.idx lists "
                   f"{size // 2:,} uint16 tokens in 20 sequences; the file is truncated or belongs to another index\n")


@pytest.mark.parametrize("damage, message", [
    (lambda idx: b"", r"\.idx: got 0 bytes; expected at least 34 bytes"),
    (lambda idx: b"garbage!!" + idx[9:], r"\.idx: got header b'garbage!!'; expected the header"),
    (lambda idx: idx[:-8], r"\.idx: got \d+ bytes; expected \d+: its header promises 20 sequences and 21 document"),
    (lambda idx: idx[:-8] + (99).to_bytes(8, "little"), r"\.idx: got document bounds 0\.\.99; expected document "
                                                         r"bounds rising from 0 to the 20 sequences"),
    (lambda idx: idx[:34 + 80] + (3).to_bytes(8, "little") + idx[34 + 88:], r"\.idx: got byte offset 3 of sequence 0; "
                                                                           r"expected 0, the sum of the lengths"),
])
def test_damaged_index_names_the_file(tmp_path, damage, message):
    from moe_plugin.data import read_indexed

    prefix = _dataset(tmp_path, largest=300)
    idx = tmp_path / "tokens.idx"
    idx.write_bytes(damage(idx.read_bytes()))
    with pytest.raises(ConfigError, match=message):
        read_indexed(prefix)


# -- under the deepspeed launcher: one line, status 2, no process group --------------------------

USER_SCRIPT = '''\
import json, os, sys, time
import torch.distributed as dist
import moe_plugin

if os.environ["RANK"] == "0":   # rank 0 reaches the error 2 s after the others: unless they wait for it
    time.sleep(2.0)             # to print, one exits first and the launcher kills rank 0 (every launch)
try:
    with moe_plugin.exit_on_config_error():
        moe_plugin.initialize(sys.argv[-1], lambda config, groups: None)
finally:   # what each rank saw of torch.distributed when it stopped
    with open(os.path.join(os.path.dirname(sys.argv[-1]), f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"group": dist.is_initialized()}, f)
'''


LINE_ROUNDS = 2   # two jobs a round: the line must arrive in all 4 launches


@pytest.mark.slow
def test_launcher_two_ranks_one_line_status_2_no_group(tmp_path):
    """Two launches of 2 ranks, side by side, ``LINE_ROUNDS`` times: the example with a truncated .bin
    (found in build_data), and a user script whose moe_plugin.initialize gets a 4-rank JSON (found by
    the plugin's batch check). Every launch prints the one line. Before ranks other than 0 waited for
    rank 0 (``report_error``, ``LAUNCHER_GRACE_S``), the launcher killed rank 0 before it printed in
    about one launch in a few. The user script's rank 0 comes to the error 2 s after the other rank, so
    that without the wait the line is lost in every launch of it: with LAUNCHER_GRACE_S = 0 it was lost
    in 4 launches of 4, where with both ranks at their own pace (the 6 rounds this test ran before) it
    was lost in none of 8. The example runs as a user runs it. ``launcher.jobs`` fails when a job
    leaves its ``/dev/shm`` buffers behind."""
    for _ in range(LINE_ROUNDS):
        _two_jobs_one_line_each(tmp_path)


def _two_jobs_one_line_each(tmp_path) -> None:
    from launcher import jobs
    from example_runs import MODEL_FLAGS, SCRIPT, ds_config

    prefix = _dataset(tmp_path, largest=300)
    size = (tmp_path / "tokens.bin").stat().st_size
    with open(tmp_path / "tokens.bin", "r+b") as f:
        f.truncate(size - 2)
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    config = tmp_path / "job" / "ds4.json"
    shutil.rmtree(config.parent, ignore_errors=True)
    config.parent.mkdir()
    config.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                                  "gradient_accumulation_steps": 1,
                                  "moe": {"num_experts": 4, "parallel": {"expert": 2}}}))
    example, user = jobs([[str(SCRIPT), *MODEL_FLAGS, "--deepspeed_config", str(ds_config(tmp_path / "ds.json", 2,
                                                                                          expert=2)),
                           "--data-path", prefix, "--data-cache", str(tmp_path / "data"), "--run-dir",
                           str(tmp_path / "runs")],
                          [str(script), str(config)]], cwd=tmp_path, timeout=300)
    status, output = example.status, example.output
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert status == 2 and errors == [f"error: {prefix}.bin: got {size - 2:,} bytes; expected {size:,}: {prefix}.idx "
                                      f"lists {size // 2:,} uint16 tokens in 20 sequences; the file is truncated or "
                                      "belongs to another index"], output
    assert "Initializing TorchBackend" not in output and "Traceback" not in output, output   # no group was made
    assert not (tmp_path / "runs").exists()

    status, output = user.status, user.output
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert status == 2 and errors == ["error: train_batch_size: got 16; must equal train_micro_batch_size_per_gpu (4) "
                                      "x gradient_accumulation_steps (1) x data-parallel size (2) = 8; the JSON does "
                                      "not fit this layout's 2 data-parallel ranks"], output
    assert "Traceback" not in output, output
    seen = [json.loads(path.read_text()) for path in sorted(config.parent.glob("rank*.json"))]
    assert seen and all(s == {"group": False} for s in seen), seen   # the launcher may stop rank 1 before it writes


def test_initialize_says_when_gradient_accumulation_follows_the_world_size(monkeypatch, caplog):
    """A JSON without gradient_accumulation_steps: DeepSpeed derives it from the ranks; rank 0 says so.
    (ZeRO-2 with a pipeline stops initialize at a later check, before any group.)"""
    import logging

    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
          "moe": {"num_experts": 4, "parallel": {"pipeline": 2}}}
    for rank, gas, logged in (("0", None, 1), ("1", None, 0), ("0", 4, 0)):
        monkeypatch.setenv("RANK", rank)
        if gas is not None:
            ds["gradient_accumulation_steps"] = gas
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="moe_plugin.integration.deepspeed"):
            with pytest.raises(ConfigError, match=r"^zero_optimization\.stage: got 2; with moe\.parallel\.pipeline"):
                moe_plugin.initialize(ds, lambda config, groups: None)
        assert [r.getMessage() for r in caplog.records] == [
            "global batch 16 = micro 4 x accumulation 4 x dp 1 (gradient_accumulation_steps derived): the DeepSpeed "
            "config has no gradient_accumulation_steps, so it follows the number of ranks; write it to have another "
            "world size refused"][:logged]


class _Accelerator:
    def __init__(self, name: str, fp16, bf16):
        self.name, self.fp16, self.bf16 = name, fp16, bf16

    def device_name(self):
        return self.name

    def is_fp16_supported(self):
        return self.fp16

    def is_bf16_supported(self):
        return self.bf16


def test_a_precision_the_accelerator_lacks_is_refused_naming_its_answer():
    """fp16 / bf16 checked against DeepSpeed's accelerator (a fake one here: each answer on any machine);
    the example's run of it where the CPU has no fp16 is ``test_guard.py``'s."""
    from moe_plugin.integration.deepspeed import _check_precision_supported

    with pytest.raises(ConfigError, match=r"^fp16\.enabled: got True; DeepSpeed's cpu accelerator answers "
                                          r"is_fp16_supported\(\) = None on this machine \(on a CPU: oneDNN has no "
                                          r"fp16 kernels here\); use bf16 or fp32$"):
        _check_precision_supported({"fp16": {"enabled": True}}, _Accelerator("cpu", None, True))
    with pytest.raises(ConfigError, match=r"^bfloat16\.enabled: got True; DeepSpeed's cuda accelerator answers "
                                          r"is_bf16_supported\(\) = False on this machine; use fp16 or fp32$"):
        _check_precision_supported({"bfloat16": {"enabled": True}}, _Accelerator("cuda", True, False))
    for config in ({"fp16": {"enabled": False}}, {"bf16": {"enabled": True}}, {}):
        _check_precision_supported(config, _Accelerator("cpu", None, True))
    _check_precision_supported({"fp16": {"enabled": True}}, _Accelerator("cuda", True, False))
