"""``moe-plugin bench checkpoint`` at toy sizes: a row per size and step with its measurements, a bf16
import the size of its source, the work directory cleaned, and bad flags refused in one line before
any work. No timing assertions."""
from __future__ import annotations

import json

import pytest

from moe_plugin_tools.bench.checkpoint import settings_from_args
from moe_plugin_tools.cli import build_parser, main

TOY = ["--hidden", "64", "--heads", "4", "--kv-heads", "2", "--experts", "4", "--ffn", "128", "--vocab", "384",
       "--settle", "0"]
STEPS = ("import-hf", "export-hf", "export", "load", "save")


def _rows(capsys, argv: list[str]) -> tuple[list[dict], str]:
    assert main(["bench", "checkpoint", *TOY, "--json", *argv]) == 0
    captured = capsys.readouterr()
    return [json.loads(line) for line in captured.out.splitlines()], captured.err


def _check_row(r: dict) -> None:
    assert r["seconds"] > 0 and r["peak_rss_mb"] > 0 and r["cp_seconds"] > 0 and r["time_over_cp"] > 0, r
    assert r["mb_in"] + r["mb_out"] > 0 and r["bytes_in"] + r["bytes_out"] > 0, r
    assert (r["own_seconds"] is None) == (r["step"] == "export"), r   # the others print "in X s"
    assert r["own_seconds"] is None or 0 < r["own_seconds"] < r["seconds"], r
    if r["step"] in ("load", "save"):
        return
    # the floors and the bytes' own time: seconds less the same command's on a one-layer model
    assert r["start_seconds"] > 0 and r["dd_seconds"] > 0, r
    for floor in ("cp", "dd"):   # the row's figures are rounded to 1 ms, their ratio is not
        ratio, seconds = r[f"bytes_over_{floor}"], r[f"{floor}_seconds"]
        assert abs(ratio * seconds - (r["seconds"] - r["start_seconds"])) <= 0.002 + 0.0005 * abs(ratio), r


def test_bench_checkpoint_rows(capsys, tmp_path):
    rows, progress = _rows(capsys, ["--layers", "1,2", "--work", str(tmp_path), "--steps", ",".join(STEPS[:3])])
    assert [(r["layers"], r["step"]) for r in rows] == [(n, s) for n in (1, 2) for s in STEPS[:3]]
    for r in rows:
        _check_row(r)
    assert rows[3]["params"] > rows[0]["params"] > 0
    for r in (rows[0], rows[3]):   # a bf16 import keeps the dtype: the checkpoint is the source's size
        assert abs(r["bytes_out"] - r["bytes_in"]) <= 0.1 * r["bytes_in"], r
    assert rows[2]["bytes_out"] > 1.8 * rows[0]["bytes_in"]   # export writes fp32
    assert "[2 layers] export-hf" in progress and "expert files 4/4" in progress   # the commands' own progress
    assert progress.count("start costs: each conversion on a model of one layer") == 1   # once per bench
    assert list(tmp_path.iterdir()) == []   # models and outputs removed (no --keep)


def test_bench_checkpoint_load_and_save_after_an_unmeasured_import(capsys, tmp_path):
    """The example --loads the import on 2 ranks, trains 2 steps, --saves: the rows of both; import-hf, left
    out of --steps, still runs first (the others read its checkpoint) and --keep keeps what was written."""
    rows, progress = _rows(capsys, ["--layers", "1", "--steps", "export,load,save", "--work", str(tmp_path), "--keep"])
    assert [r["step"] for r in rows] == ["export", "load", "save"]
    for r in rows:
        _check_row(r)
    export, load, save = rows
    assert "import-hf (not measured" in progress
    assert (tmp_path / "layers1" / "export" / "model.safetensors").is_file()   # kept
    assert load["bytes_in"] * 1.8 < export["bytes_out"], load   # it read the (bf16) import, export wrote fp32
    assert save["bytes_out"] > 5 * load["bytes_in"], save   # 12 bytes per parameter for the 2 (bf16) it read
    assert load["peak_rss_mb"] == save["peak_rss_mb"] > 0 and save["estimate_mb"] > 0, save
    assert "[1 layer] load + 2 steps + save: the example on 2 ranks" in progress


def test_bench_checkpoint_steps_default_to_all_five():
    settings = settings_from_args(build_parser().parse_args(["bench", "checkpoint", *TOY]))
    assert settings.steps == STEPS and settings.layers and settings.work is None and not settings.keep


@pytest.mark.parametrize("argv, message", [
    (["--layers", "0"], "error: --layers: got '0'; expected comma-separated positive integers"),
    (["--layers", "2,x"], "error: --layers: got '2,x'; expected comma-separated positive integers"),
    (["--layers", "2,2"], "error: --layers: got '2,2'; expected distinct layer counts"),
    (["--hidden", "0"], "error: --hidden: got 0; expected a positive integer"),
    (["--heads", "5"], "error: --heads: got 5; must divide --hidden (64)"),
    (["--kv-heads", "3"], "error: --kv-heads: got 3; must divide --heads (4)"),
    (["--experts", "3"], "error: --experts: got 3; must be a multiple of 2"),
    (["--steps", "import-hf,train"], "error: --steps: got 'import-hf,train'; expected distinct comma-separated "
                                     "steps of import-hf, export-hf, export, load, save"),
    (["--vocab", "128"], "error: --vocab: got 128; the load and save steps train the example on its byte-level"),
    (["--settle", "-1"], "error: --settle: got -1.0; expected seconds >= 0"),
])
def test_bench_checkpoint_refuses_bad_flags_in_one_line(capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit) as caught:
        main(["bench", "checkpoint", *TOY, "--work", str(tmp_path / "work"), *argv])
    assert caught.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err
    assert captured.out == "" and not (tmp_path / "work").exists()   # refused before any work


def test_bench_checkpoint_refuses_a_work_directory_in_use(capsys, tmp_path):
    (tmp_path / "layers1").mkdir()
    with pytest.raises(SystemExit):
        main(["bench", "checkpoint", *TOY, "--layers", "1", "--work", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --work: got '{tmp_path}'; already holds {tmp_path}/layers1"), err
