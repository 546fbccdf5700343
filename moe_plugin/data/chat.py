"""Conversations to tokens and a loss mask: JSON lines through a tokenizer's chat template into two
indexed datasets of the same document lengths.

    preprocess_chat_jsonl("chats.jsonl", "tokenizers/chat", "data/chats", workers=4)
    # data/chats.{bin,idx} (tokens), data/chats_loss_mask.{bin,idx} (uint8 0/1), data/chats.json
    tokens, mask = read_chat_dataset("data/chats")

The mask is 1 on what the model generates for each assistant turn, found from token prefixes; a
template that is not prefix-stable is refused naming the turn, never given a wrong mask
(``split_turns``: one document per assistant turn). Usage: docs/fine_tuning.md; the rule:
docs/design/data_pipeline.md.
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from moe_plugin.configs.errors import ConfigError
from moe_plugin.data.hf_tokenizer import load_hf_tokenizer
from moe_plugin.data.preprocess import (
    LineEncoder,
    PathLike,
    check_input_file,
    check_outputs,
    commit_outputs,
    encoded_chunks,
    first_line,
    indexed_writer_class,
    json_object,
    missing_key,
    progress_bar,
)

FORMAT = "chat"
MASK_SUFFIX = "_loss_mask"


@dataclass(frozen=True)
class ChatPreprocessed:
    """What ``preprocess_chat_jsonl`` wrote (also in ``PREFIX.json``)."""
    prefix: str
    loss_mask: str             # the mask's prefix
    conversations: int         # conversations read
    documents: int             # documents written (conversations, or assistant turns with split_turns)
    tokens: int
    loss_tokens: int           # mask 1
    dropped: int               # conversations with nothing to learn, left out
    vocab_size: int
    dtype: str


def render_chat(tokenizer, messages: list, name: str = "messages") -> tuple[np.ndarray, np.ndarray]:
    """``(tokens_T, mask_T)`` of one conversation; a ``ConfigError`` naming ``name[k]`` for a bad turn."""
    _check_messages(messages, name)
    tokens = _ids(tokenizer, messages, name)
    mask = np.zeros(len(tokens), dtype=np.uint8)
    for k in _assistant_turns(messages):
        prompt, through = _turn(tokenizer, messages, k, name, tokens if k == len(messages) - 1 else None)
        if tokens[:len(through)] != through:
            raise ConfigError(f"{name}[{k}]", "assistant", f"the chat template is not prefix-stable: {name}[:{k + 1}] "
                              "does not render to a token prefix of the whole conversation (the template renders "
                              "this turn otherwise once later turns follow, as Qwen3's drops earlier <think> "
                              "reasoning), so its loss mask cannot be found; make each assistant turn its own "
                              "document (--chat-split-turns, split_turns=True)", shown=f"assistant turn {k}")
        mask[len(prompt):len(through)] = 1
    return np.asarray(tokens, dtype=np.int64), mask


def render_turns(tokenizer, messages: list, name: str = "messages") -> list[tuple[np.ndarray, np.ndarray]]:
    """Per assistant turn k, ``(tokens_T, mask_T)`` of ``messages[:k+1]`` with only turn k masked."""
    _check_messages(messages, name)
    documents = []
    for k in _assistant_turns(messages):
        prompt, through = _turn(tokenizer, messages, k, name)
        mask = np.zeros(len(through), dtype=np.uint8)
        mask[len(prompt):] = 1
        documents.append((np.asarray(through, dtype=np.int64), mask))
    return documents


def _turn(tokenizer, messages: list, k: int, name: str, through: Optional[list] = None) -> tuple[list, list]:
    """The tokens of ``messages[:k]`` + generation prompt and of ``messages[:k+1]`` (the first a prefix)."""
    prompt = _ids(tokenizer, messages[:k], name, generation_prompt=True)
    through = _ids(tokenizer, messages[:k + 1], name) if through is None else through
    if through[:len(prompt)] != prompt:
        raise ConfigError(f"{name}[{k}]", "assistant", f"the chat template is not prefix-stable: {name}[:{k}] with "
                          f"the generation prompt does not render to a token prefix of {name}[:{k + 1}] (its "
                          "assistant header differs from its generation prompt), so the turn's loss mask cannot be "
                          "found", shown=f"assistant turn {k}")
    return prompt, through


def _ids(tokenizer, messages: list, name: str, generation_prompt: bool = False) -> list[int]:
    from jinja2 import TemplateError

    try:
        return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                  add_generation_prompt=generation_prompt)["input_ids"])
    except (TemplateError, TypeError) as err:
        raise _refused(tokenizer, messages, name, err) from None


def _refused(tokenizer, messages: list, name: str, err: Exception) -> ConfigError:
    """The error naming the first message whose prefix the template refuses to render."""
    from jinja2 import TemplateError

    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    for j in range(len(messages)):
        try:
            tokenizer.apply_chat_template(messages[:j + 1], tokenize=False)
        except (TemplateError, TypeError):
            break
    return ConfigError(f"{name}[{j}]", messages[j]["role"], f"the chat template refuses this message: {first}",
                       shown=f"role {messages[j]['role']!r}")


def _check_messages(messages, name: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ConfigError(name, messages, "expected a non-empty list of {role, content} objects",
                          shown="an empty list" if messages == [] else f"a JSON {_json_type(messages)}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ConfigError(f"{name}[{i}]", message, "expected a {role, content} object",
                              shown=f"a JSON {_json_type(message)}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ConfigError(f"{name}[{i}]", message.get(key), f"expected a string at {key!r}",
                                  shown=f"no {key!r}" if key not in message else
                                  f"a JSON {_json_type(message[key])} at {key!r}")
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise ConfigError(name, roles, "expected at least one message with role 'assistant' (a turn to learn)",
                          shown=f"roles {roles}"[:80])
    if roles[0] == "assistant":
        raise ConfigError(f"{name}[0]", "assistant", "expected a message before the first assistant turn (its "
                          "prompt)", shown="an assistant turn first")


def _assistant_turns(messages: list) -> list[int]:
    return [k for k, message in enumerate(messages) if message["role"] == "assistant"]


def _json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


class _ChatEncoder(LineEncoder):
    """A line to its documents: ``(tokens_T, mask_T)`` pairs (one, or one per assistant turn)."""

    def __init__(self, tokenizer, input_name: str, chat_key: str, split_turns: bool):
        super().__init__(tokenizer, input_name)
        self.chat_key = chat_key
        self.split_turns = split_turns

    def line(self, number: int, line: bytes) -> list[tuple[np.ndarray, np.ndarray]]:
        where = f"{self.input_name}:{number}"
        record = json_object(line, where, f"expected a JSON object with the key {self.chat_key!r} (--chat-key)")
        if self.chat_key not in record:
            raise missing_key(where, record, self.chat_key, "--chat-key")
        try:
            if self.split_turns:
                return render_turns(self.tokenizer, record[self.chat_key], self.chat_key)
            return [render_chat(self.tokenizer, record[self.chat_key], self.chat_key)]
        except ConfigError as err:
            raise ConfigError(f"{where}: {err.path}", err.value, err.expected, err.shown) from None


def preprocess_chat_jsonl(input: PathLike, tokenizer_dir: PathLike, output_prefix: PathLike, *,
                          chat_key: str = "messages", split_turns: bool = False, workers: int = 1,
                          overwrite: bool = False, progress: bool = True) -> ChatPreprocessed:
    """Render the conversations at ``chat_key`` of ``input`` into ``output_prefix`` and its loss mask."""
    input_path = Path(input)
    check_input_file(input_path)
    if not chat_key:
        raise ConfigError("--chat-key", chat_key, "expected a non-empty key")
    prefix = str(output_prefix)
    mask_prefix = prefix + MASK_SUFFIX
    check_outputs(prefix, [prefix, mask_prefix], workers, overwrite)
    tokenizer = load_hf_tokenizer(tokenizer_dir)
    if not tokenizer.chat_template:
        raise ConfigError("--tokenizer", str(tokenizer_dir), "has no chat template (chat_template.jinja, or "
                          "chat_template in tokenizer_config.json): --chat renders conversations with it")
    try:
        import jinja2  # noqa: F401  (transformers renders chat templates with it; not among its requirements)
    except ImportError:
        raise ConfigError("--chat", str(tokenizer_dir), "needs the jinja2 package to render the chat template, "
                          "which is not installed: pip install jinja2") from None
    vocab_size = len(tokenizer)
    number, line = first_line(input_path)
    _ChatEncoder(tokenizer, str(input_path), chat_key, split_turns).line(number, line)   # a bad first line: now
    IndexedWriter, DType = indexed_writer_class()
    dtype = DType.optimal_dtype(vocab_size)

    conversations = dropped = loss_tokens = 0
    bar = progress_bar(input_path, prefix, progress)
    with ExitStack() as stack:
        stack.callback(bar.close)
        tokens = stack.enter_context(IndexedWriter(prefix, dtype))
        mask = stack.enter_context(IndexedWriter(mask_prefix, np.uint8))
        for size, per_line in encoded_chunks(stack, input_path, workers, tokenizer, tokenizer_dir, _ChatEncoder,
                                             str(input_path), chat_key, split_turns):
            for documents in per_line:
                conversations += 1
                kept = [(ids, m) for ids, m in documents if m.any()]
                dropped += not kept
                for ids, m in kept:
                    tokens.add(ids)
                    mask.add(m)
                    loss_tokens += int(m.sum())
            bar.update(size)
        if tokens.documents == 0:
            raise ConfigError("--input", str(input_path), f"no conversation at {chat_key!r} has a token to learn: "
                              "nothing to write", shown="only empty assistant turns")
        done = ChatPreprocessed(prefix, mask_prefix, conversations, tokens.documents, tokens.tokens, loss_tokens,
                                dropped, vocab_size, np.dtype(dtype).name)
        commit_outputs(prefix, [mask, tokens], {
            "format": FORMAT, "input": str(input_path.resolve()), "chat_key": chat_key, "split_turns": split_turns,
            "tokenizer": str(Path(tokenizer_dir).resolve()), "vocab_size": vocab_size, "eod": tokenizer.eos_token_id,
            "dtype": done.dtype, "loss_mask": Path(mask_prefix).name, "conversations": conversations,
            "documents": done.documents, "tokens": done.tokens, "loss_tokens": loss_tokens, "dropped": dropped})
    return done


def _manifest(prefix: PathLike) -> Optional[dict]:
    try:
        manifest = json.loads(Path(f"{prefix}.json").read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def is_chat_dataset(prefix: PathLike) -> bool:
    """Whether ``PREFIX.json`` exists and says ``"format": "chat"``."""
    manifest = _manifest(prefix)
    return manifest is not None and manifest.get("format") == FORMAT


def read_chat_dataset(prefix: PathLike):
    """``(tokens, mask)`` of ``preprocess_chat_jsonl``'s output, checked against each other."""
    from moe_plugin.data.indexed import read_indexed

    manifest = _manifest(prefix)
    if manifest is None or manifest.get("format") != FORMAT:
        raise ConfigError(f"{prefix}.json", None if manifest is None else manifest.get("format"),
                          'expected "format": "chat", as moe-plugin preprocess --chat writes it',
                          shown="no JSON object" if manifest is None else f"format {manifest.get('format')!r}")
    name = manifest.get("loss_mask")
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise ConfigError(f"{prefix}.json", name, "expected at \"loss_mask\" the name of the mask's prefix in the "
                          "same directory (no path)")
    mask_prefix = str(Path(str(prefix)).parent / name)
    tokens, mask = read_indexed(prefix), read_indexed(mask_prefix)
    if mask.index.dtype != np.uint8:
        raise ConfigError(f"{mask_prefix}.idx", np.dtype(mask.index.dtype).name, "expected a uint8 loss mask",
                          shown=f"token type {np.dtype(mask.index.dtype).name}")
    if (not np.array_equal(tokens.document_indices, mask.document_indices)
            or not np.array_equal(tokens.sequence_lengths, mask.sequence_lengths)):
        raise ConfigError(f"{mask_prefix}.idx", len(mask.document_indices) - 1, f"expected the documents of "
                          f"{prefix}.idx ({len(tokens.document_indices) - 1:,}, of the same lengths): the loss mask "
                          "belongs to other tokens", shown=f"{len(mask.document_indices) - 1:,} documents"
                          + ("" if len(mask) != len(tokens) else " of other lengths"))
    return tokens, mask
