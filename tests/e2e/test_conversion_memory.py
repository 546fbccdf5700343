"""Conversions hold one tensor at a time: ``moe-plugin import-hf``, ``export-hf``, ``export`` and
``upcycle`` run as a user runs them, each in a child process whose peak RSS
(``resource.getrusage(RUSAGE_CHILDREN)`` of a wrapper around that one command) is measured at two
model sizes (2 and 8 layers, the same layer): the peak must not grow with the layers, while the
bytes converted grow by about 100 MB. Holding the model whole (as the conversions did before
this test) grows the peak by 1-3x those bytes.

The models' config.json comes from transformers' own config classes and their weights, random
bf16, are written one tensor at a time under the hub's names (what ``save_pretrained`` writes:
per-expert ``block_sparse_moe.experts.E.w1/w2/w3`` for Mixtral), so building them costs no memory
either (moe_plugin_tools/bench/hf_model.py, which ``moe-plugin bench checkpoint`` uses too). Also
checked: a bf16 import makes a checkpoint of about the source's size (the dtype is kept), and the
export-hf of the import is the source, tensor for tensor; and the conversions' ``cat`` and ``stack``
on meta tensors (their plans from the headers) give torch's shapes without torch's meta ``cat``, which
imports TorchDynamo on its first call.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_json import conversion_config
from moe_plugin_tools.bench.hf_model import HFShape, run_measured, write_hf_model

LAYERS = (2, 8)
# hidden 256, 8 experts of 1024: one layer's weights 6.8 M parameters, 13.6 MB in bf16
SHAPE = HFShape(hidden=256, heads=8, kv_heads=4, experts=8, ffn=1024, vocab=384)
GROWTH_MB = 40   # the most the peak may grow from 2 to 8 layers (the bytes grow by 82 MB in bf16, 164 MB in fp32)


def peak_mb(*args: str) -> float:
    """Run ``moe-plugin ARGS`` in a child; its peak RSS in MB."""
    return run_measured([sys.executable, "-m", "moe_plugin_tools.cli", *args], timeout=600).peak_bytes / 2 ** 20


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    root = tmp_path_factory.mktemp("sizes")
    (root / "ds.json").write_text(json.dumps(conversion_config(micro=1, moe={}, parallel={"expert": 2})))
    (root / "ds_up.json").write_text(json.dumps(conversion_config(
        micro=1, moe={"num_experts": 4, "top_k": 2, "router": "topk", "activation": "swiglu", "drop_tokens": False},
        parallel={"expert": 2})))
    (root / "ds_dense.json").write_text(json.dumps(conversion_config(micro=1, moe={"num_experts": 8})))
    out = {}
    for layers in LAYERS:
        d = root / f"L{layers}"
        source = write_hf_model("mixtral", d / "hf", layers, SHAPE)
        peaks = {"import-hf": peak_mb("import-hf", str(d / "hf"), "--config", str(root / "ds.json"),
                                      "--out", str(d / "ckpt")),
                 "export-hf": peak_mb("export-hf", str(d / "ckpt"), "--out", str(d / "hf-out")),
                 "export": peak_mb("export", str(d / "ckpt"), "--out", str(d / "export"))}
        write_hf_model("llama", d / "dense-hf", layers, SHAPE, seed=1)
        peak_mb("import-hf", str(d / "dense-hf"), "--config", str(root / "ds_dense.json"), "--out", str(d / "dense"))
        peaks["upcycle"] = peak_mb("upcycle", str(d / "dense"), "--config", str(root / "ds_up.json"),
                                   "--out", str(d / "moe"))
        out[layers] = {"dir": d, "source_bytes": source, "peaks": peaks}
    print({layers: {k: round(v) for k, v in m["peaks"].items()} for layers, m in out.items()})
    return out


@pytest.mark.parametrize("step", ["import-hf", "export-hf", "export", "upcycle"])
def test_the_peak_does_not_grow_with_the_layers(measured, step):
    small, large = (measured[n]["peaks"][step] for n in LAYERS)
    grown = (measured[LAYERS[1]]["source_bytes"] - measured[LAYERS[0]]["source_bytes"]) / 1e6
    assert large - small < GROWTH_MB, (f"{step}: peak {small:.0f} MB at {LAYERS[0]} layers, {large:.0f} MB at "
                                       f"{LAYERS[1]} (the model grew by {grown:.0f} MB)")


def test_a_bf16_import_is_the_size_of_its_source_and_exports_to_it(measured):
    from safetensors.torch import load_file

    m = measured[LAYERS[1]]
    ckpt = _bytes(m["dir"] / "ckpt" / "step0")
    assert ckpt <= 1.05 * m["source_bytes"] + (1 << 20), (ckpt, m["source_bytes"])
    source, back = (load_file(str(m["dir"] / d / "model.safetensors")) for d in ("hf", "hf-out"))
    assert sorted(source) == sorted(back)
    assert all(back[k].dtype == torch.bfloat16 and torch.equal(back[k], source[k]) for k in source)
    exported = load_file(str(m["dir"] / "export" / "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in exported.values() if v.is_floating_point())


def test_cat_and_stack_on_meta_tensors_give_torch_shapes():
    from moe_plugin.checkpoint.shards import cat, stack

    real = [torch.zeros(2, 3, 4), torch.zeros(2, 5, 4)]
    meta = [t.to("meta") for t in real]
    for dim in (1, -2):
        assert cat(meta, dim).shape == torch.cat(real, dim).shape and cat(meta, dim).is_meta
    same = [torch.zeros(2, 3), torch.zeros(2, 3)]
    for dim in (0, 1, 2, -1):
        assert stack([t.to("meta") for t in same], dim).shape == torch.stack(same, dim).shape
    assert torch.equal(cat(real, 1), torch.cat(real, 1))   # real tensors: torch's
    code = ("import sys, torch; from moe_plugin.checkpoint.shards import cat; "
            "cat([torch.empty(2, 3, device='meta'), torch.empty(2, 1, device='meta')], 1); "
            "print('torch._dynamo' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300).stdout.strip() == "False"
    with pytest.raises(RuntimeError, match="differ outside dimension 0"):
        cat(meta, 0)
