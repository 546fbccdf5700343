"""A generated corpus of tampered inputs (issue 42, item 4), run through the commands a user runs.

The cases are generated from the inputs themselves, so a new file kind or config key is covered
without a new test: every file kind of an imported tiny Mixtral's checkpoint (its metadata, its
``latest``, DeepSpeed's module file, the dense and an expert safetensors file, a tokenizer copy) and
of the Hugging Face directory it came from, each truncated to half, emptied, and overwritten with
random bytes of its size (the checkpoint's recorded checksum updated, as a tamperer would, so the
file's reader is what must refuse it), through ``moe-plugin export`` and ``export-hf`` (the
checkpoint) or ``import-hf`` (the directory); and every number of ``config.json`` set to -1, 10**12
and a string, through ``import-hf``. The path cases (links, ``..``, absolute names) are
``test_confinement.py``'s; the checked values, ``test_untrusted_configs.py``'s and
``test_tensor_claims.py``'s.

Each case runs in a child forked from the test (``os.wait4`` gives the child's own peak RSS) and must
hold: no traceback; status 0 or 2, and 2 where the command reads the file; then one ``error:`` line
naming a file of the input and no output left; the input unchanged; the sentinel directory beside it
unchanged; the child's peak RSS within 512 MiB of the test process's size at the fork.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from pathlib import Path

import pytest

from commands import snapshot

pytestmark = pytest.mark.slow   # ~100 forked commands

TAG = "step0"
PEAK_GROWTH = 512 << 20
TAMPERINGS = ("half", "empty", "garbage")
# checkpoint file kinds -> the commands that must refuse them tampered (export-hf copies tokenizer files
# byte for byte, as their checksum matches: accepting them is right)
CKPT_KINDS = {"moe_plugin.json": {"export", "export-hf"}, "latest": {"export", "export-hf"},
              "mp_rank_00_model_states.pt": {"export", "export-hf"},
              "model/dense_pp_00_tp_00.safetensors": {"export", "export-hf"},
              "experts/expert_00005_pp_00.safetensors": {"export", "export-hf"},
              "hf/tokenizer_config.json": set()}
HF_KINDS = {"config.json": True, "model.safetensors": True, "tokenizer.json": False,
            "tokenizer_config.json": False, "generation_config.json": False}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from hf_tiny import import_tiny

    return import_tiny(tmp_path_factory.mktemp("corpus"))


def _tamper(path: Path, how: str, seed: str) -> None:
    data = path.read_bytes()
    if how == "half":
        data = data[:len(data) // 2]
    elif how == "empty":
        data = b""
    else:
        data = random.Random(seed).randbytes(len(data))
    path.write_bytes(data)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _log_to_stderr() -> None:
    """In the forked child, every logging handler that wrote to a stream writes to the new stderr (the
    test's capture streams are the parent's: a write there fails as a "Logging error")."""
    import logging
    import sys

    logging.raiseExceptions = False   # a handler this misses fails silently, not with a "Logging error" traceback
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in logging.root.manager.loggerDict)]
    for logger in loggers:
        for handler in list(getattr(logger, "handlers", [])):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                handler.stream = sys.stderr   # not setStream: it flushes the old stream, which may be closed


def _forked(argv: list, log: Path) -> tuple[int, str, int]:
    """``moe-plugin ARGV`` in a forked child: (status, what it printed, its peak RSS growth in bytes)."""
    import sys

    base = _rss()
    pid = os.fork()
    if pid == 0:   # the child: the command, its output into `log`, its status as the exit code
        status = 70
        try:
            import torch

            torch.set_num_threads(1)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = os.fdopen(1, "w", buffering=1)
            sys.stderr = os.fdopen(2, "w", buffering=1)
            _log_to_stderr()
            from moe_plugin_tools.cli import main

            try:
                status = main([str(a) for a in argv])
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(status)
    _pid, code, usage = os.wait4(pid, 0)
    return os.waitstatus_to_exitcode(code), log.read_text(errors="replace"), usage.ru_maxrss * 1024 - base


def _check(tmp_path: Path, argv: list, inputs: Path, must_refuse: bool, case: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "secret.txt").write_text("the sentinel")
    before, sentinel = snapshot(inputs), snapshot(outside)
    status, printed, growth = _forked(argv, tmp_path / "printed.txt")
    assert "Traceback" not in printed, (case, printed[-3000:])
    assert status in ((2,) if must_refuse else (0, 2)), (case, status, printed[-2000:])
    if status == 2:
        lines = [line for line in printed.splitlines() if line.startswith("error: ")]
        assert len(lines) == 1 and str(inputs) in lines[0], (case, printed[-2000:])
        assert not (tmp_path / "out").exists() and not any(p.startswith(".tmp-") for p in os.listdir(tmp_path)), case
    assert snapshot(inputs) == before and snapshot(outside) == sentinel, case
    assert growth < PEAK_GROWTH, (case, f"peak RSS grew by {growth / 2 ** 20:.0f} MiB")


def _fresh(tmp_path: Path) -> None:
    for name in ("out", "outside", "printed.txt"):
        path = tmp_path / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


@pytest.mark.parametrize("kind", sorted(CKPT_KINDS))
def test_every_file_kind_of_a_checkpoint_tampered(sources, tmp_path, kind):
    from moe_plugin.checkpoint.files import file_digest

    for how in TAMPERINGS:
        for command in ("export", "export-hf"):
            ckpt = tmp_path / "ckpt"
            shutil.rmtree(ckpt, ignore_errors=True)
            shutil.copytree(sources["ckpt"], ckpt)
            _fresh(tmp_path)
            path = ckpt / kind if kind == "latest" else ckpt / TAG / kind
            _tamper(path, how, f"{kind}-{how}")
            meta_path = ckpt / TAG / "moe_plugin.json"
            if kind not in ("latest", "moe_plugin.json"):
                meta = json.loads(meta_path.read_text())
                meta["files"][kind] = file_digest(str(path))
                meta_path.write_text(json.dumps(meta))
            _check(tmp_path, [command, ckpt, "--out", tmp_path / "out"], ckpt, command in CKPT_KINDS[kind],
                   f"{kind} {how} {command}")


@pytest.mark.parametrize("kind", sorted(HF_KINDS))
def test_every_file_kind_of_an_hf_directory_tampered(sources, tmp_path, kind):
    for how in TAMPERINGS:
        hf = tmp_path / "hf"
        shutil.rmtree(hf, ignore_errors=True)
        shutil.copytree(sources["hf"], hf)
        _fresh(tmp_path)
        _tamper(hf / kind, how, f"{kind}-{how}")
        _check(tmp_path, ["import-hf", hf, "--config", sources["config"], "--out", tmp_path / "out"], hf,
               HF_KINDS[kind], f"{kind} {how}")


def _numbers(config: dict) -> list[str]:
    return sorted(k for k, v in config.items() if isinstance(v, (int, float)) and not isinstance(v, bool))


# the sizes the weights' shapes follow: each of these values must be refused (10**12: no tensor has it)
SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
         "num_local_experts", "num_experts_per_tok", "vocab_size")


def test_every_number_of_config_json_out_of_range(sources, tmp_path):
    """-1, 10**12 and a string for each number: refused in one line or imported, never more; refused
    for each size the weights' shapes follow, and for an epsilon of -1 or a string."""
    config = json.loads((sources["hf"] / "config.json").read_text())
    assert len(_numbers(config)) >= 12 and set(SIZES) <= set(_numbers(config)), _numbers(config)
    for key in _numbers(config):
        for value in (-1, 10 ** 12, str(config[key])):
            must = key in SIZES or (key == "rms_norm_eps" and value != 10 ** 12)
            hf = tmp_path / "hf"
            shutil.rmtree(hf, ignore_errors=True)
            shutil.copytree(sources["hf"], hf)
            _fresh(tmp_path)
            (hf / "config.json").write_text(json.dumps({**config, key: value}))
            _check(tmp_path, ["import-hf", hf, "--config", sources["config"], "--out", tmp_path / "out"], hf,
                   must, f"{key}={value!r}")
            shutil.rmtree(tmp_path / "out", ignore_errors=True)
