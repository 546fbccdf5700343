"""Text to tokens: JSON lines through a Hugging Face tokenizer into Megatron's indexed format.

    preprocess_jsonl("corpus.jsonl", "tokenizers/stdlib-bpe", "data/corpus", workers=4)
    # data/corpus.bin, data/corpus.idx (+ data/corpus.json, what was done) -> --data-path data/corpus

What Megatron-LM's ``tools/preprocess_data.py`` does for GPT data: the same output for any number of
workers (spawned: a calling script needs the ``__main__`` guard), every input checked before any work
and a bad line a ``ConfigError`` naming ``FILE:LINE``, nothing half-written. The loop is shared with
``chat.py``. Rules: docs/design/data_pipeline.md.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import sys
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np

from moe_plugin.configs.errors import ConfigError
from moe_plugin.data.hf_tokenizer import load_hf_tokenizer

PathLike = Union[str, os.PathLike]
CHUNK_BYTES = 1 << 18   # lines sent to a worker at a time: about this many bytes (at least one line), less
                        # for a small input so that every worker gets some


@dataclass(frozen=True)
class Preprocessed:
    """What ``preprocess_jsonl`` wrote: per key, the prefix and its counts (also in ``PREFIX.json``)."""
    prefixes: dict             # json key -> output prefix
    documents: dict            # json key -> documents written
    tokens: dict               # json key -> tokens written
    skipped: dict              # json key -> documents without tokens, left out
    vocab_size: int
    eod: Optional[int]
    dtype: str


class LineEncoder:
    """JSON lines to documents, built once per worker process; a subclass says what one ``line`` gives."""

    def __init__(self, tokenizer, input_name: str):
        self.tokenizer = tokenizer
        self.input_name = input_name

    def chunk(self, lines: list[tuple[int, bytes]]) -> tuple[int, list]:
        """(bytes read, ``line`` of each non-blank line)."""
        return sum(len(line) for _, line in lines), [self.line(n, line) for n, line in lines if line.strip()]

    def line(self, number: int, line: bytes):
        raise NotImplementedError


class _TextEncoder(LineEncoder):
    """A line to one token array per key."""

    def __init__(self, tokenizer, input_name: str, json_keys: Sequence[str], eod: Optional[int]):
        super().__init__(tokenizer, input_name)
        self.json_keys = list(json_keys)
        self.eod = eod

    def line(self, number: int, line: bytes) -> list[np.ndarray]:
        out = []
        for text in texts_of(line, number, self.input_name, self.json_keys):
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if ids and self.eod is not None:
                ids.append(self.eod)
            out.append(np.asarray(ids, dtype=np.int64))
        return out


def json_object(line: bytes, where: str, expected: str) -> dict:
    """One JSON line as a dict; a ``ConfigError`` naming ``where`` (``FILE:LINE``) and ``expected`` otherwise."""
    line = line.strip()
    try:
        record = json.loads(line)
    except ValueError as err:   # JSONDecodeError, UnicodeDecodeError
        why = f"{err.msg} at column {err.colno}" if isinstance(err, json.JSONDecodeError) else str(err)
        raise ConfigError(where, line[:60].decode("utf-8", errors="replace"), f"expected one JSON object per line "
                          f"({why})") from None
    if not isinstance(record, dict):
        raise ConfigError(where, record, expected, shown=f"a JSON {type(record).__name__}")
    return record


def missing_key(where: str, record: dict, key: str, flag: str) -> ConfigError:
    """The error for a line whose object lacks ``key`` (given by ``flag``)."""
    keys = ", ".join(map(repr, list(record)[:8])) or "none"
    return ConfigError(where, key, f"the object has no key {key!r} ({flag}); its keys: {keys}", shown=f"no {key!r}")


def texts_of(line: bytes, number: int, input_name: str, json_keys: Sequence[str]) -> list[str]:
    """The strings at ``json_keys`` of one JSON line; a ``ConfigError`` naming ``FILE:LINE`` otherwise."""
    where = f"{input_name}:{number}"
    record = json_object(line, where, f"expected a JSON object with the key(s) {', '.join(json_keys)} (--json-keys)")
    texts = []
    for key in json_keys:
        if key not in record:
            raise missing_key(where, record, key, "--json-keys")
        if not isinstance(record[key], str):
            raise ConfigError(where, record[key], f"expected a string at {key!r}",
                              shown=f"a JSON {type(record[key]).__name__} at {key!r}")
        texts.append(record[key])
    return texts


_worker: Optional[LineEncoder] = None   # this worker process's encoder (set by its pool initializer)


def _start_worker(encoder: type, tokenizer_dir: str, *args) -> None:
    global _worker
    _worker = encoder(load_hf_tokenizer(tokenizer_dir), *args)


def _encode_chunk(lines: list[tuple[int, bytes]]):
    return _worker.chunk(lines)


def _in_order(pool, chunks: Iterator, window: int) -> Iterator:
    """The workers' results in input order, at most ``window`` chunks read ahead."""
    pending: deque = deque()
    for chunk in chunks:
        pending.append(pool.apply_async(_encode_chunk, (chunk,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def encoded_chunks(stack: ExitStack, input_path: Path, workers: int, tokenizer, tokenizer_dir: PathLike,
                   encoder: type, *args) -> Iterator[tuple[int, list]]:
    """``(bytes read, per non-blank line what it gives)`` per chunk of ``input_path``, in input order, from
    ``workers`` spawned processes (``encoder`` and ``args`` must pickle)."""
    if workers == 1:
        return map(encoder(tokenizer, *args).chunk, _chunks(input_path, CHUNK_BYTES))
    context = multiprocessing.get_context("spawn")   # no forked copy of the caller's threads
    pool = stack.enter_context(context.Pool(workers, initializer=_start_worker,
                                            initargs=(encoder, str(tokenizer_dir), *args)))
    size = max(1, min(CHUNK_BYTES, input_path.stat().st_size // (4 * workers)))
    return _in_order(pool, _chunks(input_path, size), window=2 * workers)


def indexed_writer_class() -> tuple[type, type]:
    """(``IndexedWriter``, Megatron-Core's ``DType``), imported quietly (and torch with them)."""
    with warnings.catch_warnings():   # Megatron-Core's package imports its optimizer: "Apex is not installed"
        warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed")
        from megatron.core.datasets.indexed_dataset import DType

        from moe_plugin.data.indexed import IndexedWriter
    return IndexedWriter, DType


def commit_outputs(prefix: str, writers: Sequence, manifest: dict) -> None:
    """Rename the ``writers``' files into place, then write ``PREFIX.json`` (last: it says the data is whole)."""
    Path(f"{prefix}.json").unlink(missing_ok=True)   # an old manifest (--overwrite) would mislead
    for writer in writers:
        writer.commit()
    _write_manifest(prefix, manifest)


def output_prefixes(output_prefix: PathLike, json_keys: Sequence[str]) -> dict:
    """json key -> the prefix its dataset is written to (``PREFIX`` for one key, ``PREFIX_<key>`` for several)."""
    prefix = str(output_prefix)
    return {json_keys[0]: prefix} if len(json_keys) == 1 else {key: f"{prefix}_{key}" for key in json_keys}


def preprocess_jsonl(input: PathLike, tokenizer_dir: PathLike, output_prefix: PathLike,
                     json_keys: Sequence[str] = ("text",), append_eod: bool = True, workers: int = 1,
                     overwrite: bool = False, progress: bool = True) -> Preprocessed:
    """Tokenize the JSON lines of ``input`` into ``output_prefix.{bin,idx}`` and ``output_prefix.json``."""
    input_path = Path(input)
    json_keys = list(json_keys)
    prefixes = check_preprocess_args(input_path, output_prefix, json_keys, workers, overwrite)
    tokenizer = load_hf_tokenizer(tokenizer_dir)
    vocab_size = len(tokenizer)
    eod = tokenizer.eos_token_id if append_eod else None
    if append_eod and eod is None:
        raise ConfigError("--tokenizer", str(tokenizer_dir), "has no EOS token to end each document with "
                          "(eos_token in its tokenizer_config.json); set one, or pass --no-append-eod")
    first = first_line(input_path)
    texts_of(first[1], first[0], str(input_path), json_keys)   # a wrong key or a non-JSON file: refused now
    IndexedWriter, DType = indexed_writer_class()
    dtype = DType.optimal_dtype(vocab_size)

    skipped = dict.fromkeys(json_keys, 0)
    bar = progress_bar(input_path, next(iter(prefixes.values())), progress)
    with ExitStack() as stack:
        stack.callback(bar.close)
        writers = {key: stack.enter_context(IndexedWriter(prefix, dtype)) for key, prefix in prefixes.items()}
        for size, per_line in encoded_chunks(stack, input_path, workers, tokenizer, tokenizer_dir, _TextEncoder,
                                             str(input_path), json_keys, eod):
            for arrays in per_line:
                for key, ids in zip(json_keys, arrays):
                    if ids.size:
                        writers[key].add(ids)
                    else:
                        skipped[key] += 1
            bar.update(size)
        for key, writer in writers.items():
            if writer.documents == 0:
                raise ConfigError("--input", str(input_path), f"no line has a text with tokens at {key!r}: nothing "
                                  "to write", shown="only empty texts")
        done = Preprocessed(prefixes, {k: w.documents for k, w in writers.items()},
                            {k: w.tokens for k, w in writers.items()}, skipped, vocab_size, eod, np.dtype(dtype).name)
        for key, writer in writers.items():
            commit_outputs(prefixes[key], [writer], {
                "input": str(input_path.resolve()), "json_key": key, "tokenizer": str(Path(tokenizer_dir).resolve()),
                "vocab_size": vocab_size, "eod": eod, "dtype": done.dtype, "documents": done.documents[key],
                "tokens": done.tokens[key], "skipped_empty": skipped[key]})
    return done


def check_preprocess_args(input_path: Path, output_prefix: PathLike, json_keys: list, workers: int,
                          overwrite: bool) -> dict:
    """The checks that need no tokenizer; returns ``output_prefixes``."""
    check_input(input_path, json_keys)
    prefixes = output_prefixes(output_prefix, json_keys)
    check_outputs(output_prefix, list(prefixes.values()), workers, overwrite)
    return prefixes


def check_outputs(output_prefix: PathLike, prefixes: Sequence[str], workers: int, overwrite: bool) -> None:
    """``workers`` >= 1, ``output_prefix`` a prefix, no file of ``prefixes`` there unless ``overwrite``."""
    if workers < 1:
        raise ConfigError("--workers", workers, "expected an integer >= 1")
    prefix = str(output_prefix)
    if prefix.endswith((".bin", ".idx")) or Path(prefix).is_dir() or prefix.endswith(os.sep):
        raise ConfigError("--output-prefix", prefix, "expected a path prefix without .bin/.idx, e.g. data/my-corpus "
                          "(written: data/my-corpus.bin and .idx)")
    existing = [f"{p}{ext}" for p in prefixes for ext in (".bin", ".idx", ".json") if Path(f"{p}{ext}").exists()]
    if existing and not overwrite:
        raise ConfigError("--output-prefix", prefix, f"{', '.join(existing)} exist(s); pass --overwrite to replace "
                          "them")


def check_input(input_path: Path, json_keys: Sequence[str]) -> None:
    """``input_path`` is a file, ``json_keys`` distinct non-empty names."""
    check_input_file(input_path)
    if not json_keys or len(set(json_keys)) != len(json_keys) or not all(json_keys):
        raise ConfigError("--json-keys", list(json_keys), "expected one or more distinct, non-empty keys")


def check_input_file(input_path: Path) -> None:
    if not input_path.is_file():
        raise ConfigError("--input", str(input_path), "expected a file of JSON lines: " +
                          ("it is a directory" if input_path.is_dir() else "not found"))


def iter_texts(input: PathLike, json_keys: Sequence[str] = ("text",)) -> Iterator[str]:
    """The texts at ``json_keys`` of every non-blank line of ``input``, checked as ``preprocess_jsonl`` does."""
    path = Path(input)
    check_input(path, json_keys)
    first_line(path)
    with open(path, "rb") as stream:
        for number, line in enumerate(stream, start=1):
            if line.strip():
                yield from texts_of(line, number, str(path), json_keys)


def first_line(path: Path) -> tuple[int, bytes]:
    """The first non-blank line and its number; an empty file is a ``ConfigError``."""
    with open(path, "rb") as stream:
        for number, line in enumerate(stream, start=1):
            if line.strip():
                return number, line
    raise ConfigError("--input", str(path), "holds no JSON line: the file is empty", shown="an empty file")


def _chunks(path: Path, chunk_bytes: int) -> Iterator[list[tuple[int, bytes]]]:
    """The lines with their 1-based numbers, in chunks of about ``chunk_bytes``."""
    chunk, size = [], 0
    with open(path, "rb") as stream:
        for number, line in enumerate(stream, start=1):
            chunk.append((number, line))
            size += len(line)
            if size >= chunk_bytes:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


def progress_bar(input_path: Path, target: str, enabled: bool):
    """A bar over the input's bytes, on stderr."""
    from tqdm import tqdm

    return tqdm(total=input_path.stat().st_size, unit="B", unit_scale=True, file=sys.stderr, disable=not enabled,
                desc=f"preprocess {input_path.name} -> {Path(target).name}")


def _write_manifest(prefix: str, manifest: dict) -> None:
    tmp = Path(f"{prefix}.json.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp, f"{prefix}.json")
    finally:
        tmp.unlink(missing_ok=True)
