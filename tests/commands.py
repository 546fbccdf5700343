"""``moe-plugin`` as a user runs it, in the test's process: its status and what it printed; and what a
directory holds, to show a command left it (or a sentinel beside it) unchanged.

    status, printed = cli(capsys, ["export", ckpt, "--out", out])
    before = snapshot(ckpt); ...; assert snapshot(ckpt) == before
"""
from __future__ import annotations

import hashlib
import os


def cli(capsys, argv: list) -> tuple[int, str]:
    from moe_plugin_tools.cli import main

    try:
        status = main([str(a) for a in argv])
    except SystemExit as exc:
        status = exc.code
    captured = capsys.readouterr()
    return status, captured.out + captured.err


def snapshot(root) -> dict:
    """{relative path: what it is} of everything under ``root``, links not followed."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                out[rel] = ("dir",)
            else:
                with open(path, "rb") as f:
                    out[rel] = ("file", hashlib.sha256(f.read()).hexdigest())
    return out
