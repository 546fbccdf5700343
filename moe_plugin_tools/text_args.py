"""``moe-plugin preprocess``, ``train-tokenizer`` and ``stdlib-jsonl``: text to the example's data.

    moe-plugin stdlib-jsonl corpus.jsonl                               # the stdlib corpus as JSON lines
    moe-plugin train-tokenizer --input corpus.jsonl --out tok --vocab-size 4096
    moe-plugin preprocess --input corpus.jsonl --tokenizer tok --output-prefix data/corpus --workers 4
    moe-plugin preprocess --chat --input chats.jsonl --tokenizer tok --output-prefix data/chats   # + a loss mask

The work is ``moe_plugin.data`` (``preprocess_jsonl``, ``preprocess_chat_jsonl``, ``train_bpe_tokenizer``,
``stdlib_jsonl``), imported when a command runs, so building the parser stays light.
"""
from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

DEFAULT_WORKERS = max(1, min(8, os.cpu_count() or 1))


def add_text_parsers(commands: argparse._SubParsersAction) -> None:
    prep = commands.add_parser("preprocess", help="JSON lines of text -> Megatron indexed data (PREFIX.bin/.idx) "
                               "through a Hugging Face tokenizer, each document ended by its EOS",
                               description="What Megatron-LM's tools/preprocess_data.py does for GPT data "
                               "(moe_plugin/data/preprocess.py). Train on the result with the example's "
                               "--data-path PREFIX.")
    prep.add_argument("--input", type=Path, required=True, help="a file of JSON lines, one document each")
    prep.add_argument("--tokenizer", type=Path, required=True, help="a Hugging Face tokenizer directory "
                      "(save_pretrained's; needs the hf extra: pip install 'moe_plugin[hf]')")
    prep.add_argument("--output-prefix", required=True, help="write PREFIX.bin, PREFIX.idx and PREFIX.json "
                      "(several --json-keys: PREFIX_<key>.*)")
    prep.add_argument("--json-keys", nargs="+", default=None, help="the keys holding the text (default: text)")
    prep.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=None,
                      help="end every document with the tokenizer's EOS token (default: on)")
    prep.add_argument("--chat", action="store_true", help="conversations ({role, content} lists) through the "
                      "tokenizer's chat template: PREFIX.bin/.idx the tokens, PREFIX_loss_mask.bin/.idx 1 on what "
                      "each assistant turn generates (moe_plugin/data/chat.py)")
    prep.add_argument("--chat-key", default=None, help="with --chat: the key holding the messages (default: "
                      "messages)")
    prep.add_argument("--chat-split-turns", action="store_true", help="with --chat: each assistant turn its own "
                      "document (the conversation up to it, only it masked), for templates that render earlier "
                      "turns otherwise once later ones follow (Qwen3's <think>)")
    prep.add_argument("--workers", type=int, default=DEFAULT_WORKERS,
                      help=f"processes that tokenize (default: {DEFAULT_WORKERS}, the CPU count up to 8)")
    prep.add_argument("--overwrite", action="store_true", help="replace existing output files")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    prep.set_defaults(run=preprocess)

    train = commands.add_parser("train-tokenizer", help="train a small byte-level BPE on JSON lines (a Hugging "
                                "Face tokenizer directory with an EOS token, for trying preprocess offline)")
    train.add_argument("--input", type=Path, required=True, help="a file of JSON lines (e.g. moe-plugin stdlib-jsonl)")
    train.add_argument("--out", type=Path, required=True, help="the tokenizer directory to write")
    train.add_argument("--json-keys", nargs="+", default=["text"], help="the keys holding the text (default: text)")
    train.add_argument("--vocab-size", type=int, default=4096, help="tokens, EOS included (default 4096)")
    train.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    train.set_defaults(run=train_tokenizer)

    jsonl = commands.add_parser("stdlib-jsonl", help="the Python stdlib corpus as JSON lines ({\"text\", \"path\"} "
                                "per file), the input of train-tokenizer and preprocess")
    jsonl.add_argument("out", type=Path, metavar="OUT.jsonl")
    jsonl.add_argument("--corpus-bytes", type=int, default=4 << 20, help="size cap, as the example's (4 MiB)")
    jsonl.set_defaults(run=stdlib_jsonl)


def preprocess(args: argparse.Namespace) -> None:
    from moe_plugin.configs import ConfigError

    if args.chat:
        for flag, value in (("--json-keys", args.json_keys), ("--append-eod", args.append_eod)):
            if value is not None:
                raise ConfigError(flag, value, "not used with --chat: the conversation is at --chat-key (default "
                                  "messages) and its tokens are the chat template's, as they are")
        return _run_unwinding(preprocess_chat, args)
    for flag, value in (("--chat-key", args.chat_key), ("--chat-split-turns", args.chat_split_turns or None)):
        if value is not None:
            raise ConfigError(flag, value, "only with --chat")
    from moe_plugin.data.preprocess import preprocess_jsonl

    done = _run_unwinding(lambda: preprocess_jsonl(
        args.input, args.tokenizer, args.output_prefix, json_keys=args.json_keys or ["text"],
        append_eod=args.append_eod is not False, workers=args.workers, overwrite=args.overwrite,
        progress=not args.no_progress))
    for key, prefix in done.prefixes.items():
        skipped = f", {done.skipped[key]:,} empty left out" if done.skipped[key] else ""
        print(f"{prefix}.bin/.idx: {done.documents[key]:,} documents{skipped}, {done.tokens[key]:,} {done.dtype} "
              f"tokens; vocabulary {done.vocab_size:,}, EOS {done.eod} (train with --data-path {prefix})")


def preprocess_chat(args: argparse.Namespace) -> None:
    from moe_plugin.data.chat import preprocess_chat_jsonl

    done = preprocess_chat_jsonl(args.input, args.tokenizer, args.output_prefix, chat_key=args.chat_key or "messages",
                                 split_turns=args.chat_split_turns, workers=args.workers, overwrite=args.overwrite,
                                 progress=not args.no_progress)
    turns = f" as {done.documents:,} turn documents" if args.chat_split_turns else ""
    print(f"{done.prefix}.bin/.idx + {done.loss_mask}.bin/.idx: {done.conversations:,} conversations{turns}, "
          f"{done.dropped:,} dropped (nothing to learn), {done.tokens:,} {done.dtype} tokens, {done.loss_tokens:,} "
          f"masked (in the loss); vocabulary {done.vocab_size:,} (train with --data-path {done.prefix})")


def _run_unwinding(run, *args):
    """``run(*args)`` with SIGTERM unwinding like Ctrl-C (the temporary files go)."""
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return run(*args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def train_tokenizer(args: argparse.Namespace) -> None:
    from moe_plugin.data.hf_tokenizer import train_bpe_tokenizer
    from moe_plugin.data.preprocess import check_input, iter_texts

    check_input(args.input, args.json_keys)
    out = train_bpe_tokenizer(iter_texts(args.input, args.json_keys), args.out, args.vocab_size,
                              overwrite=args.overwrite)
    print(f"{out}: byte-level BPE, {args.vocab_size:,} tokens (EOS <|endoftext|>); "
          f"moe-plugin preprocess --tokenizer {out} ...")


def stdlib_jsonl(args: argparse.Namespace) -> None:
    from moe_plugin.data.stdlib_corpus import stdlib_jsonl as write

    if args.corpus_bytes < 1024:
        from moe_plugin.configs import ConfigError

        raise ConfigError("--corpus-bytes", args.corpus_bytes, "expected at least 1024")
    print(write(args.out, args.corpus_bytes))
