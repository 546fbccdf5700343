"""How megatron-core 0.16.1's attention scales RoPE's cos and sin, which YaRN needs (``integration.rope``).

``SelfAttention`` applies the rotary embedding with ``mscale =
_yarn_get_concentration_factor_from_config(config)``: 1.0 unless the config object carries
``yarn_rotary_scaling_factor`` (an attribute Megatron-LM's arguments set, not a ``TransformerConfig``
field), then ``(0.1 * yarn_mscale * ln s + 1) / (0.1 * yarn_mscale_all_dim * ln s + 1)``.
``set_attention_factor(config, a)`` sets the three so that the factor is ``a``: s = e,
``yarn_mscale`` = 10 (a - 1), ``yarn_mscale_all_dim`` = 0. GPTModel reads them only with
``position_embedding_type`` "yarn", which the plugin does not use (its frequencies are set on the
plain ``RotaryEmbedding``).

``tests/test_compat_guards.py`` checks this against the installed Megatron-Core.
"""
from __future__ import annotations

import math
from typing import Any


def set_attention_factor(config: Any, factor: float) -> None:
    """Make Megatron's attention multiply cos and sin by ``factor`` for ``config`` (module docstring)."""
    config.yarn_rotary_scaling_factor = math.e
    config.yarn_mscale = 10.0 * (float(factor) - 1.0)
    config.yarn_mscale_all_dim = 0.0


def attention_factor(config: Any) -> float:
    """The factor Megatron's attention applies for ``config``."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )

    return float(_yarn_get_concentration_factor_from_config(config))
