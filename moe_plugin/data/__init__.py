"""Data for GPT training: Megatron's indexed format, a byte tokenizer, the embedded stdlib corpus,
samples over a document stream with a held-out split, and layout-independent global batches.

* ``tokenizer``: ``ByteTokenizer`` (256 bytes + end of document), ``pad_vocab_size``.
* ``indexed``: ``read_indexed`` / ``write_indexed`` through Megatron-Core's ``IndexedDataset``.
* ``stdlib_corpus``: ``ensure_stdlib_corpus(cache_dir)``, the Python stdlib as an offline corpus.
* ``samples``: ``split_documents``, ``TokenSamples`` (windows of seq_length + 1 tokens).
* ``batches``: ``GlobalBatches``, the seeded per-step global batch and each rank's rows of it.

Importing this package imports Megatron-Core's dataset module (and torch), not its models.
"""
from moe_plugin.data.batches import GlobalBatches
from moe_plugin.data.indexed import (
    document_sequences,
    indexed_exists,
    num_documents,
    read_indexed,
    write_indexed,
)
from moe_plugin.data.samples import TokenSamples, split_documents
from moe_plugin.data.stdlib_corpus import (
    DEFAULT_MAX_BYTES,
    corpus_manifest,
    corpus_prefix,
    ensure_stdlib_corpus,
    stdlib_documents,
    stdlib_files,
)
from moe_plugin.data.tokenizer import ByteTokenizer, pad_vocab_size

__all__ = [
    "DEFAULT_MAX_BYTES", "ByteTokenizer", "GlobalBatches", "TokenSamples", "corpus_manifest", "corpus_prefix",
    "document_sequences", "ensure_stdlib_corpus", "indexed_exists", "num_documents", "pad_vocab_size",
    "read_indexed", "split_documents", "stdlib_documents", "stdlib_files", "write_indexed",
]
