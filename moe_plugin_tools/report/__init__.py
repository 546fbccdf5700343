"""``moe-plugin report``: read the run directories of the GPT-MoE example, write tables and plots.

``rundir`` reads and checks one run directory, ``params`` counts parameters from its flags,
``summary`` turns a run into one row of numbers, ``markdown`` writes ``report.md`` and ``plots``
the PNGs. ``write_report`` ties them together.
"""
from moe_plugin_tools.report.params import ParamCount, count_params
from moe_plugin_tools.report.rundir import Run, RunDirError, read_run
from moe_plugin_tools.report.summary import RunSummary, summarize
from moe_plugin_tools.report.write import write_report

__all__ = ["ParamCount", "Run", "RunDirError", "RunSummary", "count_params", "read_run", "summarize",
           "write_report"]
