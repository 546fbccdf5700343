"""Model formats of other tools: Hugging Face checkpoints in and out.

    from moe_plugin.interop import import_hf, export_hf
    import_hf("Mixtral-dir", "ds.json", "ckpt")        # moe-plugin import-hf Mixtral-dir --config ds.json --out ckpt
    export_hf("ckpt", "hf-out")                        # moe-plugin export-hf ckpt --out hf-out

* ``hf_arch``: a Hugging Face ``config.json`` read as the plugin's model (``HFArchitecture``: the
  Megatron ``TransformerConfig`` fields, the ``"moe"`` block, the example's flags), or refused
  naming the key; and the other way for export.
* ``families/``: one file per model family: what its config means, what it refuses, its tensor table
  composed of shared blocks; ``hf_mapping``: the rules of one model (``HFMapping``).
* ``hf_files``: safetensors shards and their index, read and written; the tokenizer files.
* ``hf_import`` / ``hf_export``: the commands. The checkpoint package does the sharding: an import
  is written as the 1-rank model's checkpoint, which ``load_checkpoint`` cuts for any layout, and
  an export reads any layout as the 1-rank model, tensor by tensor (``checkpoint.export.CheckpointSource``).

transformers is optional (``pip install 'moe_plugin[hf]'``): imported on first use, by name.
lazy: ``moe-plugin --help`` (its parser reads ``interop.families``) starts in 0.32 s (288 modules) instead of 2.8 s
(1,290: torch), or 0.47 s (392: numpy) with only ``hf_arch``'s names plain, measured 2026-12-02.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from moe_plugin.lazy import lazy_getattr

if TYPE_CHECKING:   # the names _LAZY hands on, for type checkers and go-to-definition
    from moe_plugin.interop.hf_arch import HFArchitecture, read_hf_config
    from moe_plugin.interop.hf_export import export_hf
    from moe_plugin.interop.hf_import import ImportResult, import_hf

_LAZY = {"import_hf": "hf_import", "ImportResult": "hf_import", "export_hf": "hf_export",
         "HFArchitecture": "hf_arch", "read_hf_config": "hf_arch"}
__all__ = sorted(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY)
