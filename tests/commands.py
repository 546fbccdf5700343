"""``moe-plugin`` as a user runs it, in the test's process: its status and what it printed.

    status, printed = cli(capsys, ["export", ckpt, "--out", out])
"""
from __future__ import annotations


def cli(capsys, argv: list) -> tuple[int, str]:
    from moe_plugin_tools.cli import main

    try:
        status = main([str(a) for a in argv])
    except SystemExit as exc:
        status = exc.code
    captured = capsys.readouterr()
    return status, captured.out + captured.err
