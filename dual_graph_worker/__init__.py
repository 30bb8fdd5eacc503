"""dual-graph-worker: speculative decoding that is fast at every load.

Two CUDA graph pools (speculative: draft chain, verify, draft extend; plain: decode) captured at
start-up into one graph memory pool, sharing static inputs sized for both. A mode switch is a
table lookup; the "off" mode replays exactly the graph a plain server replays.
"""

from dual_graph_worker.core.errors import DualGraphError
from dual_graph_worker.core.modes import GraphKey, Mode

__all__ = ["DualGraphError", "GraphKey", "Mode"]
__version__ = "0.1.0"
