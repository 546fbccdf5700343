"""Megatron-Core spec pieces that also run without CUDA; ``cpu_friendly_spec`` swaps them in.

``SDPAttention`` for ``DotProductAttention``, ``TorchNorm`` for ``WrappedTorchNorm`` (which refuses sequence
parallelism), and QK-norms whose gradients are summed over TP. Design: docs/design/integration_megatron.md.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


class SDPAttention(MegatronModule):
    """Core attention through SDPA; a drop-in for Megatron's ``DotProductAttention``, with its sliding windows,
    attention sinks (``softmax_type``) and packed sequences. Context parallelism and attention bias are refused."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None):
        super().__init__(config=config)
        unsupported = {
            "context_parallel_size > 1": config.context_parallel_size != 1,
            f"softmax_type {config.softmax_type!r}": config.softmax_type not in ("vanilla", "learnable", "off-by-one"),
        }
        for what, present in unsupported.items():
            if present:
                raise NotImplementedError(f"SDPAttention does not support {what}; use Megatron's "
                                          "DotProductAttention or TEDotProductAttention (GPU)")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp_size = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.heads_per_partition = divide(config.num_attention_heads, tp_size)          # np
        self.groups_per_partition = divide(config.num_query_groups, tp_size)           # ng
        key_size = config.kv_channels if k_channels is None else k_channels
        value_size = config.kv_channels if v_channels is None else v_channels
        self.hidden_size_per_partition = value_size * self.heads_per_partition  # hp
        self.softmax_scale = 1.0 / math.sqrt(key_size) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        from megatron.core.transformer.utils import is_layer_window_attention

        windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, self.layer_number)
        self.window = tuple(config.window_size) if windowed else None   # (left, right) of this layer, or None
        if config.softmax_type == "vanilla":
            self.softmax_offset = None
        elif config.softmax_type == "learnable":
            from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

            full = torch.zeros(config.num_attention_heads, dtype=config.params_dtype)
            if config.perform_initialization:
                config.init_method(full)
            first = pg_collection.tp.rank() * self.heads_per_partition
            self.softmax_offset = nn.Parameter(full[first:first + self.heads_per_partition].clone())
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        elif config.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(self.heads_per_partition), persistent=False)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params=None) -> Tensor:
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, hp]. ``attention_mask``: True where
        masked (Megatron's convention); None: a causal layer masks the future."""
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention does not support attention_bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        sq, b = query.shape[:2]
        sk = key.shape[0]
        q = query.permute(1, 2, 0, 3)   # [b, np, sq, hn]
        k = self._grouped(key.permute(1, 2, 0, 3))     # [b, np, sk, hn]
        v = self._grouped(value.permute(1, 2, 0, 3))
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        keep_mask, causal = None, False
        if attention_mask is not None:
            keep_mask = ~attention_mask.bool()
        elif mask_type == AttnMaskType.causal and sq > 1:
            if sq != sk:
                raise ValueError(f"a causal mask needs as many queries as keys, got {sq} and {sk}")
            causal = self.window is None
        if self.window is not None:
            band = self._band(sq, sk, q.device)
            keep_mask = band if keep_mask is None else keep_mask & band
        context = self._attend(q, k, v, keep_mask, causal)   # [b, np, sq, hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, packed_seq_params) -> Tensor:
        """Packed sequences (``qkv_format`` thd): [t, heads, hn] -> [t, hp], causal within each sequence."""
        if packed_seq_params.qkv_format != "thd":
            raise NotImplementedError(f"SDPAttention takes packed sequences in qkv_format 'thd', got "
                                      f"{packed_seq_params.qkv_format!r}")
        cu_q, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
        if cu_kv is not None and not torch.equal(cu_q, cu_kv):
            raise NotImplementedError("SDPAttention's packed sequences are self-attention: cu_seqlens_q == "
                                      "cu_seqlens_kv")
        t = query.shape[0]
        q, k, v = (x.unsqueeze(1).permute(1, 2, 0, 3) for x in (query, key, value))   # [1, heads, t, hn]
        k, v = self._grouped(k), self._grouped(v)
        sequence_T = document_of(cu_q.to(query.device), t)
        keep_mask = (sequence_T[:, None] == sequence_T[None, :]) & torch.ones(t, t, dtype=torch.bool,
                                                                                device=q.device).tril()
        if self.window is not None:
            keep_mask = keep_mask & self._band(t, t, q.device)
        context = self._attend(q, k, v, keep_mask, False)[0]   # [np, t, hn]
        return context.permute(1, 0, 2).reshape(t, self.hidden_size_per_partition)

    def _grouped(self, kv: Tensor) -> Tensor:
        """Grouped-query attention: each key/value head repeated for the query heads of its group."""
        if self.groups_per_partition == self.heads_per_partition:
            return kv
        return kv.repeat_interleave(self.heads_per_partition // self.groups_per_partition, dim=1)

    def _band(self, sq: int, sk: int, device) -> Tensor:
        """The window's band i - left <= j <= i + right (queries end where the keys end)."""
        left, right = self.window
        i = torch.arange(sq, device=device)[:, None] + (sk - sq)
        j = torch.arange(sk, device=device)[None, :]
        return (j >= i - left) & (j <= i + right)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, keep_mask: Optional[Tensor], causal: bool) -> Tensor:
        """softmax(q k^T * scale) v over [b, heads, s, hn]; dropout inside Megatron's RNG tracker's fork."""
        dropout_p = self.dropout_p if self.training else 0.0
        forked = dropout_p > 0 and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if forked else contextlib.nullcontext():
            if self.softmax_offset is not None:
                context = self._with_sinks(q, k, v, keep_mask, causal, dropout_p)
            else:
                context = F.scaled_dot_product_attention(q, k, v, attn_mask=keep_mask, dropout_p=dropout_p,
                                                         is_causal=causal, scale=self.softmax_scale)
        return context

    def _with_sinks(self, q: Tensor, k: Tensor, v: Tensor, keep_mask: Optional[Tensor], causal: bool,
                    dropout_p: float) -> Tensor:
        """The softmax with each head's sink logit appended and its share dropped, in fp32 (SDPA has no sink)."""
        sq, sk = q.shape[2], k.shape[2]
        scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * self.softmax_scale
        if causal:
            keep_mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        if keep_mask is not None:
            scores = scores.masked_fill(~keep_mask, -math.inf)
        sink = self.softmax_offset.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, sq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        if dropout_p > 0:
            probs = F.dropout(probs, p=dropout_p)
        return torch.matmul(probs.to(v.dtype), v)


def document_of(cu_seqlens: Tensor, t: int) -> Tensor:
    """[t] the index of the sequence each of ``t`` packed tokens belongs to, from ``cu_seqlens`` ([n + 1] offsets)."""
    if cu_seqlens.dim() != 1 or int(cu_seqlens[-1]) != t or int(cu_seqlens[0]) != 0:
        raise ValueError(f"cu_seqlens {cu_seqlens.tolist()} do not cut {t} packed tokens")
    return torch.searchsorted(cu_seqlens.long(), torch.arange(t, device=cu_seqlens.device), right=True) - 1


class TorchNorm:
    """``nn.LayerNorm`` or ``nn.RMSNorm`` per ``config.normalization``, ``sequence_parallel`` as the config says."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused) -> nn.Module:
        if config.layernorm_zero_centered_gamma:
            raise NotImplementedError("TorchNorm does not support layernorm_zero_centered_gamma")
        kinds = {"LayerNorm": nn.LayerNorm, "RMSNorm": nn.RMSNorm}
        if config.normalization not in kinds:
            raise NotImplementedError(f"TorchNorm supports normalization {' or '.join(kinds)}, "
                                      f"not {config.normalization!r}")
        norm = kinds[config.normalization](hidden_size, eps=eps)  # fp32, CPU: as WrappedTorchNorm builds it
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class TorchQKNorm:
    """``TorchNorm`` of a query or key head, marked ``sequence_parallel`` so that its gradients are summed over TP."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused) -> nn.Module:
        norm = TorchNorm(config, hidden_size, eps)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm


class ProjectionQKNorm(nn.Module):
    """RMSNorm over a whole query or key projection (OLMoE's): the statistic all-reduced over TP, the weight
    this rank's heads' slice. Input [sq, b, n, hn]; ``which``: ``"query"`` or ``"key"``."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, which: str = "query",
                 **_unused):
        super().__init__()
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        if config.normalization != "RMSNorm":
            raise NotImplementedError(f"--qk-layernorm-scope projection is an RMSNorm; got normalization "
                                      f"{config.normalization!r}")
        tp = parallel_state.get_tensor_model_parallel_world_size()
        heads = config.num_attention_heads
        if which == "key":
            heads = config.num_query_groups or heads
        if which == "key" and heads < tp:
            raise NotImplementedError(f"--qk-layernorm-scope projection needs at least as many query groups as "
                                      f"tensor-parallel ranks; got {heads} groups on tp {tp}")
        self.eps, self.total = eps, heads * hidden_size
        self.group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
        self.weight = nn.Parameter(torch.ones(heads // tp * hidden_size))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, x: Tensor) -> Tensor:
        dtype, x32 = x.dtype, x.float()
        squares = x32.pow(2).sum(dim=(-2, -1), keepdim=True)
        if self.group is not None:
            squares = dist_nn.all_reduce(squares, group=self.group)
        normed = x32 * torch.rsqrt(squares / self.total + self.eps)
        return (normed * self.weight.float().view(x.shape[-2], x.shape[-1])).to(dtype)
