"""Megatron-Core 0.16.1's multi-latent attention (``MLASelfAttention``) on any device.

The plugin uses Megatron's own MLA module (DeepSeek-V2/V3: low-rank query and key/value projections
with their norms, a rotary key shared by the heads), so a GPU run gets Megatron's layer unchanged.
Two things of its constructor do not hold on a CPU build of torch, one not without Transformer
Engine, and one does not fit YaRN as transformers computes it:

* ``MultiLatentAttention.__init__`` builds its ``RotaryEmbedding`` (``rope_type`` "rope") without
  ``use_cpu_initialization``, i.e. on ``torch.cuda.current_device()``: "Torch not compiled with CUDA
  enabled". ``MLAttention`` builds it on the CPU when CUDA is absent or the config asks for CPU
  initialisation (the frequencies are the same numbers on either device).
* With ``rope_type`` "yarn" it builds ``YarnRotaryEmbedding``, whose ``get_emb`` moves its
  frequencies to ``torch.cuda.current_device()`` on every call. ``MLAttention`` builds ``YarnRotary``
  instead: a plain ``RotaryEmbedding`` whose forward returns ``(angles, attention factor)`` as
  Megatron's YaRN class does, so that MLA multiplies cos and sin by the factor;
  ``integration.rope.apply_rope_scaling`` then sets transformers' YaRN frequencies and factor on it.
  The softmax scale stays Megatron's: ``mscale(rotary_scaling_factor, mscale_all_dim)^2 /
  sqrt(qk_head_dim + qk_pos_emb_head_dim)``, which is transformers' DeepSeek scaling.
* Without Transformer Engine, ``megatron.core.extensions.transformer_engine`` still imports (its
  classes are ``MagicMock`` placeholders), so the module's ``HAVE_TE`` is True and the constructor's
  ``isinstance(self.linear_proj, TELinear)`` raises "isinstance() arg 2 must be a type".
  ``MLAttention`` sets ``HAVE_TE`` to whether ``TELinear`` is a class.

All three are swapped for the constructor's duration only (the module's two names), so Megatron's
classes stay as they are for everyone else. ``tests/test_compat_guards.py`` checks the names
this relies on against the installed Megatron-Core.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
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
    """``MLASelfAttention`` whose rotary embedding is built where it can run (module docstring)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        with rotary_on_host(config.use_cpu_initialization or not torch.cuda.is_available()):
            super().__init__(config, *args, **kwargs)


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
