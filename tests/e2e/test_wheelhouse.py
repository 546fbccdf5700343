"""``make wheelhouse`` and ``examples/gpt_moe/install_wheels.sh``: the plugin installed offline beside a torch.

The wheelhouse (``moe_plugin_tools/wheelhouse.py``) is built for this Python into a temporary folder,
installed by the script with ``pip install --no-index --no-deps --target``, and the example trains 2
steps in an interpreter that sees only that folder and torch: ``python -S`` (no site-packages) with
``PYTHONPATH`` the install folder and an "image" folder holding this venv's torch and the
distributions torch itself requires, linked one by one. So a distribution the wheelhouse misses fails
the import, and the image's torch stays the one used.

DeepSpeed's ops compile on first use: the run compiles its shared-memory all-reduce from the installed
sources, into a ``TORCH_EXTENSIONS_DIR`` of its own (in the venv's, ``tests/conftest.py``, a build
from other sources would replace the suite's, which the next spawn would build again). It trains with
torch's AdamW (``"torch_adam": true``): DeepSpeed's fused Adam would be a second compile of its own,
a minute of two cores for nothing the wheelhouse decides; the installed DeepSpeed is checked to hold
its sources and include directories (as the all-reduce's) instead.
"""
from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from launcher import REPO, require_slow_mark
from ds_json import write_ds_config

pytestmark = pytest.mark.slow   # builds DeepSpeed's wheel and downloads from the package index


def _image(folder: Path) -> None:
    """Links of torch and what torch requires (their packages, modules and metadata) into ``folder``."""
    from moe_plugin_tools.wheelhouse import WITH_TORCH, canonical, requirements_of

    folder.mkdir()
    seen, stack = set(), list(WITH_TORCH)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        stack += [canonical(r) for r in requirements_of(name)]
        base = Path(dist.locate_file(""))
        for entry in {Path(str(f)).parts[0] for f in dist.files or []}:
            if entry != ".." and (base / entry).exists() and not (folder / entry).exists():
                (folder / entry).symlink_to(base / entry)


def _missing_op_sources(site: Path) -> list[str]:
    """The sources and include directories of DeepSpeed's CPU ops (a run's first use compiles them) that
    the DeepSpeed installed in ``site`` lacks. The lists are this venv's DeepSpeed's builders' (the
    wheelhouse holds that version), the include directories those this venv's DeepSpeed has."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    ours = Path(deepspeed.__file__).parent / "ops"
    missing = []
    for name in ("FusedAdamBuilder", "ShareMemCommBuilder"):
        builder = get_accelerator().create_op_builder(name)
        sources = builder.strip_empty_entries(builder.sources())
        assert sources and all((ours / p).is_file() for p in sources), (name, sources)
        paths = sources + [p for p in builder.strip_empty_entries(builder.include_paths()) if (ours / p).is_dir()]
        missing += [f"{name}: {p}" for p in paths if not (site / "deepspeed" / "ops" / p).exists()]
    return missing


def test_the_wheelhouse_installs_beside_torch_and_the_example_trains(tmp_path):
    require_slow_mark("the example")
    from moe_plugin_tools.wheelhouse import build

    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    wheels = build(tmp_path / "wheelhouse", [python], say=lambda line: None)
    names = {w.name.split("-")[0].lower() for w in wheels}
    assert {"moe_plugin", "deepspeed", "megatron_core", "pydantic"} <= names
    assert not any(n.startswith(("torch", "nvidia", "triton", "matplotlib")) for n in names), names
    site = tmp_path / "site"
    done = subprocess.run([str(REPO / "examples/gpt_moe/install_wheels.sh"), str(tmp_path / "wheelhouse"), str(site)],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"installed into {site}: moe_plugin 0.1.0" in done.stdout, done.stdout
    missing = _missing_op_sources(site)
    assert not missing, f"the installed DeepSpeed lacks what its CPU ops compile from: {missing}"
    _image(tmp_path / "image")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHONPATH=f"{site}{os.pathsep}{tmp_path / 'image'}", PATH=f"{site / 'bin'}{os.pathsep}{env['PATH']}",
               RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29581",
               TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"))
    config = tmp_path / "ds.json"
    write_ds_config(config, batch=2, micro=2, zero=None, clip=None,
                    optimizer={"type": "AdamW", "params": {"lr": 0.001, "torch_adam": True}},
                    moe={"num_experts": 4, "router": "topk", "top_k": 2})
    run = subprocess.run([sys.executable, "-S", str(REPO / "examples/gpt_moe/pretrain_gpt_moe.py"),
                          "--deepspeed_config", str(config), "--num-layers", "2", "--hidden-size", "32",
                          "--num-attention-heads", "2", "--seq-length", "16", "--train-iters", "2",
                          "--eval-interval", "0", "--corpus-bytes", str(96 * 1024), "--valid-fraction", "0.25",
                          "--data-cache", str(tmp_path / "data"), "--run-dir", str(tmp_path / "run"), "--log-interval", "1"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "reached step 2" in run.stdout + run.stderr
    assert "note: matplotlib is not installed, no plot" in run.stderr   # the plots are an extra
