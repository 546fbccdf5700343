"""``moe-plugin bench packing`` as a user runs it: packed conversations against one per padded sequence,
their packing efficiency from the lengths and the ratio of the two modes' measured real tokens/s
(no assertion on the timings themselves)."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from launcher import run


@pytest.mark.slow
def test_bench_packing_reports_both_modes_side_by_side(tmp_path):
    from moe_plugin_tools.bench.packing import conversation_lengths

    done = run([sys.executable, "-m", "moe_plugin_tools.cli", "bench", "packing", "--conversations", "40",
                "--mean-length", "12", "--seq-length", "64", "--repeats", "1", "--json"], cwd=tmp_path, timeout=300,
               split_stderr=True)
    assert done.status == 0, done.tail()
    rows = {r["mode"]: r for r in map(json.loads, (x for x in done.output.splitlines() if x.startswith("{")))}
    lengths = conversation_lengths(40, 12, 64, 0)
    packed, padded = rows["packed"], rows["padded"]
    assert padded["sequences"] == 40 and padded["efficiency"] == pytest.approx(lengths.sum() / (40 * 64), abs=1e-4)
    assert packed["sequences"] < 40 and packed["efficiency"] == pytest.approx(
        lengths.sum() / (packed["sequences"] * 64), abs=1e-4)
    assert packed["speedup"] == pytest.approx(packed["real_tokens_per_s"] / padded["real_tokens_per_s"], abs=0.01)
    assert np.isfinite(packed["seconds"]) and packed["seconds"] > 0
