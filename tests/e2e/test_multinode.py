"""The ``deepspeed`` launcher's multi-node path, on one machine: two launchers, each a "node" of 2
ranks, form one 4-rank job that trains the example as the single 4-rank launcher does.

DeepSpeed 0.19.8's runner reads a hostfile (``NAME slots=N`` per line) and, with ``--no_ssh``,
starts no remote command: it runs ``deepspeed.launcher.launch`` here with ``--node_rank``, which
starts this node's ranks with global ranks counted over the hostfile's nodes in order (node 0:
ranks 0-1, node 1: ranks 2-3), ``WORLD_SIZE`` 4, ``LOCAL_SIZE`` 2 and the given
``--master_addr``/``--master_port``. So the host names are never resolved and both "nodes" may be
this machine: the processes rendezvous over TCP on 127.0.0.1 as they would across machines. The
two jobs' training and validation losses are equal bit for bit. What the test does not reach: ssh
(``pdsh``) launching, a second machine's file system and network.

With ``LOCAL_SIZE`` (2) below the world size (4), DeepSpeed's CPU backend makes no shared-memory
buffers, as on real separate machines; the single launcher's job makes and (through the plugin)
unlinks them.
"""
from __future__ import annotations

import json
import re

import pytest

from launcher import assert_succeeded, deepspeed_together
from example_runs import MODEL_FLAGS, MOE, SCRIPT
from ds_json import write_ds_config

pytestmark = pytest.mark.slow   # through the deepspeed launcher or several processes

HOSTFILE = "worker-0 slots=2\nworker-1 slots=2\n"


def _config(path):
    """Global batch 8: micro-batches of 2 on 4 data-parallel ranks; experts: ep 2 x edp 2."""
    return write_ds_config(path, batch=8, micro=2, gas=1, moe=MOE, parallel={"expert": 2})


def _losses(run_dir):
    """(split, step, loss) of every record of the run's metrics.jsonl."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["split"], r["step"], r["loss"]) for r in map(json.loads, lines)]


def test_two_node_launch_matches_one_launcher(tmp_path, launcher_port):
    import socket

    from moe_plugin.compat.shm_buffers import job_shm_buffers

    with socket.socket() as s:   # the single launcher's port (launcher_port: the 2-node job's)
        s.bind(("127.0.0.1", 0))
        single_port = s.getsockname()[1]
    hosts = tmp_path / "hosts"
    hosts.write_text(HOSTFILE)
    train = [str(SCRIPT), *MODEL_FLAGS, "--train-iters", "4", "--eval-interval", "4", "--log-interval", "2",
             "--deepspeed_config", _config(tmp_path / "ds.json"), "--data-cache", str(tmp_path / "data")]
    nodes = [["--hostfile", str(hosts), "--no_ssh", "--node_rank", str(node), "--master_addr", "127.0.0.1",
              "--master_port", str(launcher_port), "--num_nodes", "2", "--num_gpus", "2",
              *train, "--run-dir", str(tmp_path / "two_nodes")] for node in (0, 1)]
    single = ["--num_gpus", "4", "--master_port", str(single_port), *train, "--run-dir", str(tmp_path / "one")]
    try:
        node0, node1, one = deepspeed_together([*nodes, single], cwd=tmp_path, timeout=900)
        assert job_shm_buffers("127.0.0.1", str(single_port)) == []
    finally:
        for path in job_shm_buffers("127.0.0.1", str(single_port)):
            path.unlink(missing_ok=True)
    assert_succeeded(node0, node1, one, chars=4000)   # else the output of the launcher that failed first
    for node, done in enumerate((node0, node1)):
        assert f"nnodes=2, num_local_procs=2, node_rank={node}" in done.output, done.output[-4000:]
        assert re.search(r"global_rank_mapping=.*'worker-0': \[0, 1\], 'worker-1': \[2, 3\]", done.output)
    assert json.loads((tmp_path / "two_nodes" / "run.json").read_text())["world_size"] == 4
    two_nodes, one_launcher = _losses(tmp_path / "two_nodes"), _losses(tmp_path / "one")
    assert [r[:2] for r in two_nodes] == [("train", 1), ("train", 2), ("train", 3), ("train", 4), ("valid", 4)]
    assert two_nodes == one_launcher   # bit for bit: the same ranks do the same sums, whoever started them
    assert job_shm_buffers("127.0.0.1", str(launcher_port)) == []
