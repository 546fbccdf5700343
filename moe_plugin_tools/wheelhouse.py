"""``make wheelhouse``: every wheel that installs the plugin, offline, beside a CUDA torch already there.

    python -m moe_plugin_tools.wheelhouse --out wheelhouse [--python 3.11,3.12]
    examples/gpt_moe/install_wheels.sh wheelhouse SITE && export PYTHONPATH=SITE   # on the GPU machine

GPU clusters often have no network and a PyTorch of their image's own. The wheelhouse holds the
plugin's wheel, DeepSpeed built as a wheel without its ops (``DS_BUILD_OPS=0``: they compile on first
use, as on this machine), and the binary wheels of every other distribution the plugin needs at run
time for Linux x86-64 and each Python asked for -- the dependency closure of ``moe_plugin``,
``deepspeed`` and ``megatron-core`` read from this environment's metadata, at the versions installed
here (the ones the tests ran with), minus torch and what torch itself needs (the image has them:
``filelock``, ``typing-extensions``, ``sympy``, ``networkx``, ``jinja2``, ``fsspec``, ``setuptools``,
the NVIDIA libraries, triton) and minus the optional extras (plots, Hugging Face, tests).
``requirements.txt`` pins them by name (pip picks each Python's wheel from the folder);
``install_wheels.sh`` installs them with ``pip install --no-index --no-deps --target`` into a folder
of its own, never over the image's torch. The sizes are printed, the largest first.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Optional, Sequence

ROOTS = ("moe_plugin", "deepspeed", "megatron-core")
BUILT = ("moe_plugin", "deepspeed")   # built here: the plugin from this tree, DeepSpeed from its sdist, without ops
# the distributions a CUDA torch comes with (torch's own requirements, and what they need)
WITH_TORCH = ("torch", "triton")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64")
REPO = Path(__file__).resolve().parents[1]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements_of(name: str) -> list[str]:
    """The distributions ``name`` requires (no extras, markers for this Linux x86-64 Python)."""
    from packaging.requirements import Requirement

    out = []
    for text in metadata.requires(name) or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        out.append(canonical(req.name))
    return out


def closure(roots: Sequence[str] = ROOTS) -> dict[str, str]:
    """{distribution: installed version} of everything ``roots`` need, torch's part left out."""
    skip = set()
    stack = list(WITH_TORCH)
    while stack:   # torch and all it needs: the image's
        name = stack.pop()
        if name in skip:
            continue
        skip.add(name)
        try:
            stack += requirements_of(name)
        except metadata.PackageNotFoundError:
            continue
    found: dict[str, str] = {}
    stack = [canonical(r) for r in roots]
    while stack:
        name = stack.pop()
        if name in found or name in skip or name.startswith("nvidia-"):
            continue
        found[name] = metadata.version(name)
        stack += requirements_of(name)
    return found


def build(out: Path, pythons: Sequence[str], skip: Sequence[str] = (), say=print) -> list[Path]:
    """Write the wheelhouse into ``out`` (created; wheels there are replaced); its wheel files. ``skip``:
    distributions the target has already (numpy, in most CUDA images)."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    wanted = {n: v for n, v in closure().items() if n not in {canonical(s) for s in skip}}
    pip = [sys.executable, "-m", "pip"]
    say(f"wheelhouse: {len(wanted)} distributions for Python {', '.join(pythons)}: "
        + ", ".join(f"{n}=={v}" for n, v in sorted(wanted.items())))
    _run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO)], say,
         "the plugin's wheel")
    with tempfile.TemporaryDirectory() as tmp:   # DeepSpeed's sdist built without ops (pure Python)
        _run([*pip, "wheel", "-q", "--no-deps", "--no-binary", "deepspeed", "-w", tmp,
              f"deepspeed=={wanted['deepspeed']}"], say, "DeepSpeed's wheel, without ops",
             env={**os.environ, "DS_BUILD_OPS": "0"})
        for wheel in Path(tmp).glob("*.whl"):
            shutil.move(str(wheel), out / wheel.name)
    binaries = [f"{n}=={v}" for n, v in sorted(wanted.items()) if n not in [canonical(b) for b in BUILT]]
    for python in pythons:
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        _run([*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", python,
              "--implementation", "cp", *platforms, "-d", str(out), *binaries], say,
             f"{len(binaries)} wheels for Python {python}")
    (out / "requirements.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(wanted.items())))
    wheels = sorted(out.glob("*.whl"), key=lambda p: -p.stat().st_size)
    total = sum(p.stat().st_size for p in wheels)
    for wheel in wheels:
        say(f"  {wheel.stat().st_size / 1e6:7.2f} MB  {wheel.name}")
    say(f"wheelhouse: {len(wheels)} wheels, {total / 1e6:.1f} MB in {out} (no torch, no NVIDIA library); "
        f"install: examples/gpt_moe/install_wheels.sh {out} SITE")
    return wheels


def _run(argv: list[str], say, what: str, env: Optional[dict] = None) -> None:
    say(f"wheelhouse: {what}")
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: wheelhouse: {what} failed ({' '.join(argv[:6])} ...):\n"
                         f"{(done.stderr or done.stdout)[-3000:]}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("wheelhouse"))
    parser.add_argument("--python", default="3.11,3.12", help="the Python versions to download binary wheels for")
    parser.add_argument("--skip", default="", help="distributions the target has already, e.g. numpy (CUDA images "
                        "ship it; a bare venv with torch does not)")
    args = parser.parse_args(argv)
    build(args.out, [p.strip() for p in args.python.split(",") if p.strip()],
          [s.strip() for s in args.skip.split(",") if s.strip()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
