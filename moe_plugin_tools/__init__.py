"""Tools around the runtime: the ``moe-plugin`` command (``cli``; ``plan_args``: the ``plan`` command's
flags; ``layout_views``: the layout as text), benchmarks (``bench``), run reports (``report``) and the
renderer of docs/config.md (``config_docs``). They import ``moe_plugin``; ``moe_plugin`` never imports them."""
