"""A runner attribute SGLang's constructor assigns but this plugin decides.

SGLang's graph runners derive their batch list and per-request width inside ``__init__`` and
capture right there (decode_cuda_graph_runner.py, eagle_draft_extend_cuda_graph_runner.py), so a
subclass cannot set its own values afterwards. A ``Pinned`` class attribute is a data descriptor:
reads return what the subclass decides, SGLang's assignment is ignored, and everything the
constructor sizes from the attribute (buffers, backend state, the capture loop) sees our value.
"""

from __future__ import annotations

from typing import Any, Callable


class Pinned:
    def __init__(self, read: Callable[[Any], Any]) -> None:
        self._read = read

    def __get__(self, obj: Any, owner: type) -> Any:
        return self if obj is None else self._read(obj)

    def __set__(self, obj: Any, _sglang_value: Any) -> None:
        pass
