"""A byte-level tokenizer: the UTF-8 bytes of a text are its tokens, plus one end-of-document token.

    tok = ByteTokenizer()
    ids = tok.encode("def f(): pass")          # numpy uint16, values 0..255
    tok.decode(ids) == "def f(): pass"
    tok.eod                                    # 256, appended after every document
    tok.padded_vocab_size(tensor_parallel=2)   # 384: the embedding / output layer size

Nothing to train or download. The vocabulary pads to 384 whatever the TP size (not Megatron's 128 x TP),
so the model is the same for every layout: docs/design/data_pipeline.md.
"""
from __future__ import annotations

import math
from typing import Union

import numpy as np

NUM_BYTES = 256


def pad_vocab_size(vocab_size: int, divisible_by: int = 128, tensor_parallel: int = 1) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by``, which must split over ``tensor_parallel``."""
    if vocab_size < 1 or divisible_by < 1 or tensor_parallel < 1:
        raise ValueError(f"vocab_size ({vocab_size}), divisible_by ({divisible_by}) and tensor_parallel "
                         f"({tensor_parallel}) must be positive")
    padded = math.ceil(vocab_size / divisible_by) * divisible_by
    if padded % tensor_parallel:
        raise ValueError(f"the padded vocabulary ({padded} = {vocab_size} padded to a multiple of {divisible_by}) "
                         f"does not split over {tensor_parallel} tensor-parallel ranks; use a "
                         f"--make-vocab-size-divisible-by that {tensor_parallel} divides")
    return padded


class ByteTokenizer:
    """Tokens 0..255 are bytes, ``eod`` (256) ends a document. ``vocab_size`` is 257 before padding."""

    eod = NUM_BYTES
    vocab_size = NUM_BYTES + 1
    dtype = np.uint16  # what Megatron's indexed dataset picks for a vocabulary under 65,500

    def __init__(self, divisible_by: int = 128):
        self.divisible_by = divisible_by

    def padded_vocab_size(self, tensor_parallel: int = 1) -> int:
        return pad_vocab_size(self.vocab_size, self.divisible_by, tensor_parallel)

    def encode(self, text: Union[str, bytes]) -> np.ndarray:
        """The bytes of ``text`` (UTF-8 for a ``str``) as token ids, without ``eod``."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8).astype(self.dtype)

    def encode_document(self, text: Union[str, bytes]) -> np.ndarray:
        """``encode(text)`` followed by ``eod``: one document of the training stream."""
        ids = self.encode(text)
        return np.append(ids, np.array([self.eod], dtype=self.dtype))

    def decode(self, ids, eod_text: str = "\n<|eod|>\n") -> str:
        """Token ids back to text; ``eod`` becomes ``eod_text``; padding ids and invalid bytes U+FFFD."""
        out, run = [], bytearray()
        for token in np.asarray(ids).reshape(-1).tolist():
            if token < NUM_BYTES:
                run.append(token)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            out.append(eod_text if token == self.eod else "\ufffd")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)
