"""Hugging Face model directories of any size without building a model, and a command's peak memory.

    shape = HFShape(hidden=1024, heads=16, kv_heads=4, experts=8, ffn=3584, vocab=384)
    weight_bytes = write_hf_model("mixtral", path, layers=4, shape=shape)   # config.json, model.safetensors
    done = run_measured([sys.executable, "-m", "moe_plugin_tools.cli", "export", ...])
    done.seconds, done.peak_bytes, done.lines                               # the child's wall time, peak RSS, stdout

``write_hf_model``: ``config.json`` comes from transformers' own config class (``MixtralConfig``,
``LlamaConfig``) and ``model.safetensors`` is written one tensor at a time (random bf16, norms
ones) under the hub's names, those ``save_pretrained`` writes (per-expert
``block_sparse_moe.experts.E.w1/w2/w3`` for Mixtral), so a model of any size costs this process one
tensor's memory. ``run_measured``: the command runs under a small wrapper process that reads
``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`` once the command has exited: the peak resident
memory of that command alone (and of anything it started), not of this process.
Used by ``moe-plugin bench checkpoint`` and tests/e2e/test_conversion_memory.py; no torch import until a
model is written.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

KINDS = ("mixtral", "llama")


@dataclass(frozen=True)
class HFShape:
    """A model's sizes but its layer count (default: the Mixtral shape of ``bench checkpoint``,
    364 M parameters at 4 layers). ``experts`` is unused by a dense (llama) model."""

    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 4
    experts: int = 8
    ffn: int = 3584
    vocab: int = 384
    top_k: int = 2
    max_positions: int = 256


def hf_config(kind: str, layers: int, shape: HFShape = HFShape()):
    """The transformers config of a ``kind`` model (mixtral or llama) of ``layers`` layers, bf16."""
    import transformers

    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                  num_key_value_heads=shape.kv_heads, intermediate_size=shape.ffn,
                  max_position_embeddings=shape.max_positions, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  num_hidden_layers=layers)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**common, num_local_experts=shape.experts,
                                            num_experts_per_tok=shape.top_k)
    elif kind == "llama":
        config = transformers.LlamaConfig(**common)
    else:
        raise ValueError(f"model kind: got {kind!r}; one of {', '.join(KINDS)}")
    config.dtype = "bfloat16"
    return config


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


def param_count(kind: str, layers: int, shape: HFShape = HFShape()) -> int:
    """Parameters of the model ``write_hf_model`` writes (its weights' bytes / 2)."""
    return sum(math.prod(s) for s in hub_shapes(kind, hf_config(kind, layers, shape)).values())


def write_hf_model(kind: str, path: Path, layers: int, shape: HFShape = HFShape(), seed: int = 0) -> int:
    """A transformers model directory (config.json, model.safetensors in bf16) written tensor by
    tensor into ``path`` (created; must not exist); returns its weights' bytes."""
    import torch

    from moe_plugin.checkpoint.tensor_files import TensorWriter, nbytes

    config = hf_config(kind, layers, shape)
    specs = {k: (torch.bfloat16, s) for k, s in sorted(hub_shapes(kind, config).items())}
    path.mkdir(parents=True)
    config.save_pretrained(path)
    gen = torch.Generator().manual_seed(seed)
    with TensorWriter(path / "model.safetensors", specs, {"format": "pt"}) as out:
        for name, (dtype, s) in specs.items():
            value = torch.ones(s) if name.endswith("norm.weight") else torch.randn(s, generator=gen) * 0.02
            out.write(name, value.to(dtype))
    return sum(nbytes(*spec) for spec in specs.values())


# Runs argv[1:] with its stdout passed through and its stderr kept (shown only if it fails), then
# writes one JSON line to stderr: its wall time and ru_maxrss of this wrapper's children (KiB on Linux).
WRAP = """
import json, resource, subprocess, sys, time
start = time.perf_counter()
status = subprocess.run(sys.argv[1:], stderr=subprocess.PIPE, text=True)
seconds = time.perf_counter() - start
if status.returncode:
    sys.stderr.write(status.stderr[-4000:])
    sys.exit(status.returncode)
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
sys.stderr.write(json.dumps({"seconds": seconds, "maxrss_kib": peak}))
"""


@dataclass(frozen=True)
class Measured:
    """One command's run: wall seconds, peak resident bytes, its stdout lines."""

    seconds: float
    peak_bytes: int
    lines: tuple[str, ...]


class CommandFailed(RuntimeError):
    """The measured command exited with a non-zero status (or ran past its timeout)."""


def run_measured(argv: Sequence[str], timeout: Optional[float] = None,
                 on_line: Optional[Callable[[str], None]] = None) -> Measured:
    """Run ``argv`` in a child under ``WRAP``; ``on_line(line)`` for each line it prints, as it prints
    it. Past ``timeout`` seconds the wrapper's whole process group is killed."""
    command = [sys.executable, "-c", WRAP, *argv]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)   # its own group: a timeout ends the command too
    expired = threading.Event()

    def kill() -> None:
        expired.set()
        os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout, kill) if timeout is not None else None
    lines = []
    try:
        if timer is not None:
            timer.start()
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if on_line is not None:
                on_line(lines[-1])
        err = proc.stderr.read()
        status = proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
        proc.stdout.close()
        proc.stderr.close()
    shown = " ".join(argv)
    if expired.is_set():
        raise CommandFailed(f"{shown}: killed after {timeout:g} s")
    if status:
        raise CommandFailed(f"{shown} exited with status {status}:\n{err}")
    record = json.loads(err.strip().splitlines()[-1])
    return Measured(seconds=record["seconds"], peak_bytes=record["maxrss_kib"] * 1024, lines=tuple(lines))
