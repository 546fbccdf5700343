"""Load-adaptive expert placement: gate traces, placement policies, load tracking, switching.

* Trace: a round trip of random counts (numpy and torch inputs), a torn last record, append
  after a restart, the bytes per step the docstring states, errors naming the bad value.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_plugin.placement.trace import TraceMeta, TraceWriter, read_trace


# --- gate traces ------------------------------------------------------------------------------

def _random_steps(meta: TraceMeta, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in steps:
        rec = {}
        for i, name in enumerate(meta.layers):
            load = torch.randint(0, 1000, (meta.num_experts,), generator=gen)
            traffic = torch.randint(0, 1000, (meta.ep_size, meta.num_experts), generator=gen)
            rec[name] = (load.numpy() if i % 2 else load, traffic)
        out.append((step, rec))
    return out


def test_trace_round_trip(tmp_path):
    meta = TraceMeta(["decoder.0", "decoder.2", "decoder.4"], num_experts=8, ep_size=4,
                     info={"world_size": 8, "ep_ranks": [[0, 2, 4, 6], [1, 3, 5, 7]]})
    records = _random_steps(meta, [3, 4, 7, 8])
    path = tmp_path / "gate.trace"
    with TraceWriter(path, meta) as writer:
        for step, rec in records:
            writer.append(step, rec)
    header = path.stat().st_size - 4 * meta.bytes_per_step
    assert meta.bytes_per_step == 8 + 4 * 3 * 8 * (1 + 4)
    trace = read_trace(path)
    assert trace.meta == meta and trace.layers == tuple(meta.layers)
    assert trace.load.shape == (4, 3, 8) and trace.traffic.shape == (4, 3, 4, 8)
    assert trace.steps.tolist() == [3, 4, 7, 8]
    for s, (step, rec) in enumerate(records):
        for name, (load, traffic) in rec.items():
            i = trace.layer(name)
            assert np.array_equal(trace.load[s, i], np.asarray(load))
            assert np.array_equal(trace.traffic[s, i], traffic.numpy())
    assert torch.equal(trace.torch()["traffic"][1, 2], records[1][1]["decoder.4"][1])
    # a writer killed mid-record: the torn record is ignored, append resumes after the last whole one
    with open(path, "ab") as handle:
        handle.write(b"\x01" * 17)
    assert read_trace(path).steps.tolist() == [3, 4, 7, 8]
    with TraceWriter(path, meta.to_json(), append=True) as writer:
        writer.append(9, records[0][1])
    again = read_trace(path)
    assert again.steps.tolist() == [3, 4, 7, 8, 9]
    assert path.stat().st_size == header + 5 * meta.bytes_per_step


def test_trace_without_ep_writes_load_as_traffic(tmp_path):
    meta = TraceMeta(["l0"], num_experts=4)
    with TraceWriter(tmp_path / "t", meta) as writer:
        writer.append(0, {"l0": ([1, 2, 3, 4], None)})
    trace = read_trace(tmp_path / "t")
    assert trace.traffic.tolist() == [[[[1, 2, 3, 4]]]] and trace.kept().tolist() == [[[1, 2, 3, 4]]]


def test_trace_errors_name_the_bad_value(tmp_path):
    meta = TraceMeta(["a", "b"], num_experts=4, ep_size=2)
    with pytest.raises(ValueError, match="distinct"):
        TraceMeta(["a", "a"], num_experts=4)
    with pytest.raises(ValueError, match="num_experts must be a positive integer, got 0"):
        TraceMeta(["a"], num_experts=0)
    writer = TraceWriter(tmp_path / "t", meta)
    with pytest.raises(ValueError, match=r"missing \['b'\], unknown \['c'\]"):
        writer.append(0, {"a": ([0] * 4, [[0] * 4] * 2), "c": ([0] * 4, [[0] * 4] * 2)})
    with pytest.raises(ValueError, match=r"layer a traffic has shape \(4,\), expected \(2, 4\)"):
        writer.append(0, {"a": ([0] * 4, [0] * 4), "b": ([0] * 4, [[0] * 4] * 2)})
    with pytest.raises(ValueError, match="outside 0..2147483647"):
        writer.append(0, {"a": ([2 ** 31] * 4, [[0] * 4] * 2), "b": ([0] * 4, [[0] * 4] * 2)})
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.append(1, {})
    with pytest.raises(ValueError, match="cannot append .* E=4, P=2, not"):
        TraceWriter(tmp_path / "t", TraceMeta(["a", "b"], num_experts=8, ep_size=2), append=True)
    (tmp_path / "junk").write_bytes(b"NOTATRACE_______")
    with pytest.raises(ValueError, match="starts with b'NOTATRAC'"):
        read_trace(tmp_path / "junk")
