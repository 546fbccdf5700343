"""How Megatron-Core builds a ``TransformerLayer`` and its MLP, as the MoE spec relies on it.

Relies on megatron-core 0.16 (``megatron/core/transformer/``):

* ``spec_utils.build_module`` builds from any object with ``module`` (a class), ``params`` and
  ``submodules``: ``module(**params, submodules=..., config=...)``. ``BuildSpec`` is such an object,
  deliberately not a ``ModuleSpec``: for a ``ModuleSpec`` of a class it does not know,
  ``TransformerLayer.__init__`` logs "Unknown MLP type" on every layer, and passes nothing but
  ``config`` to it either way.
* ``TransformerLayer.__init__`` takes ``TRANSFORMER_LAYER_ARGS`` (in that order) and numbers its
  layer ``layer_number + get_transformer_layer_offset(config, vp_stage, pp_rank)`` (1-based,
  global: pipeline and virtual-pipeline stages included), the pipeline rank from
  ``pg_collection.pp`` (default ``ProcessGroupCollection.use_mpu_process_groups()``).
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
    """(the 0-based global index ``TransformerLayer`` will give the layer numbered ``layer_number``
    in its stage, the ``pg_collection`` it builds with: the mpu's groups when None)."""
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
