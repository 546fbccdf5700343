"""docs/porting.md and examples/simple_loop: the plain Megatron-Core loop and its port to the plugin.

* the guide's diff is the diff of the two scripts, and the count of changed lines it states is
  that diff's (so neither rots when a script changes); both scripts compile;
* the ported loop under the ``deepspeed`` launcher on 2 ranks (dp 2 x ep 2, ZeRO-1): 6 steps with
  a checkpoint after step 3, then a second launch that loads step 3 and trains steps 4-6 with
  exactly the first run's losses; nothing is left in ``/dev/shm`` (the two loops' launches run side by
  side);
* the "before" script on 2 CPU ranks (dp 2) with its two CUDA-only pieces swapped
  (``tests/plain_loop_on_cpu.py``): 4 steps, the engine's checkpoint of step 2, a resume from it
  with the same losses.
"""
from __future__ import annotations

import difflib
import json
import py_compile
import re

import pytest

from launcher import REPO, jobs

LOOP = REPO / "examples" / "simple_loop"
BEFORE, AFTER = LOOP / "train_plain_mcore.py", LOOP / "train_simple_mcore.py"
GUIDE = REPO / "docs" / "porting.md"


def port_diff() -> str:
    """The unified diff (one line of context) from the plain loop to the ported one."""
    return "".join(difflib.unified_diff(BEFORE.read_text().splitlines(True), AFTER.read_text().splitlines(True),
                                        f"examples/simple_loop/{BEFORE.name}", f"examples/simple_loop/{AFTER.name}",
                                        n=1))


def changed_lines(diff: str) -> tuple[int, int]:
    """(lines removed, lines added) of a unified diff."""
    body = [line for line in diff.splitlines() if not line.startswith(("---", "+++"))]
    return sum(line.startswith("-") for line in body), sum(line.startswith("+") for line in body)


def test_the_guide_shows_the_scripts_diff_and_its_count():
    guide = GUIDE.read_text()
    shown = re.search(r"```diff\n(.*?)```", guide, re.S)
    assert shown, "docs/porting.md has no ```diff block"
    diff = port_diff()
    assert shown.group(1) == diff, "docs/porting.md's diff is stale: paste tests/e2e/test_porting.port_diff() again"
    removed, added = changed_lines(diff)
    stated = re.search(r"\*\*(\d+) lines removed, (\d+) added\*\*", guide)
    assert stated and (int(stated.group(1)), int(stated.group(2))) == (removed, added), (removed, added)
    for script in (BEFORE, AFTER):
        py_compile.compile(str(script), doraise=True)


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict:
    """The ported loop (6 steps, a checkpoint after step 3; then steps 4-6 from it) and the plain loop
    through ``tests/plain_loop_on_cpu.py`` (4 steps, a checkpoint after step 2; then steps 3-4 from it),
    each a job of 2 ranks under the launcher: the two first runs side by side, then the two resumes.
    ``launcher.jobs`` fails when the ported loop leaves its ``/dev/shm`` buffers behind (the plain loop,
    without the plugin, leaves DeepSpeed's; they are removed)."""
    root = tmp_path_factory.mktemp("porting")
    ported, plain = root / "ported", root / "plain"
    ported.mkdir()
    plain.mkdir()
    plain_json = plain / "ds_plain.json"
    config = json.loads((LOOP / "ds_config.json").read_text())
    config.pop("moe")
    plain_json.write_text(json.dumps(config))
    ported_argv = [str(AFTER), "--deepspeed_config", str(LOOP / "ds_config.json"), "--steps", "6"]
    plain_argv = [str(REPO / "tests" / "plain_loop_on_cpu.py"), "--deepspeed_config", str(plain_json), "--steps", "4"]
    first = jobs([[*ported_argv, "--save", str(ported / "ckpt"), "--save-at", "3", "--losses",
                   str(ported / "first.json")],
                  [*plain_argv, "--save", str(plain / "ckpt"), "--save-at", "2", "--losses", str(plain / "a.json")]],
                 leaves_shm=(1,))
    resumed = jobs([[*ported_argv, "--load", str(ported / "ckpt"), "--load-tag", "step3", "--losses",
                     str(ported / "resumed.json")],
                    [*plain_argv, "--load", str(plain / "ckpt"), "--load-tag", "step2", "--losses",
                     str(plain / "b.json")]], leaves_shm=(1,))
    return {"ported": (ported, first[0], resumed[0]), "plain": (plain, first[1], resumed[1])}


@pytest.mark.slow
def test_ported_loop_on_two_ranks_resumes_bit_exactly(launches):
    out, done, again_done = launches["ported"]
    assert done.status == 0, done.output[-4000:]
    losses = json.loads((out / "first.json").read_text())
    assert list(losses) == ["1", "2", "3", "4", "5", "6"] and losses["6"] < losses["1"] - 0.2, losses
    assert {"latest", "step3", "step6"} <= {p.name for p in (out / "ckpt").iterdir()}
    assert again_done.status == 0, again_done.output[-4000:]
    again = json.loads((out / "resumed.json").read_text())
    assert again == {step: losses[step] for step in ("4", "5", "6")}, (again, losses)   # bit for bit


@pytest.mark.slow
def test_plain_loop_runs_on_two_ranks_with_its_cuda_pieces_swapped(launches):
    """The "before" loop is a working loop: on 2 CPU ranks (dp 2) through ``tests/plain_loop_on_cpu.py``
    it trains 4 steps, saves step 2 with the engine's own checkpoint and resumes from it."""
    out, done, again_done = launches["plain"]
    assert done.status == 0, done.output[-4000:]
    losses = json.loads((out / "a.json").read_text())
    assert again_done.status == 0, again_done.output[-4000:]
    assert json.loads((out / "b.json").read_text()) == {"3": losses["3"], "4": losses["4"]}, losses
