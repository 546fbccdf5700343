"""The ``moe-plugin`` command, run in-process (fast) and once as a real console command."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import REPO
from ds_json import conversion_config
from moe_plugin_tools.cli import main
from moe_plugin.configs import MoEConfig
from moe_plugin.groups.layout import RankLayout

EXAMPLE_4RANK = REPO / "examples" / "gpt_moe" / "configs" / "tiny_cpu_4rank.json"


@pytest.fixture(autouse=True)
def _no_world_size_env(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def run_ok(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


def run_bad(capsys, *argv: str) -> str:
    """Run a command that must fail with exit status 2; return its single stderr line."""
    with pytest.raises(SystemExit) as caught:
        main(list(argv))
    assert caught.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("error: ")
    return err.rstrip("\n")


def config_file(tmp_path: Path, block: dict) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8, "moe": block}))
    return str(path)


# -- check-config ----------------------------------------------------------------------------

def test_check_config_prints_every_resolved_field(capsys, tmp_path):
    out = run_ok(capsys, "check-config", config_file(tmp_path, {"num_experts": 4}))
    printed = json.loads(out)
    assert printed == MoEConfig.from_dict({"num_experts": 4}).resolved_dict()
    assert printed["top_k"] == 2 and printed["placement"]["policy"] == "static"  # defaults filled in


def test_check_config_with_world_size_prints_the_layout(capsys):
    out = run_ok(capsys, "check-config", str(EXAMPLE_4RANK), "--world-size", "4")
    printed, end = json.JSONDecoder().raw_decode(out)
    assert printed["parallel"]["expert"] == 2
    assert out[end:].strip() == RankLayout.build(4, ep=2, etp=1).table()


def test_check_config_reads_world_size_from_the_environment(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "8")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(conversion_config(micro=4, moe={"num_experts": 8}, parallel={"expert": 2})))
    out = run_ok(capsys, "check-config", str(path))
    assert RankLayout.build(8, ep=2).table() in out


def test_check_config_bad_block_is_one_line(capsys, tmp_path):
    err = run_bad(capsys, "check-config", config_file(tmp_path, {"num_experts": 8, "parallel": {"expert": 3}}))
    assert err == "error: moe.parallel.expert: got 3; must divide num_experts (8); valid: 1, 2, 4, 8"


def test_check_config_world_size_that_does_not_fit(capsys):
    err = run_bad(capsys, "check-config", str(EXAMPLE_4RANK), "--world-size", "3")
    assert err.startswith("error: moe.parallel.expert: got 2; expert x expert_tensor (2 x 1) must divide the 3 ranks")


def test_check_config_missing_file(capsys, tmp_path):
    err = run_bad(capsys, "check-config", str(tmp_path / "absent.json"))
    assert err.startswith("error: config file: got ") and "cannot be read" in err


def test_check_config_misspelt_block(capsys, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "Moe": {"num_experts": 8}}')
    err = run_bad(capsys, "check-config", str(path))
    assert err == "error: moe: missing; found key 'Moe' instead (did you mean 'moe'?); the block key is exactly " \
                  "'moe', lower case"


def test_check_config_bad_world_size_env(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "four")
    err = run_bad(capsys, "check-config", str(EXAMPLE_4RANK))
    assert err == "error: WORLD_SIZE (environment): got 'four'; expected a positive integer"


# -- layout ----------------------------------------------------------------------------------

def test_layout_table_lists_coordinates_and_groups(capsys):
    out = run_ok(capsys, "layout", "--world-size", "8", "--tp", "2", "--pp", "2", "--ep", "2")
    layout = RankLayout.build(8, tp=2, pp=2, ep=2)
    assert out.startswith(layout.table() + "\n")
    groups = {line.split()[0]: line for line in out.splitlines()[len(layout.table().splitlines()):] if line}
    assert groups["tp"].endswith("[0,1] [2,3] [4,5] [6,7]")
    assert groups["pp"].endswith("[0,4] [1,5] [2,6] [3,7]")
    assert groups["mp"].endswith("[0,1,4,5] [2,3,6,7]")
    assert groups["embedding"].endswith("[0,4] [1,5] [2,6] [3,7]")


@pytest.mark.parametrize("argv, sizes", [
    (["--world-size", "8", "--tp", "2", "--pp", "2", "--ep", "2"], dict(tp=2, pp=2, ep=2)),
    (["--world-size", "4", "--tp", "2", "--ep", "2", "--etp", "1"], dict(tp=2, ep=2, etp=1)),
    (["--world-size", "16", "--tp", "2", "--ep", "4", "--etp", "1", "--order", "tp-cp-dp-ep-pp"],
     dict(tp=2, ep=4, etp=1, order="tp-cp-dp-ep-pp")),
])
def test_layout_json_equals_to_json(capsys, argv, sizes):
    printed = json.loads(run_ok(capsys, "layout", *argv, "--json"))
    assert set(printed) == {"tp", "pp", "dp", "ep", "etp", "edp", "mp"}
    assert printed == RankLayout.build(int(argv[1]), **sizes).to_json()


@pytest.mark.parametrize("argv, expected", [
    (["--world-size", "8", "--tp", "2", "--pp", "2", "--ep", "3"],
     "error: --ep: got 3; expert x expert_tensor (3 x 2) must divide the 4 ranks of a pipeline stage"),
    (["--world-size", "6", "--tp", "4"], "error: --tp: got 4; must divide the 6 ranks of a pipeline stage"),
    (["--world-size", "6", "--pp", "4"], "error: --pp: got 4; must divide the world size 6; valid: 1, 2, 3, 6"),
    (["--world-size", "0"], "error: --world-size: got 0; expected a positive integer"),
    (["--world-size", "4", "--ep", "2", "--order", "tp-ep-dp"], "error: --order: got 'tp-ep-dp'; lacks pp"),
])
def test_layout_bad_sizes_exit_2_with_one_line(capsys, argv, expected):
    assert run_bad(capsys, "layout", *argv).startswith(expected)


# -- demo ------------------------------------------------------------------------------------

def test_demo_shows_both_layouts_and_each_ranks_groups(capsys):
    out = run_ok(capsys, "demo", "--world-size", "4")
    example = RankLayout(MoEConfig.from_ds_config(EXAMPLE_4RANK).check_world_size(4))
    folded = RankLayout.build(4, tp=2, ep=2, etp=1)
    assert example.table() in out and folded.table() in out
    assert "ep rank 0 hosts experts 0-3, ep rank 1 hosts experts 4-7" in out
    example_part, folded_part = out.split("== Folded")
    header = "rank  tp   pp   dp         ep     etp  edp    mp   embedding"
    assert header in example_part
    assert "   0  [0]  [0]  [0,1,2,3]  [0,1]  [0]  [0,2]  [0]  [0]" in example_part
    # Folded: ranks 0 and 1 share a TP group and also form the EP group.
    assert "   1  [0,1]  [1]  [1,3]  [0,1]  [1]  [1,3]  [0,1]  [1]" in folded_part


def test_demo_with_missing_config(capsys, tmp_path):
    err = run_bad(capsys, "demo", "--config", str(tmp_path / "absent.json"))
    assert "cannot be read" in err


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as caught:
        main([])
    assert caught.value.code == 2
    assert "usage: moe-plugin" in capsys.readouterr().err


# -- the real command ------------------------------------------------------------------------

def test_console_command_names_the_cli():
    assert '"moe-plugin=moe_plugin_tools.cli:main"' in (REPO / "setup.py").read_text()


def test_console_command_exits_2_without_traceback(tmp_path):
    script = Path(sys.executable).parent / "moe-plugin"  # present after `pip install -e .`
    installed = script.exists() and "from moe_plugin_tools.cli import main" in script.read_text()
    command = [str(script)] if installed else [sys.executable, "-m", "moe_plugin_tools.cli"]
    bad = config_file(tmp_path, {"num_experts": "8"})
    done = subprocess.run(command + ["check-config", bad], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == ("error: moe.num_experts: got '8'; expected an integer >= 1 "
                           "(write the number without quotes: 8, not '8')\n")
