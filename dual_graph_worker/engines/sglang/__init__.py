"""SGLang 0.5.17 integration: the dual-graph EAGLE-3 worker as an SGLang plugin.

SGLang finds it through the entry-point group ``sglang.srt.plugins`` (pyproject.toml); a server
selects it with ``--speculative-algorithm DUAL_GRAPH_EAGLE3`` and an EAGLE-3 draft (README.md).
Worker settings come from ``DGW_*`` variables or the ``DGW_CONFIG`` file (docs/settings.md).
The engine-agnostic modules (backlog, catch_up, layout, stash_room, ...) import no SGLang and are
unit-tested on CPU. docs/sglang-0.5.17.md lists the SGLang contracts each module relies on.
"""
