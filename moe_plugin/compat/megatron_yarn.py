"""How megatron-core 0.16.1's attention scales RoPE's cos and sin (YaRN's factor, ``integration.rope``).
Derivation: docs/design/compat_upstream.md.
"""
from __future__ import annotations

import math
from typing import Any


def set_attention_factor(config: Any, factor: float) -> None:
    """Make Megatron's attention multiply cos and sin by ``factor`` for ``config``."""
    config.yarn_rotary_scaling_factor = math.e
    config.yarn_mscale = 10.0 * (float(factor) - 1.0)
    config.yarn_mscale_all_dim = 0.0


def attention_factor(config: Any) -> float:
    """The factor Megatron's attention applies for ``config``."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )

    return float(_yarn_get_concentration_factor_from_config(config))
