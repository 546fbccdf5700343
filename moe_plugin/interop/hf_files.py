"""The files of a Hugging Face model directory: safetensors weights (one file, or shards and their
index) and the tokenizer's files.

``HFWeights(hf_dir)``: every tensor by name, known from the headers (``spec``), read one at a time
(``read``) or one expert's row of a fused tensor (``read_row``); FP8 blocks and MXFP4 experts show as
their dequantized selves; pickled weights are refused in one line unless trusted.
``HFShardWriter(out_dir, specs, max_shard_bytes)``: the shards and their index, planned from ``specs``
first and written as the tensors come.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

import torch

from moe_plugin.configs import ConfigError

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
# pickled weights (``save_pretrained(safe_serialization=False)``, older models): read only when trusted
PICKLED, PICKLED_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
# What a tokenizer (and generation defaults) may leave in a model directory; carried over as is.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")


class HFWeights:
    """The safetensors weights of a model directory, by name; nothing read until ``read``."""

    def __init__(self, hf_dir: str, say: Callable[[str], None] = lambda line: None):
        from moe_plugin.checkpoint.tensor_files import TensorFile

        single, index, reader = os.path.join(hf_dir, WEIGHTS), os.path.join(hf_dir, INDEX), TensorFile
        self._files: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        if not os.path.isfile(single) and not os.path.isfile(index):
            pickled = [os.path.join(hf_dir, n) for n in (PICKLED_INDEX, PICKLED)
                       if os.path.isfile(os.path.join(hf_dir, n))]
            if pickled:
                single, index, reader = pickled_weights(pickled[0])
        check_hf_files(hf_dir)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)
            weight_map = weight_map.get("weight_map", {}) if isinstance(weight_map, dict) else None
            if not isinstance(weight_map, dict):
                raise ConfigError(f"{index}: weight_map", weight_map, "expected {tensor name: shard file name}",
                                  shown=repr(weight_map)[:80])
            where = {shard: confined(hf_dir, shard, f"{index}: weight_map") for shard in set(weight_map.values())}
            shards = sorted(where)   # each confined before any is opened
            say(f"{len(shards)} shards named by {os.path.basename(index)}")
            for shard in shards:
                self._files[shard] = reader(where[shard])
                names = set(self._files[shard].names())
                missing = [k for k, s in weight_map.items() if s == shard and k not in names]
                if missing:
                    raise ConfigError(f"{index}: weight_map", missing[0], f"is not in {shard}, which the index names "
                                      "for it (a damaged or partial download)")
                self._where.update({k: shard for k in names})
        elif os.path.isfile(single):
            name = os.path.basename(single)
            self._files[name] = reader(single)
            self._where = {k: name for k in self._files[name].names()}
        else:
            found = sorted(os.listdir(hf_dir))
            raise ConfigError(hf_dir, found[:8], f"holds neither {WEIGHTS} nor {INDEX}; save the model with "
                              "save_pretrained (safetensors, the default) to import it", shown=f"files {found[:8]}")
        self.blocks = fp8_blocks(hf_dir)
        self._mxfp4: dict[str, tuple[str, str, torch.dtype]] = {}   # X -> (X_blocks, X_scales, dtype)
        self._hidden: dict[str, str] = {}   # the files of the tensors shown as others (X_blocks, X_scales)
        mx = mxfp4_dtype(hf_dir)
        if mx is not None:
            for k in [k for k in self._where if k.endswith(MX_BLOCKS)]:
                base = k[:-len(MX_BLOCKS)]
                if base + MX_SCALES in self._where:
                    self._mxfp4[base] = (k, base + MX_SCALES, mx)
                    self._where[base] = self._where[k]
                    for hidden in (k, base + MX_SCALES):
                        self._hidden[hidden] = self._where.pop(hidden)
            say(f"{len(self._mxfp4)} MXFP4 expert weights, dequantized to {mx}")
        if self.blocks is not None:   # every block-scaled weight shows as its dequantized self
            scaled = [k for k in self._where if k.endswith(SCALE) and k[:-len(SCALE)] + ".weight" in self._where]
            self._scale = {k[:-len(SCALE)] + ".weight": (k, self._where.pop(k)) for k in scaled}   # (name, file)
            say(f"{len(scaled)} FP8 weights in {self.blocks[0]}x{self.blocks[1]} blocks, dequantized to "
                f"{self.blocks[2]}")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return sorted(self._where)

    def file_of(self, name: str) -> str:
        """The path of the file that holds ``name``."""
        return getattr(self._file(name), "path", "the weights")

    def spec(self, name: str) -> tuple[torch.dtype, list[int]]:
        if name in self._mxfp4:   # blocks [E, R, G, 16] -> [E, G * 32, R]
            blocks, _scales, dtype = self._mxfp4[name]
            shape = self._file(blocks).spec(blocks)[1]
            return dtype, [*shape[:-3], shape[-2] * 2 * shape[-1], shape[-3]]
        dtype, shape = self._files[self._where[name]].spec(name)
        return (self.blocks[2], shape) if self.blocks is not None and name in self._scale else (dtype, shape)

    def read_row(self, name: str, row: int) -> torch.Tensor:
        """``read(name)[row]``, reading that row's bytes only where the file allows it."""
        if name in self._mxfp4:
            blocks, scales, dtype = self._mxfp4[name]
            return dequantize_mxfp4(self._rows(blocks, row), self._rows(scales, row)).to(dtype)
        if self.blocks is not None and name in self._scale:
            return self.read(name)[row]
        return self._rows(name, row)

    def _file(self, name: str) -> Any:
        return self._files[self._where[name] if name in self._where else self._hidden[name]]

    def _rows(self, name: str, row: int) -> torch.Tensor:
        file = self._file(name)
        return file.read_rows(name, row, 1)[0] if hasattr(file, "read_rows") else file.read(name)[row]

    def read(self, name: str) -> torch.Tensor:
        if name in self._mxfp4:
            blocks, scales, dtype = self._mxfp4[name]
            return dequantize_mxfp4(self._file(blocks).read(blocks), self._file(scales).read(scales)).to(dtype)
        tensor = self._files[self._where[name]].read(name)
        if self.blocks is None or name not in self._scale:
            return tensor
        scale_name, file = self._scale[name]
        scale = self._files[file].read(scale_name)
        return dequantize_blocks(tensor, scale, self.blocks[:2], name).to(self.blocks[2])

    def close(self) -> None:
        for f in self._files.values():
            f.close()


SCALE = ".weight_scale_inv"   # a block-scaled FP8 weight's scales (DeepSeek-V3, Qwen3-FP8)
MX_BLOCKS, MX_SCALES = "_blocks", "_scales"   # an MXFP4 weight's packed values and block exponents (GPT-OSS)
# the 16 FP4 (E2M1) values by their 4-bit code
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _quantization(hf_dir: str, method: str) -> Optional[tuple[dict, torch.dtype]]:
    """(``quantization_config``, the dtype its weights dequantize to: the config's own floating dtype, else
    bfloat16) of a model directory whose ``config.json`` says ``quant_method`` ``method``, else None."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != method:
        return None
    dtype = getattr(torch, str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"), torch.bfloat16)
    ok = isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize > 1
    return quant, dtype if ok else torch.bfloat16


def mxfp4_dtype(hf_dir: str) -> Optional[torch.dtype]:
    """The dtype MXFP4 weights dequantize to when ``config.json``'s ``quantization_config`` is mxfp4, else None."""
    found = _quantization(hf_dir, "mxfp4")
    return None if found is None else found[1]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 (OCP microscaling): ``blocks`` [..., R, G, 16] uint8 hold 32 FP4 values per block of a row, two a
    byte (the low nibble first), ``scales`` [..., R, G] uint8 each block's power of two (biased by 127).
    Returns [..., G * 32, R] in fp32: the row-major [R, G * 32] transposed, as GPT-OSS's experts hold
    ``gate_up_proj`` [E, H, 2F] and ``down_proj`` [E, F, H] (exact: every value is a small power-of-two
    multiple)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or list(blocks.shape[:-1]) != list(scales.shape):
        from moe_plugin.checkpoint.errors import CheckpointError

        raise CheckpointError(f"MXFP4 blocks {list(blocks.shape)} {blocks.dtype} and scales {list(scales.shape)} "
                              f"{scales.dtype} do not match (expected uint8 [..., R, G, 16] and [..., R, G])")
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)                 # [..., R, G, 32]
    values = torch.ldexp(values, scales.to(torch.int32).sub(127).unsqueeze(-1).float())
    return values.flatten(-2).transpose(-1, -2).contiguous()               # [..., G * 32, R]


def fp8_blocks(hf_dir: str) -> Optional[tuple[int, int, torch.dtype]]:
    """(block rows, block columns, the dtype to dequantize to) of a model directory whose
    ``config.json`` says its weights are FP8 with block scales (``quantization_config``: quant_method
    ``fp8``, ``weight_block_size``), else None. The dtype is the config's own (``torch_dtype``), else
    bfloat16 (FP8 is no training dtype)."""
    found = _quantization(hf_dir, "fp8")
    if found is None or not found[0].get("weight_block_size"):
        return None
    rows, cols = (int(n) for n in found[0]["weight_block_size"])
    return rows, cols, found[1]


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str) -> torch.Tensor:
    """An FP8 weight [R, C] times its scales [ceil(R / rows), ceil(C / cols)], each block of
    ``block`` (rows, cols) by its own (the last blocks may be partial), in fp32."""
    rows, cols = block
    R, C = weight.shape
    expected = [-(-R // rows), -(-C // cols)]
    if list(scale.shape) != expected:
        from moe_plugin.checkpoint.errors import CheckpointError

        raise CheckpointError(f"{name}{SCALE[len('.weight'):]}: shape {list(scale.shape)}, expected {expected} for a "
                              f"weight of {[R, C]} in blocks of {rows}x{cols}")
    full = scale.float().repeat_interleave(rows, dim=0)[:R].repeat_interleave(cols, dim=1)[:, :C]
    return weight.float() * full


class PickledFile:
    """A ``pytorch_model.bin`` read tensor by tensor as ``TensorFile`` reads safetensors
    (``compat.torch_files.TorchFile``: lazy; inside ``trusting`` every class it names is admitted)."""

    def __init__(self, path: str):
        from moe_plugin.compat.torch_files import LazyTensor, TorchFile

        self._file = TorchFile(path)
        content = self._file.content
        if not isinstance(content, dict):
            raise ConfigError(path, type(content).__name__, "holds no state dict")
        self._tensors = {k: v for k, v in content.items() if isinstance(v, LazyTensor)}

    def names(self) -> list[str]:
        return list(self._tensors)

    def spec(self, name: str) -> tuple[torch.dtype, list[int]]:
        t = self._tensors[name]
        return t.dtype, list(t.shape)

    def read(self, name: str) -> torch.Tensor:
        return self._tensors[name].read()

    def close(self) -> None:
        self._file.close()


def pickled_weights(path: str) -> tuple[str, str, type]:
    """``HFWeights``' (single file, index, reader) for the pickled weights ``path``: refused in one
    line unless trusted (``--trust-checkpoint``)."""
    from moe_plugin.checkpoint.trust import trusted

    if not trusted():
        from moe_plugin.checkpoint.errors import CheckpointError

        raise CheckpointError(f"{path}: pickled weights, which can run code planted in them when read; import a model "
                              "saved as safetensors (save_pretrained's default), or pass --trust-checkpoint "
                              "(trust=True) if you trust every writer of this file")
    hf_dir = os.path.dirname(path)
    return os.path.join(hf_dir, PICKLED), os.path.join(hf_dir, PICKLED_INDEX), PickledFile


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


class HFShardWriter:
    """``specs`` ({name: (dtype, shape)}) in shards of ``out_dir`` (module docstring); ``write`` each
    tensor once, in any order, then ``close`` (writes the index) returns the file names."""

    def __init__(self, out_dir: str, specs: dict[str, tuple[torch.dtype, list[int]]], max_shard_bytes: int,
                 say: Callable[[str], None] = lambda line: None, metadata: Optional[dict] = None):
        from moe_plugin.checkpoint.tensor_files import TensorWriter, nbytes

        shards: list[dict] = [{}]
        size = 0
        for name in sorted(specs):
            n = nbytes(*specs[name])
            if shards[-1] and size + n > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = specs[name]
            size += n
        self.total = sum(nbytes(*spec) for spec in specs.values())
        meta = {"format": "pt", **(metadata or {})}
        self.names = ([WEIGHTS] if len(shards) == 1 else
                      [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        self._out_dir, self._say = out_dir, say
        self._writers = [TensorWriter(os.path.join(out_dir, n), s, meta) for n, s in zip(self.names, shards)]
        self._shard = {name: i for i, s in enumerate(shards) for name in s}
        self._left, self._done = [len(s) for s in shards], 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        i = self._shard[name]
        self._writers[i].write(name, tensor)
        self._left[i] -= 1
        if self._left[i] == 0:
            self._writers[i].close()
            self._done += 1
            self._say(f"wrote {self.names[i]} ({self._done}/{len(self.names)} shards)")

    def close(self) -> list[str]:
        for w in self._writers:
            w.close()
        if len(self.names) == 1:
            return list(self.names)
        weight_map = {name: self.names[i] for name, i in sorted(self._shard.items())}
        with open(os.path.join(self._out_dir, INDEX), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2)
        return list(self.names) + [INDEX]

    def abandon(self) -> None:
        for w in self._writers:
            w.abandon()


def tokenizer_files(hf_dir: str) -> list[str]:
    """The tokenizer (and generation config) files present in ``hf_dir``, each confined to it."""
    return [name for name in TOKENIZER_FILES if os.path.isfile(confined(hf_dir, name))]


def confined(hf_dir: str, name: str, where: Optional[str] = None) -> str:
    """``hf_dir/name``, refused in one line (``where``: what names it, default the file itself) unless
    it stays inside the model directory (``checkpoint.confine.inside``; a cache snapshot's links into
    its repository's blobs, ``hf_cache_root``)."""
    from moe_plugin.checkpoint.confine import hf_cache_root, inside

    return inside(hf_dir, name, where or os.path.join(hf_dir, name), within=hf_cache_root(hf_dir))


def check_hf_files(hf_dir: str) -> None:
    """Every file of ``hf_dir`` read by a fixed name (the config, the weights or their index, the
    tokenizer's) confined to it, before any is read."""
    for name in ("config.json", WEIGHTS, INDEX, PICKLED, PICKLED_INDEX, *TOKENIZER_FILES):
        if os.path.lexists(os.path.join(hf_dir, name)):
            confined(hf_dir, name)
