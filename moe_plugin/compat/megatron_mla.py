"""megatron-core 0.16.1's multi-latent attention on any device: ``MLAttention`` is Megatron's MLA with
its constructor working on CPU, without Transformer Engine and with YaRN as transformers computes it,
and the shared rotary key's gradient summed over TP. Why each: docs/design/compat_upstream.md.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer import multi_latent_attention as mla_module
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

SWAPPED = ("RotaryEmbedding", "YarnRotaryEmbedding", "HAVE_TE")


class YarnRotary(RotaryEmbedding):
    """Megatron's plain rotary embedding that also returns the attention factor, as MLA expects of YaRN."""

    def __init__(self, kv_channels: int, rotary_base: float = 10000.0, cp_group: Any = None,
                 use_cpu_initialization: bool = True, **_yarn_fields: Any):
        super().__init__(kv_channels=kv_channels, rotary_percent=1.0, rotary_base=rotary_base,
                         use_cpu_initialization=use_cpu_initialization, cp_group=cp_group)
        self.factor = 1.0

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None):
        return super().forward(max_seq_len, offset, packed_seq, cp_group), self.factor


class MLAttention(MLASelfAttention):
    """``MLASelfAttention`` built where it can run, its shared key's gradient summed over TP."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        from deepspeed.accelerator import get_accelerator

        with rotary_on_host(config.use_cpu_initialization or get_accelerator().device_name() == "cpu"):
            super().__init__(config, *args, **kwargs)
        self._kv_down = None
        self.linear_kv_down_proj.register_forward_hook(self._remember_kv_down)

    def _remember_kv_down(self, _module: Any, _inputs: Any, output: Any) -> None:
        self._kv_down = output[0] if isinstance(output, tuple) else output

    def get_query_key_value_tensors(self, *args: Any, **kwargs: Any):
        group = self.pg_collection.tp
        if group is None or group.size() == 1:
            return super().get_query_key_value_tensors(*args, **kwargs)
        plain = mla_module.gather_from_tensor_model_parallel_region
        tail = self.config.qk_pos_emb_head_dim

        def gather(tensor: torch.Tensor, *rest: Any, **options: Any) -> torch.Tensor:
            if tensor is self._kv_down:   # the key/value down projection's output: its tail is the shared key
                return _GatherSummingTail.apply(tensor, tail, group)
            return plain(tensor, *rest, **options)

        mla_module.gather_from_tensor_model_parallel_region = gather
        try:
            return super().get_query_key_value_tensors(*args, **kwargs)
        finally:
            mla_module.gather_from_tensor_model_parallel_region = plain
            self._kv_down = None


class _GatherSummingTail(torch.autograd.Function):
    """All-gather over ``group``; backward sums the last ``tail`` columns over the group, then slices."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, tail: int, group: Any) -> torch.Tensor:
        ctx.tail, ctx.group = tail, group
        parts = [torch.empty_like(tensor) for _ in range(group.size())]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        grad = grad.clone()
        shared = grad[..., -ctx.tail:].contiguous()
        dist.all_reduce(shared, group=ctx.group)
        grad[..., -ctx.tail:] = shared
        size = grad.shape[-1] // ctx.group.size()
        rank = ctx.group.rank()
        return grad[..., rank * size:(rank + 1) * size].contiguous(), None, None


@contextlib.contextmanager
def rotary_on_host(cpu: bool) -> Iterator[None]:
    """Within it, MLA's constructor builds a rotary embedding that runs here, and sees Transformer Engine right."""
    saved = {name: getattr(mla_module, name) for name in SWAPPED}

    def plain(*args: Any, **kwargs: Any) -> RotaryEmbedding:
        return saved["RotaryEmbedding"](*args, use_cpu_initialization=cpu, **kwargs)

    def yarn(kv_channels: int, rotary_base: float = 10000.0, cp_group: Any = None, **fields: Any) -> YarnRotary:
        return YarnRotary(kv_channels, rotary_base, cp_group, use_cpu_initialization=cpu, **fields)

    mla_module.RotaryEmbedding, mla_module.YarnRotaryEmbedding = plain, yarn
    mla_module.HAVE_TE = saved["HAVE_TE"] and isinstance(mla_module.TELinear, type)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(mla_module, name, value)
