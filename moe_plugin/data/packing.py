"""Conversations packed whole into sequences, and the packed, masked batches a model trains on.

    packs = PackedConversations(tokens, loss_mask, documents, seq_length=1024)   # read_chat_dataset's pair
    batch = packs.batch([4, 0, 9])                     # a PackedBatch: [3, 1024] tensors
    thd = batch.thd()                                  # one row of 3 * 1024 tokens, Megatron's PackedSeqParams
    losses = model(thd.tokens, thd.position_ids, None, labels=thd.labels,
                   packed_seq_params=thd.packed_seq_params, padding_mask=thd.document_ids)

Best-fit decreasing, the same on every rank; positions restart and attention stays inside each
conversation; padding (document id -1) is never routed and has no loss. ``token_weights`` makes a
step's loss independent of the layout. Rules: docs/design/data_pipeline.md.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
import numpy as np
import torch
from torch import Tensor

from moe_plugin.configs.errors import ConfigError

OVERFLOW = ("truncate", "refuse")
EMPTY = -1   # a pack index that stands for a pack of padding only (fills a last, partial batch)


def pack_lengths(lengths: np.ndarray, seq_length: int) -> list[np.ndarray]:
    """Best-fit decreasing: the indices of ``lengths`` grouped into packs of at most ``seq_length`` tokens."""
    if seq_length < 1:
        raise ValueError(f"seq_length: got {seq_length}; expected >= 1")
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.max() > seq_length or lengths.min() < 1):
        raise ValueError(f"lengths must be 1..{seq_length}; got {lengths.min()}..{lengths.max()}")
    open_by_room: list[list[int]] = [[] for _ in range(seq_length + 1)]   # room left -> open packs
    count_by_room = np.zeros(seq_length + 1, dtype=np.int64)
    packs: list[list[int]] = []
    for i in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[i])
        fits = np.flatnonzero(count_by_room[n:])
        if fits.size:
            room = n + int(fits[0])
            pack = open_by_room[room].pop()
            count_by_room[room] -= 1
        else:
            room, pack = seq_length, len(packs)
            packs.append([])
        packs[pack].append(i)
        open_by_room[room - n].append(pack)
        count_by_room[room - n] += 1
    return [np.asarray(p, dtype=np.int64) for p in packs]


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch's packs, [B, S] each: tokens, labels, loss mask, positions, document ids (-1: padding)."""

    tokens: Tensor
    labels: Tensor
    loss_mask: Tensor
    position_ids: Tensor
    document_ids: Tensor

    def thd(self) -> "PackedBatch":
        """The batch as one row of B * S tokens (Megatron's ``thd``) with its ``packed_seq_params``."""
        return ThdBatch.of(self)

    def to(self, device) -> "PackedBatch":
        return type(self)(**{k: getattr(self, k).to(device) for k in self.__dataclass_fields__})


@dataclass(frozen=True)
class ThdBatch(PackedBatch):
    """A ``PackedBatch`` of one row and its Megatron ``PackedSeqParams`` (thd, ``cu_seqlens`` int32)."""

    packed_seq_params: object = None

    @classmethod
    def of(cls, batch: PackedBatch) -> "ThdBatch":
        row = {k: getattr(batch, k).reshape(1, -1) for k in PackedBatch.__dataclass_fields__}
        return cls(**row, packed_seq_params=packed_seq_params(row["document_ids"][0]))

    def to(self, device) -> "ThdBatch":
        moved = {k: getattr(self, k).to(device) for k in PackedBatch.__dataclass_fields__}
        params = self.packed_seq_params
        return type(self)(**moved, packed_seq_params=replace(
            params, cu_seqlens_q=params.cu_seqlens_q.to(device), cu_seqlens_kv=params.cu_seqlens_kv.to(device)))


def packed_seq_params(document_T: Tensor):
    """Megatron's ``PackedSeqParams`` (thd) of one row: a sequence starts where the document id changes."""
    from megatron.core.packed_seq_params import PackedSeqParams

    document_T = document_T.cpu()
    t = document_T.numel()
    starts = torch.ones(t, dtype=torch.bool)
    starts[1:] = document_T[1:] != document_T[:-1]
    cu = torch.cat([starts.nonzero().flatten(), torch.tensor([t])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(), max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def token_weights(loss_mask: Tensor, global_tokens: int, replicas: int) -> Tensor:
    """Each token's loss weight, ``loss_mask * replicas / global_tokens``: the global batch's mean."""
    return loss_mask * (replicas / max(int(global_tokens), 1))


class PackedConversations:
    """Conversations (two indexed datasets of the same lengths) packed into ``seq_length`` tokens."""

    def __init__(self, tokens, loss_mask, documents: Sequence[int], seq_length: int, *, overflow: str = "truncate",
                 name: str = "conversations", flag: str = "--seq-length", pack: bool = True):
        from moe_plugin.data.indexed import document_sequences

        if overflow not in OVERFLOW:
            raise ValueError(f"overflow: got {overflow!r}; expected one of {OVERFLOW}")
        self.tokens, self.loss_mask, self.seq_length, self.name = tokens, loss_mask, seq_length, name
        self.sequences = document_sequences(tokens, np.asarray(documents, dtype=np.int64))
        lengths = tokens.sequence_lengths[self.sequences].astype(np.int64)
        if lengths.size == 0:
            raise ConfigError(flag, seq_length, f"{name}: no conversation to pack")
        long = np.flatnonzero(lengths > seq_length)
        if long.size and overflow == "refuse":
            i = int(long[0])
            raise ConfigError(flag, seq_length, f"{name}: conversation {int(self.sequences[i])} has {int(lengths[i]):,} "
                              f"tokens, more than a sequence holds ({long.size:,} such); use a longer --seq-length or "
                              "--conversation-overflow truncate")
        self.truncated = int(long.size)
        self.lengths = np.minimum(lengths, seq_length)
        self.packs = (pack_lengths(self.lengths, seq_length) if pack   # pack=False: one conversation a sequence
                      else [np.array([k], dtype=np.int64) for k in range(len(self.lengths))])
        self.real_tokens = int(self.lengths.sum())
        self._loss_tokens = np.array([self._pack_loss_tokens(p) for p in self.packs], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.packs)

    @property
    def efficiency(self) -> float:
        """Real tokens over the tokens the packs compute."""
        return self.real_tokens / (len(self.packs) * self.seq_length)

    def loss_tokens(self, indices: Sequence[int]) -> int:
        """The number of trained labels in the packs ``indices`` (``EMPTY``: none)."""
        return int(sum(int(self._loss_tokens[i]) for i in indices if i != EMPTY))

    def _conversation(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        seq, n = int(self.sequences[k]), int(self.lengths[k])
        return (self.tokens.get(seq, offset=0, length=n).astype(np.int64),
                self.loss_mask.get(seq, offset=0, length=n).astype(np.float32))

    def _pack_loss_tokens(self, pack: np.ndarray) -> int:
        return int(sum(self._conversation(int(k))[1][1:].sum() for k in pack))

    def sample(self, index: int, first_document: int = 0) -> dict[str, np.ndarray]:
        """Pack ``index`` (``EMPTY``: padding only) as [S] arrays, conversations numbered from ``first_document``."""
        S = self.seq_length
        out = dict(tokens=np.zeros(S, np.int64), labels=np.zeros(S, np.int64), loss_mask=np.zeros(S, np.float32),
                   position_ids=np.zeros(S, np.int64), document_ids=np.full(S, -1, np.int64))
        at = 0
        for j, k in enumerate(self.packs[index].tolist() if index != EMPTY else []):
            tokens, mask = self._conversation(k)
            n = tokens.size
            out["tokens"][at:at + n] = tokens
            out["labels"][at:at + n - 1] = tokens[1:]
            out["loss_mask"][at:at + n - 1] = mask[1:]
            out["position_ids"][at:at + n] = np.arange(n)
            out["document_ids"][at:at + n] = first_document + j
            at += n
        out["position_ids"][at:] = np.arange(S - at)
        return out

    def batch(self, indices: Sequence[int]) -> PackedBatch:
        """The packs ``indices`` as one ``PackedBatch`` [len(indices), S] (document ids unique in it)."""
        rows, first = [], 0
        for i in indices:
            rows.append(self.sample(int(i), first))
            first += 0 if int(i) == EMPTY else len(self.packs[int(i)])
        return PackedBatch(**{k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in rows[0]})

    def describe(self) -> str:
        return (f"{len(self.sequences):,} conversations in {len(self.packs):,} packs of {self.seq_length} tokens "
                f"(packing efficiency {self.efficiency:.1%}; {self.truncated:,} truncated)")


def padded_indices(count: int, multiple: int) -> list[int]:
    """``0 .. count - 1`` followed by ``EMPTY`` up to a multiple of ``multiple``."""
    return list(range(count)) + [EMPTY] * (-count % multiple)
