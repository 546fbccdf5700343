"""The expert GEMM backends (``moe_plugin/layers/expert_backend.py``).

Every backend against the loop oracle ``reference_moe`` on CPU, fp32 (atol = rtol = 1e-5) and
bf16 input against the fp32 oracle (fp32 weights cast in forward; atol 0.1, rtol 3e-2: bf16
keeps 8 bits and the router gradient reaches 43 here): output and every gradient, with uneven
counts, experts that get no rows and the chunked path cut down to one or two experts per chunk. The choice of ``auto`` with a faked CUDA capability
and probe, so the CUDA branch runs without a GPU.
"""
from __future__ import annotations

import logging

import pytest
import torch

from moe_plugin.configs import ConfigError
from moe_plugin.layers import GroupedExperts, choose_backend, expert_backend, ffn_autograd
from tests.unit.layers.test_layers_single import H, TOL, check_against_oracle, make_layer, tokens

CUDA = torch.device("cuda")
CPU = torch.device("cpu")
SIZES = (16, 32, 32)          # H, F1, F: 16-byte rows in fp32 and bf16


@pytest.fixture(autouse=True)
def fresh_caches():
    expert_backend.probe.cache_clear()
    expert_backend._log_choice.cache_clear()
    yield
    expert_backend.probe.cache_clear()
    expert_backend._log_choice.cache_clear()


@pytest.mark.parametrize("chunk_rows", [None, 1, 6], ids=["one-chunk", "chunk-per-expert", "chunks-of-6-rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["grouped_mm", "bmm", "loop"])
def test_backend_matches_oracle(backend, dtype, chunk_rows, monkeypatch):
    layer = make_layer(router="topk", top_k=2, drop_tokens=False, activation="swiglu", experts_backend=backend)
    layer.router.expert_bias[[3, 7]] = -1e4      # experts 3 (mid-chunk) and 7 (a chunk of its own) get no rows
    if chunk_rows is not None:                   # chunks close once their rows reach chunk_rows x one row of F1
        row_bytes = layer.experts.weight1.shape[-1] * dtype.itemsize
        monkeypatch.setitem(ffn_autograd.expert_ffn.__kwdefaults__, "chunk_bytes", chunk_rows * row_bytes)
    x = tokens().to(dtype)
    tol = TOL if dtype == torch.float32 else dict(atol=1e-1, rtol=3e-2)
    stats, _ = check_against_oracle(layer, x, tol=tol, oracle_dtype=torch.float32)
    kept_E = stats.kept_per_expert.tolist()
    assert kept_E[3] == kept_E[7] == 0 and len(set(kept_E)) > 2, kept_E
    assert layer.experts.pick_backend(x) == backend


def fake_cuda(monkeypatch, capability, probe_says=None):
    monkeypatch.setattr(expert_backend, "device_capability", lambda device: capability)
    monkeypatch.setattr(expert_backend, "probe", lambda device_type, dtype: probe_says)


@pytest.mark.parametrize("capability, dtype, chosen", [
    ((8, 0), torch.bfloat16, "grouped_mm"),
    ((9, 0), torch.bfloat16, "grouped_mm"),
    ((7, 0), torch.bfloat16, "bmm"),
    ((9, 0), torch.float32, "bmm"),
    ((8, 6), torch.float16, "bmm"),
])
def test_auto_on_cuda_follows_capability_and_dtype(monkeypatch, capability, dtype, chosen):
    fake_cuda(monkeypatch, capability)
    assert choose_backend("auto", CUDA, dtype, SIZES) == chosen


def test_auto_falls_back_when_the_probe_fails(monkeypatch):
    fake_cuda(monkeypatch, (9, 0), probe_says="a probe call raised RuntimeError: no kernel image")
    assert choose_backend("auto", CUDA, torch.bfloat16, SIZES) == "bmm"


def test_probe_that_raises_means_unsupported(monkeypatch):
    def missing_kernel(*args, **kwargs):
        raise NotImplementedError("Could not run 'aten::_grouped_mm' with arguments from the 'CPU' backend")

    monkeypatch.setattr(expert_backend, "GROUPED_MM", missing_kernel)
    assert expert_backend.probe("cpu", torch.float32).startswith("a probe call raised NotImplementedError: Could not")
    assert choose_backend("auto", CPU, torch.float32, SIZES) == "loop"


def test_auto_on_cpu():
    assert choose_backend("auto", CPU, torch.float32, SIZES) == "grouped_mm"
    assert choose_backend("auto", CPU, torch.bfloat16, SIZES) == "grouped_mm"
    assert choose_backend("auto", CPU, torch.float32, (6, 32, 32)) == "loop"   # 24-byte rows
    assert choose_backend("auto", CPU, torch.bfloat16, (12, 32, 32)) == "loop"
    assert choose_backend("auto", CPU, torch.float64, SIZES) == "loop"
    assert choose_backend("auto", torch.device("meta"), torch.float32, SIZES) == "bmm"   # untested device type


def test_forced_backends(monkeypatch):
    fake_cuda(monkeypatch, (7, 5))
    for backend in ("bmm", "loop"):
        assert choose_backend(backend, CUDA, torch.float32, SIZES) == backend
    with pytest.raises(ConfigError, match=r"^moe\.experts_backend: got 'grouped_mm'; cannot run torch\.bfloat16 on "
                       r"cuda here: .*compute capability >= 8\.0, got torch\.bfloat16 on 7\.5.*use 'auto', 'bmm'"):
        choose_backend("grouped_mm", CUDA, torch.bfloat16, SIZES)
    with pytest.raises(ConfigError, match=r"moe\.experts_backend: got 'grouped_mm'; .*rows of \[6\] torch.float32 "
                       r"values are not a multiple of 16 bytes"):
        GroupedExperts(8, 6, 32, backend="grouped_mm")(torch.zeros(2, 6), torch.tensor([1, 1, 0, 0, 0, 0, 0, 0]))
    with pytest.raises(ConfigError, match=r"moe\.experts_backend: got 'cublas'; expected one of 'auto', "
                       r"'grouped_mm', 'bmm', 'loop'"):
        GroupedExperts(8, H, 32, backend="cublas")


def test_choice_logged_once_per_process(monkeypatch, caplog):
    fake_cuda(monkeypatch, (7, 0))
    with caplog.at_level(logging.INFO, logger=expert_backend.__name__):
        for _ in range(3):
            choose_backend("auto", CUDA, torch.bfloat16, SIZES)
            choose_backend("auto", CPU, torch.float32, SIZES)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("experts on cuda torch.bfloat16: bmm, not grouped_mm (CUDA's grouped kernel needs")
    assert lines[1] == "experts on cpu torch.float32: grouped_mm (supported)"
