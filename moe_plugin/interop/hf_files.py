"""The files of a Hugging Face model directory: safetensors weights (one file, or shards and their
index, as ``save_pretrained`` writes them) and the tokenizer's files.

``read_weights(hf_dir)``: every tensor by name, from ``model.safetensors`` or the shards that
``model.safetensors.index.json`` names (each shard checked to hold what the index says).
``write_weights(out_dir, tensors, max_shard_bytes)``: shards of at most ``max_shard_bytes`` (a
tensor larger than that gets a shard of its own) named ``model-0000i-of-0000n.safetensors`` with
the index, or one ``model.safetensors`` when everything fits in one, in name order.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Optional

import torch

from moe_plugin.configs import ConfigError

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
# What a tokenizer (and generation defaults) may leave in a model directory; carried over as is.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")


def read_weights(hf_dir: str, say: Callable[[str], None] = lambda line: None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single, index = os.path.join(hf_dir, WEIGHTS), os.path.join(hf_dir, INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        shards = sorted(set(weight_map.values()))
        out: dict[str, torch.Tensor] = {}
        for n, shard in enumerate(shards, 1):
            say(f"reading {shard} ({n}/{len(shards)})")
            tensors = load_file(os.path.join(hf_dir, shard))
            missing = [k for k, s in weight_map.items() if s == shard and k not in tensors]
            if missing:
                raise ConfigError(f"{index}: weight_map", missing[0], f"is not in {shard}, which the index names "
                                  "for it (a damaged or partial download)")
            out.update(tensors)
        return out
    if os.path.isfile(single):
        say(f"reading {WEIGHTS}")
        return load_file(single)
    found = sorted(os.listdir(hf_dir))
    raise ConfigError(hf_dir, found[:8], f"holds neither {WEIGHTS} nor {INDEX}; save the model with "
                      "save_pretrained (safetensors, the default) to import it", shown=f"files {found[:8]}")


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"200MB"``, ``"64KB"`` or a number of bytes -> bytes (powers of 1000, as transformers)."""
    if isinstance(text, int):
        return text
    units = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30}
    s = str(text).strip().upper()
    for unit, scale in sorted(units.items(), key=lambda item: -len(item[0])):
        if s.endswith(unit) and s[:-len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(s[:-len(unit)]) * scale)
    if s.isdigit():
        return int(s)
    raise ConfigError("--max-shard-size", text, "expected bytes or a size such as 5GB, 500MB, 64KB")


def write_weights(out_dir: str, tensors: dict[str, torch.Tensor], max_shard_bytes: int,
                  say: Callable[[str], None] = lambda line: None, metadata: Optional[dict] = None) -> list[str]:
    """Write ``tensors`` into ``out_dir``; returns the file names written."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt", **(metadata or {})}
    if len(shards) == 1:
        say(f"writing {WEIGHTS}: {len(tensors)} tensors")
        save_file(shards[0], os.path.join(out_dir, WEIGHTS), metadata=meta)
        return [WEIGHTS]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        say(f"writing {name}: {len(shard)} tensors")
        save_file(shard, os.path.join(out_dir, name), metadata=meta)
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out_dir, INDEX), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return names + [INDEX]


def tokenizer_files(hf_dir: str) -> list[str]:
    """The tokenizer (and generation config) files present in ``hf_dir``."""
    return [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, name))]
