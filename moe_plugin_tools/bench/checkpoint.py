"""The ``bench checkpoint`` command (``run``): the model conversions' time, peak memory and bytes,
each run as a user runs it, at one or more model sizes.

For each ``--layers`` value this writes a Mixtral-shaped Hugging Face model directory (bf16, tensor
by tensor: ``hf_model.py``), then runs, each in a child process of its own,

    python -m moe_plugin_tools.cli import-hf HF --config ds.json --out CKPT   # ds.json: EP 2, micro-batch 1
    python -m moe_plugin_tools.cli export-hf CKPT --out HF_OUT
    python -m moe_plugin_tools.cli export CKPT --out EXPORT

and reports per step: wall seconds of the child (its interpreter start and imports included),
the time the command reports itself where it prints one ("... in X s": import-hf, export-hf),
"start s": the same command's wall seconds on a model of one layer, hidden 64 (``start_seconds``, once
per bench: the interpreter, the imports, planning), its peak RSS (``ru_maxrss`` read by a wrapper
around that one command), the bytes of its input and output directories, and two floors for moving
them: the mean time of copying the input and the output into a scratch directory with ``cp -r``
("cp s": the kernel copies, ``copy_file_range``) and with ``dd bs=8M`` ("dd s": through a buffer
in the process, as any program that makes the bytes it writes). The ratios: time / cp, and the
bytes' own time (seconds less start s) over cp and over dd. MB are 10^6 bytes. The page cache is
left warm: the input was just written. Each measured command and each copy starts after ``settle``
(``sync``, then ``--settle`` seconds idle, 3 by default), so that neither the write-back of bytes
an earlier step wrote nor pages it just freed land in its time: all are timed from the same state.
export-hf and export read the checkpoint import-hf wrote; without ``import-hf`` in ``--steps`` it
is still run, not reported. The steps load and save are one run of the example on 2 ranks
(``train_rows``: ``--load`` the import, 2 steps, ``--save``): their own seconds as the example prints
them, the bytes read or written, and the run's peak RSS (busiest rank) beside the run summary's
estimate (``estimate_mb`` in the JSON rows). Models and outputs live under ``--work`` (default: a temporary
directory) and are removed when done unless ``--keep``. Progress goes to stderr (the commands' own
progress lines included), the table (or one JSON object per row with ``--json``, with the exact
bytes too) to stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from moe_plugin.configs import ConfigError
from moe_plugin_tools.bench.args import CHECKPOINT_STEPS
from moe_plugin_tools.bench.hf_model import HFShape, Measured, param_count, run_measured, write_hf_model

EXPERT_PARALLEL = 2
DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "moe": {"parallel": {"expert": EXPERT_PARALLEL}}}
SELF_TIMED = re.compile(r" in (\d+(?:\.\d+)?) s$")   # import-hf's and export-hf's last line
LOADED = re.compile(r"^loaded .* in (\d+(?:\.\d+)?) s$")   # the example's lines
SAVED = re.compile(r"^saved checkpoint step\d+ to .* in (\d+(?:\.\d+)?) s$")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt_moe" / "pretrain_gpt_moe.py"
TRAIN_RANKS = EXPERT_PARALLEL
EXAMPLE_VOCAB = 384
TRAIN_CONFIG = {"train_batch_size": TRAIN_RANKS, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10 ** 6,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 1}}
MB = 1e6
SIZE_FLAGS = {"--hidden": "hidden", "--heads": "heads", "--kv-heads": "kv_heads", "--experts": "experts",
              "--ffn": "ffn", "--vocab": "vocab"}
# (header, record key, format) of the table's columns
COLUMNS = (("layers", "layers", "{}"), ("params", "params", None), ("step", "step", "{}"),
           ("seconds", "seconds", "{:.2f}"), ("own s", "own_seconds", "{:.2f}"), ("start s", "start_seconds", "{:.2f}"),
           ("peak RSS MB", "peak_rss_mb", "{:.0f}"), ("MB in", "mb_in", "{:.1f}"), ("MB out", "mb_out", "{:.1f}"),
           ("cp s", "cp_seconds", "{:.2f}"), ("dd s", "dd_seconds", "{:.2f}"), ("time / cp", "time_over_cp", "{:.1f}"),
           ("bytes / cp", "bytes_over_cp", "{:.1f}"), ("bytes / dd", "bytes_over_dd", "{:.1f}"))
CONVERSIONS = CHECKPOINT_STEPS[:3]   # import-hf, export-hf, export
START_SHAPE = HFShape(hidden=64, heads=4, kv_heads=2, experts=2, ffn=128)


@dataclass(frozen=True)
class Settings:
    layers: tuple[int, ...]
    shape: HFShape
    steps: tuple[str, ...]
    work: Optional[Path]
    keep: bool
    settle: float   # seconds idle after sync before each measurement (``settle``; --settle)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The flags, checked: every refusal (one line naming the flag) comes before any work."""
    layers = tuple(_positive_list("--layers", args.layers))
    if len(set(layers)) != len(layers):
        raise ConfigError("--layers", args.layers, "expected distinct layer counts")
    sizes = {}
    for flag, name in SIZE_FLAGS.items():
        value = getattr(args, name)
        if value < 1:
            raise ConfigError(flag, value, "expected a positive integer")
        sizes[name] = value
    shape = HFShape(**sizes)
    if shape.hidden % shape.heads:
        raise ConfigError("--heads", shape.heads, f"must divide --hidden ({shape.hidden})")
    if shape.heads % shape.kv_heads:
        raise ConfigError("--kv-heads", shape.kv_heads, f"must divide --heads ({shape.heads})")
    if shape.experts % EXPERT_PARALLEL:
        raise ConfigError("--experts", shape.experts, f"must be a multiple of {EXPERT_PARALLEL} (the expert-parallel "
                          "size of the bench's DeepSpeed config)")
    names = [s.strip() for s in args.steps.split(",") if s.strip()]
    bad = [s for s in names if s not in CHECKPOINT_STEPS]
    if not names or bad or len(set(names)) != len(names):
        raise ConfigError("--steps", args.steps, "expected distinct comma-separated steps of "
                          + ", ".join(CHECKPOINT_STEPS))
    steps = tuple(s for s in CHECKPOINT_STEPS if s in names)
    if {"load", "save"} & set(steps) and shape.vocab != EXAMPLE_VOCAB:
        raise ConfigError("--vocab", shape.vocab, f"the load and save steps train the example on its byte-level corpus, "
                          f"whose vocabulary is {EXAMPLE_VOCAB} (257 padded to a multiple of 128); leave them out "
                          "of --steps for another vocabulary")
    if args.work is not None:
        taken = [str(args.work / _size_dir(n)) for n in layers if (args.work / _size_dir(n)).exists()]
        if taken:
            raise ConfigError("--work", str(args.work), f"already holds {', '.join(taken)}; remove it or name "
                              "another directory")
    if not args.settle >= 0:
        raise ConfigError("--settle", args.settle, "expected seconds >= 0")
    return Settings(layers=layers, shape=shape, steps=steps, work=args.work, keep=args.keep, settle=args.settle)


def run(args: argparse.Namespace) -> None:
    """The ``bench checkpoint`` command: a table (or one JSON object per row) on stdout."""
    settings = settings_from_args(args)
    s = settings.shape
    root = settings.work if settings.work is not None else Path(tempfile.mkdtemp(prefix="moe_bench_checkpoint_"))
    root.mkdir(parents=True, exist_ok=True)
    say(f"bench checkpoint: Mixtral, hidden {s.hidden}, {s.heads} heads ({s.kv_heads} kv), {s.experts} experts of "
        f"ffn {s.ffn}, vocab {s.vocab}; layers {', '.join(map(str, settings.layers))}; steps "
        f"{', '.join(settings.steps)}; in {root}")
    rows = []
    began = time.perf_counter()
    try:
        start = start_seconds(root / "start", settings) if set(CONVERSIONS) & set(settings.steps) else {}
        for layers in settings.layers:
            directory = root / _size_dir(layers)
            try:
                for row in bench_size(directory, layers, settings, start):
                    rows.append(row)
                    if args.json:
                        print(json.dumps(row), flush=True)
            finally:
                if not settings.keep:
                    shutil.rmtree(directory, ignore_errors=True)
    finally:
        if settings.work is None and not settings.keep:
            shutil.rmtree(root, ignore_errors=True)
    say(f"done in {time.perf_counter() - began:.0f} s" + (f"; kept {root}" if settings.keep else ""))
    if not args.json:
        print(table(rows), flush=True)


def start_seconds(directory: Path, settings: Settings) -> dict[str, float]:
    """Each conversion of ``settings.steps``' wall seconds on a model of a few hundred KB (``START_SHAPE``, one
    layer): the interpreter, the imports, reading the configs, planning the files. A step's ``seconds`` less
    this is what its bytes cost."""
    say("start costs: each conversion on a model of one layer, hidden 64 (its bytes cost next to nothing)")
    out = {}
    try:
        for step, _source, _out, done in _conversions(directory, 1, START_SHAPE, settings.steps, False,
                                                      settings.settle):
            out[step] = done.seconds
            say(f"    {step}: {done.seconds:.2f} s")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return out


def bench_size(directory: Path, layers: int, settings: Settings, start: dict[str, float]) -> list[dict]:
    """Write the model of ``layers`` layers under ``directory`` and measure each step on it."""
    shape = settings.shape
    params = param_count("mixtral", layers, shape)
    tag = f"[{layers} layer{'s' if layers != 1 else ''}]"
    record = {"layers": layers, "params": params, "hidden": shape.hidden, "heads": shape.heads,
              "kv_heads": shape.kv_heads, "experts": shape.experts, "ffn": shape.ffn, "vocab": shape.vocab}
    rows = []
    imported: tuple[str, ...] = ()
    for step, source, out, done in _conversions(directory, layers, shape, settings.steps, settings.keep,
                                                    settings.settle, tag):
        if step == "import-hf":
            imported = done.lines
        if step not in settings.steps:
            continue
        own = [float(m.group(1)) for m in map(SELF_TIMED.search, done.lines) if m]
        bytes_in, bytes_out = _bytes(source), _bytes(out)
        copy = copy_seconds([source, out], directory / "scratch", "cp", settings.settle)
        user = copy_seconds([source, out], directory / "scratch", "dd", settings.settle)
        moving = done.seconds - start[step]
        row = {**record, "step": step, "seconds": round(done.seconds, 3), "own_seconds": own[-1] if own else None,
               "start_seconds": round(start[step], 3),
               "peak_rss_mb": round(done.peak_bytes / MB, 1), "mb_in": round(bytes_in / MB, 1),
               "mb_out": round(bytes_out / MB, 1), "bytes_in": bytes_in, "bytes_out": bytes_out,
               "cp_seconds": round(copy, 3), "dd_seconds": round(user, 3),
               "time_over_cp": round(done.seconds / copy, 2), "bytes_over_cp": round(moving / copy, 2),
               "bytes_over_dd": round(moving / user, 2)}
        say(f"{tag} {step}: {done.seconds:.1f} s ({start[step]:.1f} s of it the start), peak RSS "
            f"{row['peak_rss_mb']:.0f} MB, {bytes_in / MB:.4g} MB in, {bytes_out / MB:.4g} MB out; copying them: "
            f"cp {copy:.2f} s, dd {user:.2f} s")
        rows.append(row)
    if {"load", "save"} & set(settings.steps):
        rows += train_rows(directory, tag, record, directory / "ckpt", imported, settings)
    return rows


def _conversions(directory: Path, layers: int, shape: HFShape, steps: tuple[str, ...], keep: bool, pause: float,
                 tag: str = "") -> Iterator[tuple[str, Path, Path, Measured]]:
    """Write a Mixtral-shaped model of ``layers`` layers under ``directory``, then run import-hf (always: the
    other steps read its checkpoint) and each conversion of ``steps``, each in a child after ``settle(pause)``: yields
    (step, its input, its output, ``Measured``) while the output is still there (removed after, but for the
    import's and under ``keep``)."""
    params = param_count("mixtral", layers, shape)
    if tag:
        say(f"{tag} writing a {_count(params)}-parameter Hugging Face model ({2 * params / MB:.4g} MB in bf16)")
    began = time.perf_counter()
    write_hf_model("mixtral", directory / "hf", layers, shape)
    if tag:
        say(f"{tag} written in {time.perf_counter() - began:.1f} s")
    ds_config = directory / "ds.json"
    ds_config.write_text(json.dumps(DS_CONFIG))
    hf, ckpt, hf_out, export = (directory / name for name in ("hf", "ckpt", "hf-out", "export"))
    commands = {"import-hf": (hf, ckpt, ["import-hf", str(hf), "--config", str(ds_config), "--out", str(ckpt)]),
                "export-hf": (ckpt, hf_out, ["export-hf", str(ckpt), "--out", str(hf_out)]),
                "export": (ckpt, export, ["export", str(ckpt), "--out", str(export)])}
    for step, (source, out, argv) in commands.items():
        if step not in steps and step != "import-hf":
            continue
        if tag:
            say(f"{tag} {step}" + ("" if step in steps else " (not measured: the other steps read its checkpoint)"))
        settle(pause)
        done = run_measured([sys.executable, "-m", "moe_plugin_tools.cli", *argv],
                            on_line=_progress if tag else None)
        yield step, source, out, done
        if step != "import-hf" and not keep:
            shutil.rmtree(out)


def train_rows(directory: Path, tag: str, record: dict, ckpt: Path, imported: tuple[str, ...],
               settings: Settings) -> list[dict]:
    """The example on ``TRAIN_RANKS`` ranks under the ``deepspeed`` launcher: ``--load`` the imported
    checkpoint, two steps (the first allocates Adam's moments after its gradients are gone, the
    second holds both: a run's peak), ``--save``. Rows "load" and "save": each one's own seconds (the example's
    "loaded ... in X s" and "saved checkpoint ... in X s"), the bytes read or written, cp of them,
    and the busiest rank's peak RSS over the whole run (its ``memory.json``, the run summary's
    estimate beside it)."""
    flags, moe = _training_flags(imported)
    config = directory / "train.json"
    config.write_text(json.dumps({**TRAIN_CONFIG, "moe": moe}))
    save, run_dir = directory / "save", directory / "run"
    argv = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(TRAIN_RANKS), "--master_port",
            str(_free_port()), str(EXAMPLE), "--deepspeed_config", str(config), *flags, "--load", str(ckpt),
            "--seq-length", "64", "--train-iters", "2", "--eval-interval", "0", "--no-plot", "--save", str(save),
            "--run-dir", str(run_dir), "--data-cache", str(directory / "data"), "--corpus-bytes", str(192 * 1024),
            "--valid-fraction", "0.25"]
    say(f"{tag} load + 2 steps + save: the example on {TRAIN_RANKS} ranks")
    done = run_measured(argv, on_line=_progress)
    memory = json.loads((run_dir / "memory.json").read_text())
    peak = max(memory["peak_memory_mb"]) * 2 ** 20 / MB   # MiB -> MB
    own = {name: [float(m.group(1)) for m in map(pattern.search, done.lines) if m]
           for name, pattern in (("load", LOADED), ("save", SAVED))}
    rows = []
    for step, path in (("load", ckpt), ("save", save)):
        if step not in settings.steps:
            continue
        size = _bytes(path)
        copy = copy_seconds([path], directory / "scratch", "cp", settings.settle)
        seconds = own[step][-1] if own[step] else None
        rows.append({**record, "step": step, "seconds": round(done.seconds, 3), "own_seconds": seconds,
                     "peak_rss_mb": round(peak, 1), "estimate_mb": round(memory["estimate_mb"] * 2 ** 20 / MB, 1),
                     "mb_in": round(size / MB, 1) if step == "load" else 0.0,
                     "mb_out": round(size / MB, 1) if step == "save" else 0.0,
                     "bytes_in": size if step == "load" else 0, "bytes_out": size if step == "save" else 0,
                     "cp_seconds": round(copy, 3),
                     "time_over_cp": round(seconds / copy, 2) if seconds is not None else None})
        say(f"{tag} {step}: {seconds} s of a {done.seconds:.1f} s run, peak RSS {peak:.0f} MB (estimate "
            f"{rows[-1]['estimate_mb']:.0f} MB), {size / MB:.4g} MB; cp -r {copy:.2f} s")
    if not settings.keep:
        shutil.rmtree(save, ignore_errors=True)
    return rows


def _training_flags(lines: tuple[str, ...]) -> tuple[list[str], dict]:
    """The example's model flags and the "moe" block import-hf printed (without its ``--load``)."""
    flags = next((line.split() for line in lines if line.strip().startswith("--load ")), None)
    block = next((line.strip() for line in lines if line.strip().startswith('"moe": {')), None)
    if flags is None or block is None:
        raise RuntimeError("import-hf did not print the example's flags and the \"moe\" block to train with")
    return flags[2:], json.loads("{" + block + "}")["moe"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def copy_seconds(paths: list[Path], scratch: Path, tool: str, pause: float) -> float:
    """The mean seconds of copying each of ``paths`` into ``scratch`` (removed after each), each after ``settle``:
    with ``cp -r`` ("cp", which copies inside the kernel: ``copy_file_range``) or file by file with
    ``dd bs=8M`` ("dd": through a buffer of its own, as any program that makes the bytes it writes). The mean
    of the input's and the output's copy is the cost of moving the step's bytes once."""
    scratch.mkdir()
    total = 0.0
    try:
        for path in paths:
            copy = scratch / path.name
            settle(pause)
            began = time.perf_counter()
            if tool == "cp":
                subprocess.run(["cp", "-r", str(path), str(copy)], check=True)
            else:
                for file in sorted(p for p in path.rglob("*") if p.is_file()):
                    target = copy / file.relative_to(path)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    subprocess.run(["dd", f"if={file}", f"of={target}", "bs=8M", "status=none"], check=True)
            total += time.perf_counter() - began
            shutil.rmtree(copy)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return total / len(paths)


def settle(seconds: float) -> None:
    """``sync``, then ``seconds`` idle (``--settle``): the write-back of what an earlier step wrote is done, and
    the memory it freed is handed back, so every measured command and copy starts from the same state. On a
    VM that reports free pages to its host (this machine), the first touch of a page after that costs as on a
    fresh start: writing 700 MB to a new file from a process's buffer ran at 0.40 GB/s after 5 s idle and at
    2.8-5.5 GB/s right after other pages were freed (2026-11-28)."""
    os.sync()
    time.sleep(seconds)


def table(rows: list[dict]) -> str:
    """The rows as a text table, one line per size and step."""
    def cell(row: dict, key: str, form: Optional[str]) -> str:
        value = row.get(key)
        if value is None:
            return "-"
        return _count(value) if form is None else form.format(value)

    lines = [[header for header, _, _ in COLUMNS]] + [[cell(r, key, form) for _, key, form in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) if i == 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     .rstrip() for line in lines)


def say(line: str) -> None:
    """A progress line, on stderr."""
    print(line, file=sys.stderr, flush=True)


def _progress(line: str) -> None:
    """A command's own progress line, passed on (its indented notes, e.g. import-hf's flags, left out)."""
    if line and not line[0].isspace():
        say(f"    {line}")


def _count(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def _size_dir(layers: int) -> str:
    return f"layers{layers}"


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _positive_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(flag, text, "expected comma-separated positive integers")
    return values
