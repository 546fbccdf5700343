"""RoPE scaling: YaRN (arXiv 2309.00071), as Hugging Face's ``rope_parameters`` describe it and transformers
5.24 computes it, so an imported model gives transformers' logits past its original context.

    apply_rope_scaling(model, RopeScaling.from_dict({"rope_type": "yarn", "factor": 4.0, ...}), rotary_base=1e6)

Formulas: docs/design/integration_megatron.md.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from moe_plugin.configs import ConfigError

KEYS = ("rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
        "mscale_all_dim", "attention_factor", "truncate")


@dataclass(frozen=True)
class RopeScaling:
    """YaRN's parameters, as a ``rope_scaling`` dict gives them."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True
    rope_type: str = "yarn"
    given: tuple = ()   # the dict as given (its items), which ``to_dict`` returns: a round trip keeps its keys

    @classmethod
    def from_dict(cls, value: Any, where: str = "--rope-scaling") -> "RopeScaling":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(where, value, f"expected a JSON object ({exc})") from None
        if not isinstance(value, dict):
            raise ConfigError(where, value, "expected a JSON object such as {\"rope_type\": \"yarn\", \"factor\": 4, "
                              "\"original_max_position_embeddings\": 4096}")
        kind = value.get("rope_type", value.get("type"))
        if kind != "yarn":
            raise ConfigError(f"{where}.rope_type", kind, "the plugin implements yarn (and plain RoPE without "
                              "scaling)")
        unknown = sorted(k for k in value if k not in KEYS and k not in ("type", "rope_theta",
                                                                          "partial_rotary_factor"))
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}", value[unknown[0]], f"not a yarn parameter; expected "
                              f"{', '.join(KEYS)}")
        for key in ("factor", "original_max_position_embeddings"):
            if not isinstance(value.get(key), (int, float)) or isinstance(value.get(key), bool) or value[key] <= 0:
                raise ConfigError(f"{where}.{key}", value.get(key), "expected a number > 0")

        def number(key: str, default: Optional[float]) -> Optional[float]:
            got = value.get(key)
            return default if got is None else float(got)

        given = tuple((k, v) for k, v in value.items() if k not in ("rope_theta", "partial_rotary_factor"))
        return cls(given=given, factor=float(value["factor"]),
                   original_max_position_embeddings=int(value["original_max_position_embeddings"]),
                   beta_fast=number("beta_fast", 32.0) or 32.0, beta_slow=number("beta_slow", 1.0) or 1.0,
                   mscale=number("mscale", None), mscale_all_dim=number("mscale_all_dim", None),
                   attention_factor=number("attention_factor", None), truncate=bool(value.get("truncate", True)))

    def to_dict(self) -> dict:
        """The dict as given (``rope_type`` included; ``rope_theta``, ``partial_rotary_factor`` left to the model)."""
        return {"rope_type": self.rope_type, **{k: v for k, v in self.given if k != "type"}}


def yarn_inv_freq(scaling: RopeScaling, dim: int, base: float) -> torch.Tensor:
    """The [dim / 2] YaRN rotary frequencies of a rotated dimension ``dim``."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # no empty ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    positions = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / positions, 1.0 / (scaling.factor * positions)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep


def yarn_attention_factor(scaling: RopeScaling) -> float:
    """YaRN's factor multiplying cos and sin."""
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return float(mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim))
    return mscale(scaling.factor)


def apply_rope_scaling(model: nn.Module, scaling: Optional[RopeScaling], *, rotary_base: float) -> nn.Module:
    """``model`` (a ``GPTModel`` or a pipeline stage) with every Megatron ``RotaryEmbedding`` on YaRN's
    frequencies and its attention on YaRN's factor; ``model.rope_scaling`` records the dict. None: unchanged."""
    if scaling is None:
        return model
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from moe_plugin.compat.megatron_yarn import set_attention_factor

    from moe_plugin.compat.megatron_mla import YarnRotary

    factor = yarn_attention_factor(scaling)
    for rotary in (m for m in model.modules() if isinstance(m, RotaryEmbedding)):
        dim = rotary.inv_freq.numel() * 2   # the rotated dimensions: kv_channels x rotary_percent, or MLA's
        rotary.inv_freq = yarn_inv_freq(scaling, dim, rotary_base).to(rotary.inv_freq)
        if isinstance(rotary, YarnRotary):   # multi-latent attention's: the factor comes with the angles
            rotary.factor = factor
    RotaryEmbedding.forward.cache_clear()   # Megatron caches the angles per length
    from megatron.core.transformer.transformer_config import TransformerConfig

    configs = {id(m.config): m.config for m in model.modules() if isinstance(getattr(m, "config", None),
                                                                               TransformerConfig)}
    for config in configs.values():
        set_attention_factor(config, factor)
    model.rope_scaling = scaling.to_dict()
    return model
