"""Text in: ``moe-plugin stdlib-jsonl``, ``train-tokenizer`` and ``preprocess`` (moe_plugin/data/preprocess.py),
and the GPT example trained on their output.

* A byte-level BPE of 1,000 tokens trained here on the stdlib corpus (the same files twice over);
  the corpus as JSON lines plus a blank line, an empty text and non-ASCII text, preprocessed with
  2 workers: Megatron-Core's own ``IndexedDataset`` reads every document as the tokenizer's
  direct encoding + its EOS, in order (the empty text left out and counted), as uint16; 1 worker
  writes the same bytes. A bad line reached by a worker stops the run in one line naming the
  line and leaves no file.
* A 66,002-token tokenizer gives int32 tokens (Megatron's ``DType.optimal_dtype``); two
  ``--json-keys`` give one dataset each.
* Bad input is refused in one line (status 2) naming the flag or ``FILE:LINE`` and the key,
  before anything is written: a missing input, a line that is not JSON / lacks the key / holds
  no string, a directory without a tokenizer, a tokenizer without EOS, transformers missing, an
  existing output without ``--overwrite``; the example's ``--tokenizer`` without ``--data-path``
  and a ``--tokenizer`` whose vocabulary disagrees with the data's ``PREFIX.json``.
* The example through the ``deepspeed`` launcher, 1 rank (8 experts), 2 steps on the
  preprocessed data with ``--tokenizer``: vocabulary 1,000 padded to 1,024, first loss ln(1024).
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from launcher import REPO, deepspeed
from moe_plugin_tools.cli import main

SCRIPT = REPO / "examples" / "gpt_moe" / "pretrain_gpt_moe.py"
CORPUS_BYTES = 128 * 1024
EXTRA = ["\n", json.dumps({"text": ""}) + "\n", json.dumps({"text": "naïve café ✓ — done", "path": "x"}) + "\n"]


def _refused(capsys, argv: list, match: str) -> str:
    """``moe-plugin ARGV`` exits with status 2 and one ``error:`` line matching ``match``."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if line.startswith("error: ")]   # after any progress bar
    assert exit_.value.code == 2 and len(errors) == 1 and err.endswith(errors[0]), err
    assert re.search(match, errors[0]), errors[0]
    return errors[0]


def _ds_config(path: Path) -> Path:
    """The example's 4-rank JSON for 1 rank (8 experts, all on it)."""
    config = json.loads((REPO / "examples" / "gpt_moe" / "configs" / "tiny_cpu_4rank.json").read_text())
    config.update(train_batch_size=4, csv_monitor={"enabled": False})
    config["moe"]["parallel"]["expert"] = 1
    path.write_text(json.dumps(config))
    return path


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """The stdlib corpus as JSON lines (+ EXTRA), a BPE tokenizer trained on it, and its texts."""
    root = tmp_path_factory.mktemp("text")
    assert main(["stdlib-jsonl", str(root / "stdlib.jsonl"), "--corpus-bytes", str(CORPUS_BYTES)]) == 0
    jsonl = root / "corpus.jsonl"
    jsonl.write_text((root / "stdlib.jsonl").read_text() + "".join(EXTRA))
    assert main(["train-tokenizer", "--input", str(jsonl), "--out", str(root / "tok"), "--vocab-size", "1000"]) == 0
    texts = [json.loads(line)["text"] for line in jsonl.read_text().splitlines() if line.strip()]
    return SimpleNamespace(root=root, jsonl=jsonl, tokenizer=root / "tok", texts=texts)


@pytest.fixture(scope="module")
def two_workers(text):
    """``text`` preprocessed with 2 workers (the example's data)."""
    prefix = text.root / "data" / "corpus"
    assert main(["preprocess", "--input", str(text.jsonl), "--tokenizer", str(text.tokenizer), "--output-prefix",
                 str(prefix), "--workers", "2"]) == 0
    return prefix


@pytest.mark.slow   # 2 worker processes
def test_two_workers_write_the_direct_encoding_and_megatron_reads_it(text, two_workers, tmp_path, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from moe_plugin.data import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(text.tokenizer)
    eos = tokenizer.eos_token_id
    assert len(tokenizer) == 1000 and eos is not None
    expected = [tokenizer(t, add_special_tokens=False)["input_ids"] + [eos] for t in text.texts if t]
    assert len(expected) == len(text.texts) - 1 > 10   # the empty text is left out
    dataset = IndexedDataset(str(two_workers))          # Megatron-Core's reader, not ours
    assert dataset.index.dtype == np.uint16 and len(dataset) == len(expected)
    for i, ids in enumerate(expected):
        assert dataset[i].tolist() == ids, i
    assert tokenizer.decode(dataset[len(expected) - 1][:-1].tolist()) == "naïve café ✓ — done"
    manifest = json.loads(Path(f"{two_workers}.json").read_text())
    assert manifest | {"input": None, "tokenizer": None} == {
        "input": None, "tokenizer": None, "json_key": "text", "vocab_size": 1000, "eod": eos, "dtype": "uint16",
        "documents": len(expected), "tokens": sum(map(len, expected)), "skipped_empty": 1}

    one = tmp_path / "one"
    assert main(["preprocess", "--input", str(text.jsonl), "--tokenizer", str(text.tokenizer), "--output-prefix",
                 str(one), "--workers", "1"]) == 0
    captured = capsys.readouterr()
    assert "100%" in captured.err and f"{len(expected)} documents, 1 empty left out" in captured.out
    for ext in (".bin", ".idx"):
        assert Path(f"{one}{ext}").read_bytes() == Path(f"{two_workers}{ext}").read_bytes(), ext

    again = tmp_path / "tok"   # training is deterministic
    assert main(["train-tokenizer", "--input", str(text.jsonl), "--out", str(again), "--vocab-size", "1000"]) == 0
    assert (again / "tokenizer.json").read_bytes() == (text.tokenizer / "tokenizer.json").read_bytes()

    bad = tmp_path / "bad"   # a bad line far down, found by a worker: one line, no file left
    bad.mkdir()
    lines = text.jsonl.read_text().splitlines(keepends=True)
    (bad / "in.jsonl").write_text("".join(lines[:-1]) + '{"body": "no text"}\n')
    capsys.readouterr()
    _refused(capsys, ["preprocess", "--input", str(bad / "in.jsonl"), "--tokenizer", str(text.tokenizer),
                      "--output-prefix", str(bad / "out"), "--workers", "2"],
             rf"in\.jsonl:{len(lines)}: got no 'text'; the object has no key 'text' \(--json-keys\); its keys: 'body'")
    assert _files(bad) == ["in.jsonl"]


def test_large_vocabulary_gives_int32_and_several_keys_one_dataset_each(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(66_000)} | {"[UNK]": 66_000, "<eos>": 66_001}
    model = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<eos>", unk_token="[UNK]").save_pretrained(
        str(tmp_path / "tok"))
    lines = [{"text": "w1 w65999 zz", "title": "w7"}, {"text": "w65535", "title": "w2 w3"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--tokenizer", str(tmp_path / "tok"),
                 "--output-prefix", str(tmp_path / "out"), "--json-keys", "text", "title", "--workers", "1",
                 "--no-progress"]) == 0
    text, title = IndexedDataset(str(tmp_path / "out_text")), IndexedDataset(str(tmp_path / "out_title"))
    assert text.index.dtype == np.int32 and title.index.dtype == np.int32
    assert [text[i].tolist() for i in range(2)] == [[1, 65_999, 66_000, 66_001], [65_535, 66_001]]
    assert [title[i].tolist() for i in range(2)] == [[7, 66_001], [2, 3, 66_001]]
    assert not (tmp_path / "out.bin").exists()


def test_bad_input_is_refused_in_one_line_before_anything_is_written(text, tmp_path, capsys, monkeypatch):
    tok, jsonl = str(text.tokenizer), str(text.jsonl)
    out = tmp_path / "out"
    common = ["--tokenizer", tok, "--output-prefix", str(out), "--workers", "1", "--no-progress"]
    _refused(capsys, ["preprocess", "--input", str(tmp_path / "nope.jsonl"), *common],
             r"--input: got '.*nope\.jsonl'; expected a file of JSON lines: not found")
    cases = {"notjson": ('{"text": "a"}\n\n{"text": "b"\n', r"notjson\.jsonl:3: got '\{\"text\": \"b\"'; expected one "
                         r"JSON object per line \(Expecting ',' delimiter at column 13\)"),
             "nokey": ('{"text": "a"}\n{"body": "b", "id": 2}\n', r"nokey\.jsonl:2: got no 'text'; the object has "
                       r"no key 'text' \(--json-keys\); its keys: 'body', 'id'"),
             "notstr": ('{"text": ["a", "b"]}\n', r"notstr\.jsonl:1: got a JSON list at 'text'; expected a string"),
             "array": ('[1, 2]\n', r"array\.jsonl:1: got a JSON list; expected a JSON object with the key\(s\) text")}
    for name, (content, match) in cases.items():
        (tmp_path / f"{name}.jsonl").write_text(content)
        _refused(capsys, ["preprocess", "--input", str(tmp_path / f"{name}.jsonl"), *common], match)
    (tmp_path / "empty_dir").mkdir()
    _refused(capsys, ["preprocess", "--input", jsonl, *common[2:], "--tokenizer", str(tmp_path / "empty_dir")],
             r"--tokenizer: got '.*empty_dir'; holds no tokenizer: expected one of tokenizer\.json")
    _refused(capsys, ["preprocess", "--input", jsonl, *common[2:], "--tokenizer", str(tmp_path / "absent")],
             r"--tokenizer: got '.*absent'; expected a Hugging Face tokenizer directory .*: not found")
    _refused(capsys, ["preprocess", "--input", jsonl, *common[:2], "--output-prefix", str(out) + ".bin"],
             r"--output-prefix: got '.*out\.bin'; expected a path prefix without \.bin/\.idx")
    _refused(capsys, ["train-tokenizer", "--input", jsonl, "--out", str(tmp_path / "t"), "--vocab-size", "100"],
             r"--vocab-size: got 100; expected 300\.\.65499")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")),
                            unk_token="[UNK]").save_pretrained(str(tmp_path / "no_eos"))
    _refused(capsys, ["preprocess", "--input", jsonl, *common[2:], "--tokenizer", str(tmp_path / "no_eos")],
             r"--tokenizer: got '.*no_eos'; has no EOS token .*pass --no-append-eod")
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "transformers", None)   # what a machine without the hf extra has
        _refused(capsys, ["preprocess", "--input", jsonl, *common],
                 r"--tokenizer: got '.*tok'; needs the transformers package, which is not installed: "
                 r"pip install 'moe_plugin\[hf\]'")
    assert _files(tmp_path) == ["array.jsonl", "empty_dir", "no_eos", "nokey.jsonl", "notjson.jsonl",
                                "notstr.jsonl"]   # nothing written, no temporary file left

    assert main(["preprocess", "--input", jsonl, *common]) == 0
    before = Path(f"{out}.bin").stat().st_mtime_ns
    _refused(capsys, ["preprocess", "--input", jsonl, *common],
             r"--output-prefix: got '.*out'; .*out\.bin, .*out\.idx, .*out\.json exist\(s\); pass --overwrite")
    assert Path(f"{out}.bin").stat().st_mtime_ns == before
    assert main(["preprocess", "--input", jsonl, *common, "--overwrite"]) == 0


def test_example_refuses_a_tokenizer_that_does_not_fit_the_data(text, tmp_path, capsys, monkeypatch):
    from example_runs import example_script

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    (tmp_path / "in.jsonl").write_text('{"text": "w1 w2"}\n{"text": "w3"}\n')
    common = ["--deepspeed_config", str(_ds_config(tmp_path / "ds.json")), "--run-dir", str(tmp_path / "run"),
              "--data-cache", str(tmp_path / "cache")]
    script = example_script()
    assert script.main([*common, "--tokenizer", str(text.tokenizer)]) == 2
    assert re.search(r"--tokenizer: got '.*tok'; gives the vocabulary of --data-path data, which is not given",
                     capsys.readouterr().err)
    assert main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--tokenizer", str(text.tokenizer),
                 "--output-prefix", str(tmp_path / "d"), "--workers", "1", "--no-progress"]) == 0
    manifest = json.loads((tmp_path / "d.json").read_text())
    manifest["vocab_size"] = 999
    (tmp_path / "d.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert script.main([*common, "--data-path", str(tmp_path / "d"), "--tokenizer", str(text.tokenizer)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(r"--tokenizer: got '.*tok'; .*d\.json records a vocabulary of 999 .*this "
                                       r"gives 1,000: the data was preprocessed with another tokenizer", err[0]), err
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


@pytest.mark.slow   # the deepspeed launcher
def test_example_trains_on_the_preprocessed_data_through_the_launcher(text, two_workers, tmp_path, launcher_port):
    run = tmp_path / "run"
    done = deepspeed("--num_gpus", "1", "--master_port", str(launcher_port), str(SCRIPT),
                     "--deepspeed_config", str(_ds_config(tmp_path / "ds.json")), "--num-layers", "2",
                     "--hidden-size", "32", "--num-attention-heads", "2", "--ffn-hidden-size", "64", "--seq-length", "32",
                     "--train-iters", "2", "--eval-interval", "0", "--eval-iters", "1", "--log-interval", "1",
                     "--valid-fraction", "0.25", "--data-path", str(two_workers), "--tokenizer", str(text.tokenizer),
                     "--run-dir", str(run), "--data-cache", str(tmp_path / "cache"), "--no-plot",
                     cwd=tmp_path, timeout=300)
    assert done.status == 0, done.output[-3000:]
    assert "vocabulary 1000 padded to 1024" in done.output, done.output[-3000:]
    assert json.loads((run / "run.json").read_text())["vocab_size"] == 1024
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if r["split"] == "train"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(1024), abs=0.2)   # a uniform guess over the padded BPE vocabulary
