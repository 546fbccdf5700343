"""Data for GPT training: Megatron's indexed format, tokenizers, the embedded stdlib corpus, chat data
with a loss mask, samples with a held-out split, packed conversations and layout-independent global
batches.

Names are imported on first use: the package is light; ``read_indexed`` and its kin import
Megatron-Core's dataset module (and torch), the Hugging Face ones ``transformers``. How each piece
works: docs/design/data_pipeline.md.
"""
from moe_plugin.lazy import lazy_getattr

_LAZY = {
    "GlobalBatches": "batches",
    "micro_batch_rows": "batches",
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
    "DEFAULT_MAX_BYTES": "stdlib_corpus",
    "corpus_manifest": "stdlib_corpus",
    "corpus_prefix": "stdlib_corpus",
    "ensure_stdlib_corpus": "stdlib_corpus",
    "stdlib_documents": "stdlib_corpus",
    "stdlib_files": "stdlib_corpus",
    "stdlib_jsonl": "stdlib_corpus",
    "ByteTokenizer": "tokenizer",
    "pad_vocab_size": "tokenizer",
    "load_hf_tokenizer": "hf_tokenizer",
    "train_bpe_tokenizer": "hf_tokenizer",
    "preprocess_jsonl": "preprocess",
    "is_chat_dataset": "chat",
    "preprocess_chat_jsonl": "chat",
    "read_chat_dataset": "chat",
    "render_chat": "chat",
    "render_turns": "chat",
}

__all__ = sorted(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
