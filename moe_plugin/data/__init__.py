"""Data for GPT training: Megatron's indexed format, tokenizers, the embedded stdlib corpus, chat data
with a loss mask, samples with a held-out split, packed conversations and layout-independent global
batches.

The names of ``indexed``, ``samples`` and ``packing`` (Megatron-Core's dataset module, torch) are
imported on first use, the rest plainly (they import numpy; the Hugging Face ones import
``transformers`` when called). How each piece works: docs/design/data_pipeline.md.
lazy: ``moe-plugin stdlib-jsonl`` starts in 0.48 s (391 modules) instead of 7.8 s (3,188: torch, Megatron-Core),
measured 2026-12-02.
"""
from typing import TYPE_CHECKING

from moe_plugin.data.batches import GlobalBatches, micro_batch_rows
from moe_plugin.data.chat import (
    is_chat_dataset,
    preprocess_chat_jsonl,
    read_chat_dataset,
    render_chat,
    render_turns,
)
from moe_plugin.data.hf_tokenizer import load_hf_tokenizer, train_bpe_tokenizer
from moe_plugin.data.preprocess import preprocess_jsonl
from moe_plugin.data.stdlib_corpus import (
    DEFAULT_MAX_BYTES,
    corpus_manifest,
    corpus_prefix,
    ensure_stdlib_corpus,
    stdlib_documents,
    stdlib_files,
    stdlib_jsonl,
)
from moe_plugin.data.tokenizer import ByteTokenizer, pad_vocab_size
from moe_plugin.lazy import lazy_getattr

if TYPE_CHECKING:   # the names _LAZY hands on, for type checkers and go-to-definition
    from moe_plugin.data.indexed import (
        IndexedWriter, document_sequences, indexed_exists, num_documents, read_indexed, write_indexed,
    )
    from moe_plugin.data.packing import PackedBatch, PackedConversations, pack_lengths, token_weights
    from moe_plugin.data.samples import TokenSamples, split_documents

# name -> the submodule that defines it, imported on first use (each imports torch; indexed and samples Megatron-Core)
_LAZY = {
    "PackedBatch": "packing",
    "PackedConversations": "packing",
    "pack_lengths": "packing",
    "token_weights": "packing",
    "IndexedWriter": "indexed",
    "document_sequences": "indexed",
    "indexed_exists": "indexed",
    "num_documents": "indexed",
    "read_indexed": "indexed",
    "write_indexed": "indexed",
    "TokenSamples": "samples",
    "split_documents": "samples",
}

__all__ = ["ByteTokenizer", "DEFAULT_MAX_BYTES", "GlobalBatches", "corpus_manifest", "corpus_prefix",
           "ensure_stdlib_corpus", "is_chat_dataset", "load_hf_tokenizer", "micro_batch_rows", "pad_vocab_size",
           "preprocess_chat_jsonl", "preprocess_jsonl", "read_chat_dataset", "render_chat", "render_turns",
           "stdlib_documents", "stdlib_files", "stdlib_jsonl", "train_bpe_tokenizer", *_LAZY]
__getattr__ = lazy_getattr(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
