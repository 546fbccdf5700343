"""moe_plugin.data: the indexed format round trip (through Megatron-Core's reader), the byte
tokenizer, the stdlib corpus (deterministic, capped, written once), samples over the document
stream, the validation split and the layout-independent global batches. One process, no group."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from moe_plugin.data import (
    ByteTokenizer,
    GlobalBatches,
    TokenSamples,
    corpus_manifest,
    ensure_stdlib_corpus,
    num_documents,
    pad_vocab_size,
    read_indexed,
    split_documents,
    stdlib_documents,
    stdlib_files,
    write_indexed,
)


def _docs(lengths, seed=0, high=300):
    gen = np.random.default_rng(seed)
    return [gen.integers(0, high, n).astype(np.int64) for n in lengths]


# --- indexed format ------------------------------------------------------------------------------
def test_indexed_round_trip_with_megatron_reader(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = _docs([5, 1, 17, 300])
    written = write_indexed(tmp_path / "corpus", docs, dtype=np.uint16)
    read = IndexedDataset(str(tmp_path / "corpus"))   # Megatron's own reader, directly
    assert len(read) == len(docs) == num_documents(read) and written.index.dtype == np.uint16
    assert read.sequence_lengths.tolist() == [5, 1, 17, 300]
    assert read.document_indices.tolist() == [0, 1, 2, 3, 4]
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(read[i], doc)
    np.testing.assert_array_equal(read.get(3, offset=10, length=4), docs[3][10:14])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.bin", "corpus.idx"]  # no temporaries left

    big = write_indexed(tmp_path / "wide", _docs([3], high=100_000), dtype=np.int32)
    assert big.index.dtype == np.int32


def test_indexed_errors_name_the_problem_and_leave_no_files(tmp_path):
    with pytest.raises(ValueError, match=r"document 1: token ids .* do not fit uint16"):
        write_indexed(tmp_path / "bad", [np.array([1, 2]), np.array([70_000])], dtype=np.uint16)
    with pytest.raises(ValueError, match="document 0: expected a non-empty 1-D array"):
        write_indexed(tmp_path / "bad", [np.zeros(0, dtype=np.int64)])
    with pytest.raises(ValueError, match="no documents"):
        write_indexed(tmp_path / "bad", [])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError, match=r"nothing\.bin and .*nothing\.idx not found; pass the prefix"):
        read_indexed(tmp_path / "nothing")


# --- tokenizer -----------------------------------------------------------------------------------
def test_byte_tokenizer_round_trip_and_padding():
    tok = ByteTokenizer()
    text = "def f():\n    return 'héllo ✓'\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint16 and ids.max() < 256 and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    doc = tok.encode_document(text)
    assert doc[-1] == tok.eod == 256 and tok.decode(doc, eod_text="|") == text + "|"
    assert tok.vocab_size == 257
    assert [tok.padded_vocab_size(tp) for tp in (1, 2, 4, 8)] == [384] * 4   # the same model for every TP
    assert pad_vocab_size(50257, 128, 8) == 50304
    with pytest.raises(ValueError, match="does not split over 5 tensor-parallel ranks"):
        tok.padded_vocab_size(5)


# --- stdlib corpus -------------------------------------------------------------------------------
def test_stdlib_corpus_is_deterministic_capped_and_written_once(tmp_path, capsys):
    files = stdlib_files()
    names = [f.as_posix() for f in files]
    assert names == sorted(names) and "os.py" in names
    assert not any(part in ("test", "tests", "site-packages", "idlelib") for f in files for part in f.parts)

    cap = 64 * 1024
    prefix = ensure_stdlib_corpus(tmp_path / "a", max_bytes=cap)
    again = ensure_stdlib_corpus(tmp_path / "b", max_bytes=cap, progress=False)
    assert (tmp_path / "a" / f"{prefix.name}.bin").read_bytes() == (tmp_path / "b" / f"{again.name}.bin").read_bytes()
    assert "writing stdlib-py" in capsys.readouterr().err            # the progress display

    dataset = read_indexed(prefix)
    documents = list(stdlib_documents(cap))
    manifest = corpus_manifest(prefix)
    assert manifest["documents"] == len(dataset) == len(documents) > 1
    assert sum(len(data) for _, data in documents) <= cap
    assert manifest["tokens"] == int(dataset.sequence_lengths.sum()) == sum(len(d) + 1 for _, d in documents)
    tok = ByteTokenizer()
    assert tok.decode(dataset[0], eod_text="") == documents[0][1].decode("utf-8")
    assert dataset[0][-1] == tok.eod
    sha = hashlib.sha256(np.concatenate([dataset[i] for i in range(len(dataset))]).astype("<u2").tobytes())
    assert manifest["sha256"] == sha.hexdigest()

    mtime = (tmp_path / "a" / f"{prefix.name}.bin").stat().st_mtime_ns
    assert ensure_stdlib_corpus(tmp_path / "a", max_bytes=cap) == prefix     # found, not rewritten
    assert (tmp_path / "a" / f"{prefix.name}.bin").stat().st_mtime_ns == mtime


# --- samples and split ---------------------------------------------------------------------------
def test_samples_are_consecutive_windows_over_the_document_stream(tmp_path):
    docs = _docs([7, 3, 20, 1, 9])
    dataset = write_indexed(tmp_path / "d", docs)
    stream = np.concatenate(docs)
    samples = TokenSamples(dataset, range(5), seq_length=6)
    assert len(samples) == (len(stream) - 1) // 6
    for i in range(len(samples)):
        np.testing.assert_array_equal(samples[i], stream[i * 6:i * 6 + 7])
    tokens, labels = samples.batch([2, 0])
    assert tokens.shape == labels.shape == (2, 6) and tokens.dtype == torch.int64
    assert torch.equal(tokens[1], torch.from_numpy(stream[:6])) and torch.equal(labels[1], torch.from_numpy(stream[1:7]))

    held = TokenSamples(dataset, [2, 4], seq_length=4)                # only the documents given, in order
    np.testing.assert_array_equal(held[1], np.concatenate([docs[2], docs[4]])[4:9])
    with pytest.raises(IndexError, match="sample 9 out of range"):
        held[9]
    with pytest.raises(ValueError, match=r"4 tokens in 2 documents do not make one sample of seq_length \+ 1 = 9"):
        TokenSamples(dataset, [1, 3], seq_length=8)


def test_validation_split_is_by_document_spread_and_deterministic():
    train, valid = split_documents(100, 0.05)
    assert len(valid) == 5 and len(train) == 95
    assert set(train).isdisjoint(valid) and sorted({*train, *valid}) == list(range(100))
    assert valid.tolist() == [19, 39, 59, 79, 99]                    # every 20th, over the whole corpus
    assert split_documents(100, 0.05)[1].tolist() == valid.tolist()
    assert len(split_documents(10, 0.0)[1]) == 0
    with pytest.raises(ValueError, match=r"valid_fraction: got 1.5"):
        split_documents(10, 1.5)


# --- global batches ------------------------------------------------------------------------------
def test_global_batch_is_the_same_for_every_layout():
    schedule = GlobalBatches(num_samples=50, global_batch_size=8, seed=3)
    for step in (0, 5, 6, 13):                                        # step 6 straddles two epochs
        batch = schedule.global_batch(step)
        for dp, micro in ((1, 8), (1, 2), (2, 4), (2, 2), (4, 1), (8, 1)):
            gas = 8 // (dp * micro)
            rows = [schedule.micro_batch(step, r, dp, micro, m) for r in range(dp) for m in range(gas)]
            np.testing.assert_array_equal(np.concatenate(rows), batch)
    first_epoch = np.concatenate([schedule.global_batch(s) for s in range(6)])  # 48 of the 50 samples
    assert len(set(first_epoch.tolist())) == 48
    assert not np.array_equal(GlobalBatches(50, 8, seed=4).global_batch(0), schedule.global_batch(0))
    np.testing.assert_array_equal(GlobalBatches(50, 8, seed=3).global_batch(13), schedule.global_batch(13))
    np.testing.assert_array_equal(GlobalBatches(50, 8, shuffle=False).global_batch(1), np.arange(8, 16))
    with pytest.raises(ValueError, match="global batch 8 is not data-parallel size 3"):
        schedule.micro_batch(0, 0, 3, 2)
