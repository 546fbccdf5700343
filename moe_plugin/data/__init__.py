"""Data for GPT training: Megatron's indexed format, tokenizers, the embedded stdlib corpus,
samples over a document stream with a held-out split, and layout-independent global batches.

* ``tokenizer``: ``ByteTokenizer`` (256 bytes + end of document), ``pad_vocab_size``.
* ``hf_tokenizer``: ``load_hf_tokenizer`` (a Hugging Face tokenizer directory; the ``hf`` extra),
  ``train_bpe_tokenizer`` (a small byte-level BPE, trained here).
* ``preprocess``: ``preprocess_jsonl``, JSON lines of text to an indexed dataset with several workers.
* ``chat``: ``preprocess_chat_jsonl``, conversations through a chat template to tokens + a loss mask
  (``render_chat``, ``render_turns``), read back by ``read_chat_dataset`` (``is_chat_dataset``).
* ``indexed``: ``read_indexed`` / ``write_indexed`` / ``IndexedWriter`` through Megatron-Core's
  ``IndexedDataset``.
* ``stdlib_corpus``: ``ensure_stdlib_corpus(cache_dir)``, the Python stdlib as an offline corpus.
* ``samples``: ``split_documents``, ``TokenSamples`` (windows of seq_length + 1 tokens).
* ``batches``: ``GlobalBatches``, the seeded per-step global batch, ``micro_batch_rows``: each rank's rows of it.
* ``packing``: ``PackedConversations`` (chat data packed whole into sequences), ``PackedBatch`` (its tokens,
  labels, loss mask, restarting positions, document ids; ``thd()``: Megatron's packed format), ``token_weights``.

Names are imported on first use: importing the package is light, ``read_indexed`` and the
others that use Megatron-Core's dataset module import it (and torch), the Hugging Face ones
import ``transformers``.
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
