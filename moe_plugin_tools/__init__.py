"""Tools around the runtime: the ``moe-plugin`` command (``cli``), benchmarks (``bench``) and run
reports (``report``). They import ``moe_plugin``; ``moe_plugin`` never imports them."""
