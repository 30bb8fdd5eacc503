"""Server arguments for one server holding both pools, and the capture-list and catch-up-backend
rules both the main and the scheduler process read.

apply_dual_graph_server_args runs in the main process, right after EAGLE3's own handling: lifts
the 48-request default, sets the spec capture list (a tuned config's, else SGLang's capped at
``spec_max_bs`` where set; ``decode.max_bs``, the decode pool's top, left alone) and, under lazy
catch-up with the radix cache on, names the ``dual_graph`` radix backend.
docs/sglang-0.5.17.md §2 gives the SGLang contracts and the reasons.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence

# The attention backends lazy catch-up runs on: name -> (module, class) of the draft's backend.
# Each entry needs a GPU correctness run of its eager DRAFT_EXTEND_V2 metadata with per-request
# lengths (docs/sglang-0.5.17.md, "The pass"; results/sglang/README.md lists the runs).
CATCH_UP_BACKENDS = {"triton": ("sglang.srt.layers.attention.triton_backend", "TritonAttnBackend"),
                     "flashinfer": ("sglang.srt.layers.attention.flashinfer_backend",
                                    "FlashInferAttnBackend"),
                     "fa3": ("sglang.srt.layers.attention.flashattention_backend",
                             "FlashAttentionBackend")}
# What a launch line adds to run lazy catch-up.
CATCH_UP_FLAG = f"--attention-backend {next(iter(CATCH_UP_BACKENDS))}"


def catch_up_backend_refusal(where: str, backend: str) -> str:
    """The one line that refuses lazy catch-up on an attention backend it has not been checked
    on: `where` names the setting or stage, `backend` what it holds."""
    return (f"DGW_CONTINUITY=lazy-catch-up runs its catch-up (a draft extend over per-request "
            f"ranges) on the {' or '.join(CATCH_UP_BACKENDS)} attention backend, but {where} is "
            f"{backend}: add {CATCH_UP_FLAG}, or set DGW_CONTINUITY=keep-current")


def catch_up_backend_classes() -> tuple[type, ...]:
    """The draft attention backend classes of CATCH_UP_BACKENDS (imports SGLang). A backend
    whose kernels are not installed (fa3 without sgl_kernel's FA3 library) is no draft's."""
    import importlib

    classes = []
    for module, name in CATCH_UP_BACKENDS.values():
        try:
            classes.append(getattr(importlib.import_module(module), name))
        except ImportError:
            continue
    return tuple(classes)


@dataclass(frozen=True)
class ServerArgsAdjustment:
    max_running_requests_restored: bool
    spec_bs_before: Optional[tuple[int, ...]]
    spec_bs_after: Optional[tuple[int, ...]]
    decode_max_bs: Optional[int]
    radix_cache_backend: Optional[str] = None   # set: the draft-valid tree (radix.py)

    def describe(self) -> str:
        parts = []
        if self.max_running_requests_restored:
            parts.append("max_running_requests left unset (plain-server admission) instead of "
                         "EAGLE's default 48")
        if self.spec_bs_before != self.spec_bs_after:
            parts.append(f"spec pool bs {list(self.spec_bs_after or ())} (was "
                         f"{list(self.spec_bs_before or ())})")
        elif self.spec_bs_after:
            parts.append(f"spec pool the server's list, up to bs {max(self.spec_bs_after)}")
        parts.append(f"decode pool up to bs {self.decode_max_bs}")
        if self.radix_cache_backend:
            parts.append(f"radix cache backend {self.radix_cache_backend!r} (only prefixes "
                         "with draft KV are cached)")
        return "; ".join(parts)


def cap_batch_sizes(sizes: Sequence[int], cap: Optional[int]) -> list[int]:
    """Sizes <= cap (None: all); if none is, the smallest (a pool must hold at least one graph)."""
    ordered = sorted(set(int(s) for s in sizes))
    kept = [s for s in ordered if cap is None or s <= cap]
    return kept or ordered[:1]


def apply_dual_graph_server_args(server_args: Any, *, spec_max_bs: Optional[int],
                                 max_running_requests_was_unset: bool,
                                 draft_valid_backend: Optional[str] = None,
                                 spec_bs: Optional[Sequence[int]] = None
                                 ) -> ServerArgsAdjustment:
    """The module's three adjustments (the request cap lifted, the spec capture list set to a tuned
    config's or capped, the radix backend named) applied to `server_args` in place; returns what
    changed."""
    restored = False
    if max_running_requests_was_unset and server_args.max_running_requests is not None:
        server_args.max_running_requests = None
        restored = True
    decode_cfg = getattr(getattr(server_args, "cuda_graph_config", None), "decode", None)
    before = after = None
    max_bs = None
    if decode_cfg is not None and getattr(decode_cfg, "bs", None):
        before = tuple(sorted(decode_cfg.bs))
        # A tuned capture config's spec list is the pool, as tuned; else SGLang's, capped if set.
        after = (tuple(sorted(set(int(b) for b in spec_bs))) if spec_bs
                 else tuple(cap_batch_sizes(decode_cfg.bs, spec_max_bs)))
        decode_cfg.bs = list(after)
        max_bs = decode_cfg.max_bs
    backend = None
    if (draft_valid_backend and not getattr(server_args, "disable_radix_cache", False)
            and getattr(server_args, "radix_cache_backend", None) is None):
        server_args.radix_cache_backend = backend = draft_valid_backend
    return ServerArgsAdjustment(restored, before, after, max_bs, backend)


def plain_decode_batch_sizes(generate: Callable[[Any, int], list[int]], *, max_bs: int,
                             disable_cuda_graph_padding: bool) -> list[int]:
    """The decode capture list a plain (non-speculative) server would use up to `max_bs`.

    `generate` is SGLang's ``ServerArgs._generate_decode_cuda_graph_batch_sizes``; it reads
    only ``disable_cuda_graph_padding`` and ``speculative_algorithm`` from self
    (server_args.py:4937-4962), so it is called on a two-field stand-in with the algorithm
    unset: the same list, from the same code, that a plain server captures.
    """
    stand_in = SimpleNamespace(disable_cuda_graph_padding=disable_cuda_graph_padding,
                               speculative_algorithm=None)
    return sorted(set(int(b) for b in generate(stand_in, int(max_bs))))


def fit_to_request_pool(sizes: Sequence[int], *, max_requests: int, alignment: int) -> list[int]:
    """Mirror get_batch_sizes_to_capture's clamps for a width-1 runner: keep sizes that are a
    multiple of the attention-TP alignment and fit the request pool, and add the pool size
    itself when the list overshoots it (so the largest runnable batch has a graph)."""
    out = set(int(s) for s in sizes)
    if out and max(out) > max_requests:
        out.add(int(max_requests))
    kept = sorted(s for s in out if s <= max_requests and s % max(alignment, 1) == 0)
    if not kept:
        raise ValueError(f"no decode batch size fits a request pool of {max_requests} with "
                         f"alignment {alignment} (sizes {sorted(out)})")
    return kept
