"""megatron-core 0.16.1's multi-latent attention (``MLASelfAttention``) on any device.

The plugin uses Megatron's own MLA module (DeepSeek-V2/V3: low-rank query and key/value projections
with their norms, a rotary key shared by the heads), so a GPU run gets Megatron's layer unchanged.
Two things of its constructor do not hold on a CPU build of torch, one not without Transformer
Engine, and one does not fit YaRN as transformers computes it:

* ``MultiLatentAttention.__init__`` builds its ``RotaryEmbedding`` (``rope_type`` "rope") without
  ``use_cpu_initialization``, i.e. on the current GPU: on a CPU build of torch "Torch not compiled
  with CUDA enabled". ``MLAttention`` builds it on the CPU when DeepSpeed's accelerator is the CPU or
  the config asks for CPU initialisation (the frequencies are the same numbers on either device).
* With ``rope_type`` "yarn" it builds ``YarnRotaryEmbedding``, whose ``get_emb`` moves its
  frequencies to the current GPU on every call. ``MLAttention`` builds ``YarnRotary``
  instead: a plain ``RotaryEmbedding`` whose forward returns ``(angles, attention factor)`` as
  Megatron's YaRN class does, so that MLA multiplies cos and sin by the factor;
  ``integration.rope.apply_rope_scaling`` then sets transformers' YaRN frequencies and factor on it.
  The softmax scale stays Megatron's: ``mscale(rotary_scaling_factor, mscale_all_dim)^2 /
  sqrt(qk_head_dim + qk_pos_emb_head_dim)``, which is transformers' DeepSeek scaling.
* Without Transformer Engine, ``megatron.core.extensions.transformer_engine`` still imports (its
  classes are ``MagicMock`` placeholders), so the module's ``HAVE_TE`` is True and the constructor's
  ``isinstance(self.linear_proj, TELinear)`` raises "isinstance() arg 2 must be a type".
  ``MLAttention`` sets ``HAVE_TE`` to whether ``TELinear`` is a class.

Those three are swapped for the constructor's duration only (the module's names), so Megatron's
classes stay as they are for everyone else.

And one gradient is wrong in Megatron's local spec under tensor parallelism: the key/value down
projection is a ``ColumnParallelLinear`` whose output ``[kv_lora_rank + qk_pos_emb_head_dim]`` is
all-gathered over TP (``gather_from_tensor_model_parallel_region``, whose backward keeps each rank's
slice of the gradient, right only for a gradient every rank has whole). Its last ``qk_pos_emb_head_dim``
columns are the rotary key *shared by all heads*: each rank's gradient of it comes from its own heads
only, so the rank that owns those columns dropped the other ranks' share and trained the shared key's
weights on part of their gradient (the losses drift from the one-rank run's after a few steps). In
``MLAttention``'s forward that one gather is the plugin's ``_GatherSummingTail``: the same all-gather,
whose backward sums the shared key's columns over TP before keeping the rank's slice.

``tests/test_compat_guards.py`` checks the names this relies on against the installed Megatron-Core.
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
    """Megatron's plain rotary embedding that also returns the attention factor (``factor``, set by
    ``apply_rope_scaling``; 1.0 until then), the pair MLA expects from a YaRN rotary embedding."""

    def __init__(self, kv_channels: int, rotary_base: float = 10000.0, cp_group: Any = None,
                 use_cpu_initialization: bool = True, **_yarn_fields: Any):
        super().__init__(kv_channels=kv_channels, rotary_percent=1.0, rotary_base=rotary_base,
                         use_cpu_initialization=use_cpu_initialization, cp_group=cp_group)
        self.factor = 1.0

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None):
        return super().forward(max_seq_len, offset, packed_seq, cp_group), self.factor


class MLAttention(MLASelfAttention):
    """``MLASelfAttention`` whose rotary embedding is built where it can run and whose shared key's
    gradient is summed over TP (module docstring)."""

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
    """All-gather along the last dimension over ``group``; backward: the gradient's last ``tail`` columns
    summed over the group (each rank has part of it), then this rank's slice."""

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
    """Within it, MLA's constructor builds ``RotaryEmbedding`` on the CPU when ``cpu`` and
    ``YarnRotary`` for YaRN, and knows whether Transformer Engine is really there."""
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
