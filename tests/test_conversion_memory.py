"""Conversions hold one tensor at a time: ``moe-plugin import-hf``, ``export-hf``, ``export`` and
``upcycle`` run as a user runs them, each in a child process whose peak RSS
(``resource.getrusage(RUSAGE_CHILDREN)`` of a wrapper around that one command) is measured at two
model sizes (2 and 8 layers, the same layer): the peak must not grow with the layers, while the
bytes converted grow by about 100 MB. Holding the model whole (as the conversions did before
this test) grows the peak by 1-3x those bytes.

The models' config.json comes from transformers' own config classes and their weights, random
bf16, are written one tensor at a time under the hub's names (what ``save_pretrained`` writes:
per-expert ``block_sparse_moe.experts.E.w1/w2/w3`` for Mixtral), so building them costs no memory
either. Also checked: a bf16 import makes a checkpoint of about the
source's size (the dtype is kept), and the export-hf of the import is the source, tensor for tensor.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

LAYERS = (2, 8)
# hidden 256, 8 experts of 1024: one layer's weights 6.8 M parameters, 13.6 MB in bf16
SHAPE = dict(vocab_size=384, hidden_size=256, num_attention_heads=8, num_key_value_heads=4, intermediate_size=1024,
             max_position_embeddings=256, rms_norm_eps=1e-5)
MIXTRAL = dict(num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
LLAMA = dict(tie_word_embeddings=False)
GROWTH_MB = 40   # the most the peak may grow from 2 to 8 layers (the bytes grow by 82 MB in bf16, 164 MB in fp32)

WRAP = """
import resource, subprocess, sys
status = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
if status.returncode:
    sys.stderr.write(status.stderr[-4000:])
    sys.exit(status.returncode)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def write_hf_model(kind: str, path: Path, layers: int, seed: int = 0) -> int:
    """A transformers model directory (config.json, model.safetensors in bf16) written tensor by
    tensor; returns its weights' bytes."""
    import transformers

    from moe_plugin.checkpoint.tensor_files import TensorWriter, nbytes

    config_cls, model_cls, extra = {"mixtral": ("MixtralConfig", "MixtralForCausalLM", MIXTRAL),
                                    "llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA)}[kind]
    config = getattr(transformers, config_cls)(**SHAPE, **extra, num_hidden_layers=layers)
    config.dtype = "bfloat16"
    specs = {k: (torch.bfloat16, shape) for k, shape in sorted(hub_shapes(kind, config).items())}
    path.mkdir(parents=True)
    config.save_pretrained(path)
    gen = torch.Generator().manual_seed(seed)
    with TensorWriter(path / "model.safetensors", specs, {"format": "pt"}) as out:
        for name, (dtype, shape) in specs.items():
            value = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.02
            out.write(name, value.to(dtype))
    return sum(nbytes(*spec) for spec in specs.values())


def hub_shapes(kind: str, c) -> dict[str, list[int]]:
    """{name: shape} of the hub layout of ``c`` (a Mixtral or Llama config)."""
    h, d = c.hidden_size, c.hidden_size // c.num_attention_heads
    out = {"model.embed_tokens.weight": [c.vocab_size, h], "model.norm.weight": [h],
           "lm_head.weight": [c.vocab_size, h]}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
                    p + "self_attn.q_proj.weight": [c.num_attention_heads * d, h],
                    p + "self_attn.k_proj.weight": [c.num_key_value_heads * d, h],
                    p + "self_attn.v_proj.weight": [c.num_key_value_heads * d, h],
                    p + "self_attn.o_proj.weight": [h, c.num_attention_heads * d]})
        f = c.intermediate_size
        if kind == "llama":
            out.update({p + "mlp.gate_proj.weight": [f, h], p + "mlp.up_proj.weight": [f, h],
                        p + "mlp.down_proj.weight": [h, f]})
            continue
        out[p + "block_sparse_moe.gate.weight"] = [c.num_local_experts, h]
        for e in range(c.num_local_experts):
            q = p + f"block_sparse_moe.experts.{e}."
            out.update({q + "w1.weight": [f, h], q + "w3.weight": [f, h], q + "w2.weight": [h, f]})
    return out


def peak_mb(*args: str) -> float:
    """Run ``moe-plugin ARGS`` in a child; its peak RSS in MB."""
    command = [sys.executable, "-c", WRAP, sys.executable, "-m", "moe_plugin_tools.cli", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"moe-plugin {' '.join(args)} failed:\n{done.stderr}"
    return int(done.stdout.strip().splitlines()[-1]) / 1024


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    root = tmp_path_factory.mktemp("sizes")
    (root / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                                              "moe": {"parallel": {"expert": 2}}}))
    (root / "ds_up.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1,
        "moe": {"num_experts": 4, "top_k": 2, "router": "topk", "activation": "swiglu", "drop_tokens": False,
                "parallel": {"expert": 2}}}))
    (root / "ds_dense.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "moe": {"num_experts": 8}}))
    out = {}
    for layers in LAYERS:
        d = root / f"L{layers}"
        source = write_hf_model("mixtral", d / "hf", layers)
        peaks = {"import-hf": peak_mb("import-hf", str(d / "hf"), "--config", str(root / "ds.json"),
                                      "--out", str(d / "ckpt")),
                 "export-hf": peak_mb("export-hf", str(d / "ckpt"), "--out", str(d / "hf-out")),
                 "export": peak_mb("export", str(d / "ckpt"), "--out", str(d / "export"))}
        write_hf_model("llama", d / "dense-hf", layers, seed=1)
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
