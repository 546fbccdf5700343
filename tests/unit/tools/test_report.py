"""``moe-plugin report``: synthetic run directories in, report.md and PNGs out; bad dirs named."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_plugin_tools.cli import main
from moe_plugin_tools.report import RunDirError, count_params, read_run, summarize

ARGS = {"num_layers": 4, "hidden_size": 16, "num_attention_heads": 2, "ffn_hidden_size": 32, "seq_length": 8}
MOE = {"num_experts": 4, "top_k": 2, "layer_interval": 2, "parallel": {"tensor": 1, "pipeline": 1, "expert": 2}}


def _layers(step: int) -> list[dict]:
    return [{"layer": layer, "imbalance": 1.5, "dropped_fraction": 0.1, "balance_loss": 1.0,
             "tokens_per_expert": [step + layer, 2, 3, 4]} for layer in (0, 2)]


def make_run(path: Path, losses=(3.0, 2.5, 2.0, 1.5), valid=(2.8, 2.2), moe=MOE) -> Path:
    """Four training steps (log steps 2 and 4), two validations."""
    path.mkdir(parents=True)
    (path / "run.json").write_text(json.dumps({"args": ARGS, "ds_config": {"moe": moe, "train_batch_size": 4},
                                               "world_size": 2, "vocab_size": 64}))
    lines = []
    for step, loss in enumerate(losses, start=1):
        record = {"split": "train", "step": step, "loss": loss, "lr": 1e-3, "elapsed_s": 0.5 * step,
                  "step_s": [0.4, 0.5, 0.6, 0.7][step - 1]}
        if step % 2 == 0:
            record.update(tokens_per_s=100.0 * step, imbalance=1.0 + step / 10, dropped_fraction=step / 100,
                          moe="moe: ...", moe_layers=_layers(step))
        lines.append(json.dumps(record))
        if step % 2 == 0 and valid:
            lines.append(json.dumps({"split": "valid", "step": step, "loss": valid[step // 2 - 1]}))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_summary_equals_the_inputs(tmp_path):
    summary = summarize(read_run(make_run(tmp_path / "a")))
    assert (summary.layers, summary.hidden, summary.heads, summary.ffn, summary.seq) == (4, 16, 2, 32, 8)
    assert (summary.experts, summary.top_k, summary.layout) == (4, 2, "tp1 pp1 ep2 etp1")
    assert summary.steps == 4 and summary.final_train_loss == 1.5
    assert summary.best_valid_loss == 2.2 and summary.final_valid_loss == 2.2
    assert summary.median_tokens_per_s == 300.0            # log steps 2 and 4: 200, 400
    assert summary.median_step_s == pytest.approx(0.55)
    assert summary.final_imbalance == pytest.approx(1.4) and summary.final_dropped_fraction == 0.04
    assert summary.wall_s == 2.0


def test_param_count_formula():
    h, f, e, k, s, v = 16, 32, 4, 2, 8, 64
    embeddings, final_norm, attention = v * h + s * h + v * h, 2 * h, 4 * h * h + 8 * h
    dense, router, experts = 2 * h * f + f + h, h * e, e * 2 * h * f
    count = count_params(ARGS, MOE, v)                   # layers 0 and 2 are MoE, 1 and 3 dense
    assert count.moe_layers == (0, 2) and count.expert == 2 * experts
    assert count.total == embeddings + final_norm + 4 * attention + 2 * dense + 2 * (router + experts)
    assert count.active == embeddings + final_norm + 4 * attention + 2 * dense + 2 * (router + k * 2 * h * f)
    matrices = 4 * 4 * h * h + 2 * 2 * h * f + 2 * (router + k * 2 * h * f) + v * h
    assert count.flops_per_token == 6 * matrices + 12 * 4 * s * h
    swiglu = count_params(ARGS, {**MOE, "activation": "swiglu", "layers": [3], "top_k": 1}, v)
    assert swiglu.moe_layers == (3,)
    assert swiglu.active == embeddings + final_norm + 4 * attention + 3 * dense + router + 3 * h * f
    as_dense = count_params({**ARGS, "dense": True}, MOE, v)
    assert as_dense.moe_layers == () and as_dense.total == as_dense.active == (embeddings + final_norm
                                                                             + 4 * attention + 4 * dense)
    assert count_params({}, MOE, v) is None and count_params(ARGS, MOE, None) is None
    # tied (the example's default since --untie-embeddings-and-output-weights; run.json without the
    # flag: untied): the output layer is the word embedding's weight, counted once; same FLOPs
    tied = count_params({**ARGS, "untie_embeddings_and_output_weights": False}, MOE, v)
    assert tied.total == count.total - v * h and tied.active == count.active - v * h
    assert tied.flops_per_token == count.flops_per_token
    assert count_params({**ARGS, "untie_embeddings_and_output_weights": True}, MOE, v) == count


def test_report_writes_table_and_plots(tmp_path, capsys):
    first = make_run(tmp_path / "a")
    second = make_run(tmp_path / "b", losses=(4.0, 3.0, 2.0, 1.25), valid=())
    out = tmp_path / "out"
    assert main(["report", str(first), str(second), "--out", str(out)]) == 0
    for name in ("report.md", "summary.csv", "summary.json", "loss.png", "loss_vs_flops.png", "scaling.png",
                 "balance.png", "expert_load_a.png", "expert_load_b.png"):
        assert (out / name).stat().st_size > 0, name
    assert str(out / "report.md") in capsys.readouterr().out
    text = (out / "report.md").read_text()
    assert "## Comparison" in text and "| | a | b |" in text
    assert "| final train loss | 1.5000 | 1.2500 |" in text
    assert "| best validation loss | 2.2000 | - |" in text
    assert "| experts | 4 | 4 |" in text and "| MoE layers | 0, 2 | 0, 2 |" in text
    assert "![expert_load_b.png](expert_load_b.png)" in text
    records = json.loads((out / "summary.json").read_text())["runs"]
    assert [r["name"] for r in records] == ["a", "b"] and records[1]["final_train_loss"] == 1.25
    assert records[0]["train_flops"] == records[0]["flops_per_token"] * 4 * 8 * 4   # batch 4 x seq 8 x 4 steps
    assert (out / "summary.csv").read_text().splitlines()[0].startswith("name,model,experts,top_k,")
    assert records[0]["valid_loss_by_step"] == [[2, 2.8], [4, 2.2]] and records[1]["valid_loss_by_step"] == []
    assert records[0]["imbalance_by_step"] == [[2, pytest.approx(1.2)], [4, pytest.approx(1.4)]]


def test_report_defaults_to_the_first_run_dir(tmp_path):
    run = make_run(tmp_path / "a")
    assert main(["report", str(run)]) == 0
    assert (run / "report.md").exists() and "## Comparison" not in (run / "report.md").read_text()


def _error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["report", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    return err


def test_not_a_run_dir(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert f"{tmp_path / 'empty'}: not a run directory" in _error(capsys, str(tmp_path / "empty"))
    assert f"{tmp_path / 'missing'}: not a directory" in _error(capsys, str(tmp_path / "missing"))


def test_malformed_metrics_line_names_its_number(tmp_path, capsys):
    run = make_run(tmp_path / "a")
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines[:2] + ["{not json"] + lines[2:]) + "\n")
    assert f"{metrics}:3: malformed metrics line" in _error(capsys, str(run))
    metrics.write_text(json.dumps({"split": "train", "step": 1}) + "\n")
    with pytest.raises(RunDirError, match=r"metrics.jsonl:1: malformed metrics line \(no loss\)"):
        read_run(run)
    assert not (run / "report.md").exists()
