"""CUDA API names: normalization and the classes the checks care about.

nsys spells runtime calls with a version suffix (`cudaGraphLaunch_v10000`,
`cudaLaunchKernel_ptsz_v7000` for per-thread default streams) and driver calls without the
`cuda` prefix (`cuGraphLaunch`, `cuMemAlloc_v2`); torch.profiler spells them bare. Checks
compare `base_name`s only.
"""

from __future__ import annotations

import functools

import re
from typing import Optional

_VERSION_SUFFIX = re.compile(r"(?:_v\d+)+$")
_STREAM_SUFFIX = re.compile(r"_(?:ptsz|ptds)$")

GRAPH_LAUNCH = frozenset({"cudaGraphLaunch", "cuGraphLaunch"})

KERNEL_LAUNCH = frozenset({
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel",
    "cudaLaunchCooperativeKernelMultiDevice",
    "cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel",
    "cuLaunchCooperativeKernelMultiDevice",
})

# Non-blocking status polls. How many a step makes depends on how long the host keeps asking
# (PyTorch's caching allocator queries the events of blocks freed across streams; SGLang's
# overlap scheduler polls copy-done events), not on the work it submits: they launch nothing,
# allocate nothing and wait for nothing, so the switch check reports them but does not count
# them as added calls.
POLLING = frozenset({"cudaEventQuery", "cuEventQuery", "cudaStreamQuery", "cuStreamQuery"})

# An event pool's growth: PyTorch's caching allocators create an event when more of their blocks
# are in flight than ever before, wherever that happens to be. Microseconds, and once; the switch
# check reports a lone one among many compared switches rather than count it as a switch's cost.
POOL_GROWTH = frozenset({"cudaEventCreate", "cudaEventCreateWithFlags", "cuEventCreate"})

# Base-name prefixes that must not occur in steady state, by what they cost.
# Prefixes, because each family has variants (cudaGraphInstantiateWithFlags, cudaMallocAsync,
# cuMemAllocFromPoolAsync, cudaStreamBeginCaptureToGraph, ...).
FORBIDDEN_PREFIXES: tuple[tuple[str, str], ...] = (
    ("cudaStreamBeginCapture", "capture"),
    ("cudaStreamEndCapture", "capture"),
    ("cuStreamBeginCapture", "capture"),
    ("cuStreamEndCapture", "capture"),
    ("cudaGraphInstantiate", "instantiate"),
    ("cuGraphInstantiate", "instantiate"),
    # Updating an executable graph is re-instantiation in all but name.
    ("cudaGraphExecUpdate", "instantiate"),
    ("cuGraphExecUpdate", "instantiate"),
    ("cudaMalloc", "allocation"),
    ("cudaHostAlloc", "allocation"),
    ("cuMemAlloc", "allocation"),
    ("cuMemHostAlloc", "allocation"),
    # Virtual-memory allocation (PyTorch expandable segments grow through it).
    ("cuMemCreate", "allocation"),
)


@functools.lru_cache(maxsize=1024)   # a trace repeats a few dozen names ~1e5 times
def base_name(raw: str) -> str:
    """`cudaLaunchKernel_ptsz_v7000` -> `cudaLaunchKernel`; `cuMemAlloc_v2` -> `cuMemAlloc`."""
    name = _VERSION_SUFFIX.sub("", raw.strip())
    return _VERSION_SUFFIX.sub("", _STREAM_SUFFIX.sub("", name))


def is_graph_launch(raw: str) -> bool:
    return base_name(raw) in GRAPH_LAUNCH


def is_kernel_launch(raw: str) -> bool:
    return base_name(raw) in KERNEL_LAUNCH


def forbidden_category(raw: str) -> Optional[str]:
    """'capture', 'instantiate' or 'allocation' when the call must not run in steady state."""
    name = base_name(raw)
    for prefix, category in FORBIDDEN_PREFIXES:
        if name.startswith(prefix):
            return category
    return None
