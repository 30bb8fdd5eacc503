"""What a step of each engine is expected to launch: the checker's engine expectation profiles.

``reference`` and ``sglang``: each mode's graph stages, and the eager kernel families an engine
states as its host glue (allowed, counted and reported rather than counted against
--max-eager-kernels). A trace names its engine in a ``config:engine=...`` mark; ``--engine auto``
(the default) follows it. The SGLang set was read from SGLang 0.5.17's source (file names
below); nothing here imports SGLang. docs/design.md, "Seeing what the worker does".
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping, Optional

from dual_graph_worker.core.continuity import Continuity
from dual_graph_worker.core.modes import Mode, Stage
from dual_graph_worker.core import nvtx_names as names

AUTO = "auto"
LAZY_CATCH_UP = Continuity.LAZY_CATCH_UP.value


@dataclass(frozen=True)
class KernelFamily:
    """Eager kernels an engine is allowed to launch in a graph step, by name pattern."""

    label: str
    why: str
    patterns: tuple[str, ...]  # regexes, any of which re.search-matches the short or demangled name

    @property
    def regex(self) -> str:
        return "|".join(f"(?:{p})" for p in self.patterns)

    @functools.cached_property
    def _compiled(self) -> re.Pattern:
        return re.compile(self.regex)

    def matches(self, short: str, demangled: str) -> bool:
        return bool(self._compiled.search(short)
                    or (demangled != short and self._compiled.search(demangled)))

    def describe(self) -> str:
        return f"{self.why}; patterns " + ", ".join(f"`{p}`" for p in self.patterns)


# PyTorch ops in the host glue (index, copy, fill, compare, cumsum, argmax, cat): ATen's CUDA
# kernels live in at::native (CUB under at_cuda_detail); the short-name alternatives cover a
# source that keeps only short names.
ATEN = KernelFamily(
    "aten", "PyTorch ATen/CUB ops in SGLang's and the worker's host glue",
    (r"\bat::native::", r"\bat::cuda::", r"\bat_cuda_detail::", r"\bcub::", r"\bthrust::",
     r"^(?:vectorized_|unrolled_)?elementwise_kernel", r"^reduce_kernel",
     r"^index_elementwise_kernel", r"^index(?:Select|Func|Copy|Put)", r"^CatArrayBatchedCopy",
     r"^_?scatter_gather_elementwise_kernel", r"^gatherTopK", r"^bitonicSort", r"^radixSort",
     r"^Device(?:Scan|Reduce|Select|RadixSort|SegmentedRadixSort|SegmentedSort|Histogram)",
     r"^tensor_kernel_scan", r"^distribution_elementwise", r"^sampleMultinomial", r"^cunn_"))

# sglang/kernels/ops/speculative/{cache_locs,eagle,topk1,spec_tree,gather_spec_extras}.py
# (Triton) and sgl_kernel's EAGLE ops (build_tree_kernel_efficient, verify_tree_greedy,
# tree_speculative_sampling_target_only, segment_packbits), called from eagle_utils.py,
# eagle_worker_common.py and eagle_worker_v2.py between the draft, verify and draft-extend graphs.
SGLANG_SPEC = KernelFamily(
    "sglang-spec", "SGLang's EAGLE tree, cache-location and accept kernels",
    (r"assign_draft_cache_locs", r"generate_draft_decode_kv_indices",
     r"align_evict_mask_to_page_size", r"get_target_cache_loc",
     r"filter_finished_cache_loc", r"rebuild_compact_draft_req_to_token",
     r"assign_extend_cache_locs", r"fill_bonus_tokens", r"fill_accept_out_cache_loc",
     r"draft_topk1_", r"_gather_rows_kernel", r"(?i:build_?tree)", r"(?i:verify_?tree)",
     r"(?i:tree_?speculative_?sampling)", r"(?i:segment_?pack_?bits)"))

# Attention metadata and KV bookkeeping refilled before each replay: triton_backend.py:341-404
# (kernels/ops/attention/metadata.py, kernels/ops/kvcache/kv_indices.py), positions
# (kernels/ops/attention/position.py, kernels/jit/csrc/elementwise/clamp_position.cuh), and the
# req_to_token writes (srt/mem_cache/allocation.py, kernels/ops/memory/common.py).
SGLANG_METADATA = KernelFamily(
    "sglang-metadata", "SGLang's attention metadata, positions and req_to_token writes",
    (r"create_flashinfer_kv_indices_triton", r"get_num_kv_splits_triton",
     r"_draft_extend_metadata_kernel", r"_fused_metadata_kernel", r"compute_position_kernel",
     r"clamp_position_kernel", r"assign_req_to_token_pool", r"write_req_to_token_pool",
     r"get_last_loc", r"alloc_(?:decode|extend)_kernel", r"memcpy_triton_kernel"))


def _spans(step, stages: tuple[str, ...]) -> list:
    """The step's spans of those stages that ran work."""
    return [s for s in step.stages if s.name in stages and s.calls]


@dataclass(frozen=True)
class EngineProfile:
    name: str
    summary: str                       # one line for the report
    allowed_eager: tuple[KernelFamily, ...] = ()
    # Decode-mode graph stages beyond `decode`, by the trace's config:continuity ("": the
    # engine's default continuity, used when the trace names none).
    decode_extra_stages: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Stages (names.EAGER_STAGES) whose eager work the engine runs on purpose: their calls are
    # reported on their own, not as glue (eager-kernel limit) nor as switch cost. Every call
    # in them still faces no_capture_instantiate_malloc.
    stated_eager_stages: tuple[str, ...] = ()
    stated_eager_why: str = ""
    # Graph stages the engine itself runs eagerly, by attention backend (the trace's
    # config:attention_backend) and mode: no graph is expected there, their kernels are
    # reported apart from the glue, and a switch step is still compared over them.
    eager_graph_stages: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)
    eager_graph_why: str = ""
    # Set by `on_backend` for one trace: mode -> the graph stages that run eagerly in it.
    eager_stages: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def on_backend(self, backend: str) -> "EngineProfile":
        """This profile for a trace on `backend`, its eagerly run graph stages known."""
        eager = self.eager_graph_stages.get(backend)
        if not eager:
            return self
        listed = "; ".join(f"{mode}: {', '.join(st)}" for mode, st in eager.items())
        return replace(self, eager_stages=dict(eager),
                       summary=f"{self.summary}; on {backend} eager ({listed}): "
                               f"{self.eager_graph_why}")

    def eager_in(self, mode: str) -> tuple[str, ...]:
        return self.eager_stages.get(mode, ())

    def all_eager_stages(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s for st in self.eager_stages.values() for s in st))

    def stated_spans(self, step) -> list:
        """The step's stage spans (timeline.StageSpan) of its stated eager stages that ran work."""
        return _spans(step, self.stated_eager_stages)

    def eager_spans(self, step) -> list:
        """Its stated eager stages' spans and those of the graph stages its mode runs eagerly."""
        return _spans(step, self.stated_eager_stages + self.eager_in(step.mode))

    def decode_stages(self, config: Mapping[str, str]) -> frozenset[str]:
        extra = self.decode_extra_stages
        continuity = config.get(names.CONFIG_CONTINUITY, "")
        return frozenset((Stage.DECODE.value,) + extra.get(continuity, extra.get("", ())))

    def expected_stages(self, mode: str, k: Optional[int], config: Mapping[str, str]
                        ) -> Optional[tuple[frozenset[str], frozenset[str]]]:
        """(required, allowed) graph stages of a mode, or None for a mode the worker lacks."""
        try:
            m = Mode(mode)
        except ValueError:
            return None
        eager = frozenset(self.eager_in(m.value))
        if m is Mode.DECODE:
            required = allowed = self.decode_stages(config)
        elif k is not None:
            required = allowed = frozenset(s.value for s in Stage.for_mode(m, k))
        else:
            # K unknown: the draft stage exists for K > 1 only, so accept it either way.
            with_draft = frozenset(s.value for s in Stage.for_mode(m, 2))
            without = frozenset(s.value for s in Stage.for_mode(m, 1))
            required, allowed = with_draft & without, with_draft | without
        return required - eager, allowed - eager

    def eager_family(self, short: str, demangled: str) -> Optional[KernelFamily]:
        """The stated-set family a kernel belongs to, or None (counts against the limit)."""
        for family in self.allowed_eager:
            if family.matches(short, demangled):
                return family
        return None


REFERENCE = EngineProfile(
    "reference", "spec: draft, verify, draft_extend graphs; decode: the decode graph; "
                 "every eager kernel counts against the limit")
SGLANG = EngineProfile(
    "sglang",
    "spec: EAGLE-3's draft, verify, draft_extend graphs; decode: the decode graph and (keep-"
    "current) the width-1 draft_extend graph; SGLang's eager glue is a stated set; (lazy "
    "catch-up) the catch_up stage's eager draft extend is reported on its own",
    allowed_eager=(ATEN, SGLANG_SPEC, SGLANG_METADATA),
    decode_extra_stages={"": (Stage.DRAFT_EXTEND.value,), LAZY_CATCH_UP: ()},
    stated_eager_stages=(names.CATCH_UP,),
    stated_eager_why="lazy catch-up: one eager draft extend over the tokens decode-mode steps "
                     "stashed (lazy_sync.py), run by the first spec step after them, or early "
                     "in a decode step when the stash is full; the draft work keep-current "
                     "would have run in every decode step",
    eager_graph_stages={"fa3": {Mode.SPEC.value: (Stage.DRAFT_EXTEND.value,)}},
    eager_graph_why="SGLang 0.5.17 captures EAGLE's draft-extend graph only for triton, "
                    "flashinfer, TRT-LLM and the MLA backends (eagle_worker_v2.py:407-440) "
                    "and runs it eagerly otherwise, EAGLE-3 included")

PROFILES: Mapping[str, EngineProfile] = MappingProxyType({p.name: p for p in (REFERENCE, SGLANG)})
CHOICES = (AUTO,) + tuple(PROFILES)


def resolve(requested: Optional[str], config: Mapping[str, str]) -> EngineProfile:
    """The profile asked for, or (auto / None) the one the trace's config:engine names;
    reference when the trace names none or an engine without a profile."""
    if requested not in (None, AUTO):
        try:
            profile = PROFILES[requested]
        except KeyError:
            raise ValueError(f"unknown engine profile {requested!r}; use one of "
                             f"{', '.join(CHOICES)}") from None
    else:
        profile = PROFILES.get(config.get(names.CONFIG_ENGINE, ""), REFERENCE)
    return profile.on_backend(config.get(names.CONFIG_ATTENTION_BACKEND, ""))
