"""Hugging Face tokenizers: load one from a directory, or train a small byte-level BPE here.

    tokenizer = load_hf_tokenizer("tokenizers/stdlib-bpe")   # transformers' AutoTokenizer, checked first
    len(tokenizer), tokenizer.eos_token_id                  # vocabulary size, end of document
    train_bpe_tokenizer(texts, "tokenizers/stdlib-bpe", vocab_size=4096)

Both need the ``hf`` extra (``pip install 'moe_plugin[hf]'``), imported on first use; without it the
error is one line naming the extra. The vocabulary size is ``len(tokenizer)``, as Megatron counts it.
The trained BPE is for trying the pipeline offline, not for a real model (docs/design/data_pipeline.md).
"""
from __future__ import annotations

import importlib
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any, Union

from moe_plugin.configs.errors import ConfigError

PathLike = Union[str, os.PathLike]
HF_EXTRA = "pip install 'moe_plugin[hf]'"
EOD_TOKEN = "<|endoftext|>"
# What save_pretrained writes for one tokenizer or another; a directory with none of them holds no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model")


def hf_module(name: str, flag: str, value: Any) -> ModuleType:
    """``import name`` (transformers or tokenizers); a ``ConfigError`` naming ``flag`` and the extra if missing."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ConfigError(flag, str(value), f"needs the {name} package, which is not installed: {HF_EXTRA}") from None


def load_hf_tokenizer(directory: PathLike, flag: str = "--tokenizer"):
    """The tokenizer saved in ``directory`` (local files only), or a ``ConfigError`` naming ``flag``."""
    path = Path(directory)
    if not path.is_dir():
        raise ConfigError(flag, str(directory), "expected a Hugging Face tokenizer directory (what "
                          "save_pretrained writes): " + ("it is a file" if path.exists() else "not found"))
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(flag, str(directory), f"holds no tokenizer: expected one of {', '.join(TOKENIZER_FILES)} "
                          "(what save_pretrained writes)")
    _confine(path, flag)
    transformers = hf_module("transformers", flag, directory)
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(flag, str(directory), f"transformers cannot load a tokenizer from it: {first}") from None


# What AutoTokenizer may read from a tokenizer directory, by name (besides ``TOKENIZER_FILES``).
READ_BY_NAME = ("special_tokens_map.json", "added_tokens.json", "merges.txt", "chat_template.jinja", "config.json")


def _confine(path: Path, flag: str) -> None:
    """Refuse a tokenizer file of ``path`` that links out of it or is a hard link, naming ``flag``."""
    from moe_plugin.checkpoint.confine import hf_cache_root, inside

    for name in (*TOKENIZER_FILES, *READ_BY_NAME):
        if os.path.lexists(path / name):
            try:
                inside(str(path), name, str(path / name), within=hf_cache_root(str(path)))
            except ValueError as err:
                raise ConfigError(flag, str(path), str(err)) from None


def train_bpe_tokenizer(texts: Iterable[str], out_dir: PathLike, vocab_size: int = 4096,
                        overwrite: bool = False) -> Path:
    """Train a byte-level BPE of ``vocab_size`` tokens on ``texts`` into ``out_dir`` (deterministic, whole)."""
    out = Path(out_dir)
    if vocab_size < 300 or vocab_size >= 65500:
        raise ConfigError("--vocab-size", vocab_size, "expected 300..65499 (256 bytes, the end-of-document "
                          "token and merges; a small tokenizer for trying the pipeline)")
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise ConfigError("--out", str(out), "exists and is not empty; pass --overwrite to replace it")
    tokenizers = hf_module("tokenizers", "--out", out)
    transformers = hf_module("transformers", "--out", out)
    byte_level = tokenizers.pre_tokenizers.ByteLevel
    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = byte_level(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN],
                                             initial_alphabet=byte_level.alphabet(), show_progress=False)
    model.train_from_iterator(texts, trainer)
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=model, eos_token=EOD_TOKEN)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    try:
        wrapped.save_pretrained(str(tmp))
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out
