"""How megatron-core 0.16 builds a ``TransformerLayer`` and its MLP (``build_module``, the layer's global
number), as the MoE spec relies on it. Details: docs/design/compat_upstream.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

TRANSFORMER_LAYER_ARGS = ("config", "submodules", "layer_number", "hidden_dropout", "pg_collection", "vp_stage")


@dataclass(frozen=True)
class BuildSpec:
    """What ``build_module`` reads (module, params, submodules), without being a ``ModuleSpec``."""

    module: type
    params: dict
    submodules: Any = None


def global_layer_index(config: Any, layer_number: int, vp_stage: Optional[int], pg_collection: Any) -> tuple[int, Any]:
    """(0-based global index of the layer numbered ``layer_number`` in its stage, the ``pg_collection`` used)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from megatron.core.utils import get_pg_rank

    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return layer_number - 1 + get_transformer_layer_offset(config, vp_stage, get_pg_rank(pg_collection.pp)), pg_collection


def check_layer_number(layer: Any, index: int) -> None:
    """``layer`` (a built ``TransformerLayer``) is numbered as ``global_layer_index`` computed."""
    if layer.layer_number != index + 1:
        raise RuntimeError(f"Megatron numbers this layer {layer.layer_number}, the MoE spec computed "
                           f"{index + 1}: unsupported megatron-core version")
