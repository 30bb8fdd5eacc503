"""The worker variants compared by `dgw demo`, `dgw accept-shift` and `dgw bench`, built the
same way everywhere.

- plain:        decode pool only, no draft state: what a plain (non-speculative) server runs;
- static-spec:  spec pool only, always speculating: a static EAGLE-3 server;
- dynamic:      both pools in one graph pool, the measured-goodput controller (calibration as
                its prior) or whatever `Settings` names;
- dual-off:     the dynamic worker's graphs pinned to decode mode: its "off" mode at every load;
- verify-off:   "off" through the speculative machinery, as SGLang 0.5.x's adaptive tier runs
                it: the target at one token per request plus a draft extend every step (here:
                the keep-current decode graph; this engine's verify and decode share one kernel,
                so SGLang's extra verify-path costs are not included: an upper bound for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Iterator, Mapping, Optional

from dual_graph_worker.core.calibration import CalibrationTable
from dual_graph_worker.core.continuity import Continuity
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.nvtx import Annotator
from dual_graph_worker.core.batch_costs import draft_share
from dual_graph_worker.core.policies import PolicyContext, build_policy, needs_prior
from dual_graph_worker.core.simple_policies import PinnedPolicy
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.settings import BY_KEY, MEASURE, Settings
from dual_graph_worker.engines.reference.attention_choice import default_attention
from dual_graph_worker.engines.reference.build import EngineSpec
from dual_graph_worker.engines.reference.calibration import calibrate
from dual_graph_worker.engines.reference.capture_config import TunedPools
from dual_graph_worker.engines.reference.engine import ReferenceEngine
from dual_graph_worker.engines.reference.runners import CaptureReport
from dual_graph_worker.engines.reference.weights import named_sizes
from dual_graph_worker.engines.reference.worker import DualGraphWorker, WorkerConfig

# The three `dgw demo` and `dgw accept-shift` run side by side on a toy model.
TRIO = ("plain", "static-spec", "dynamic")


@dataclass(frozen=True)
class PoolSizes:
    spec: tuple[int, ...]           # the dynamic worker's spec pool
    decode: tuple[int, ...]         # every decode pool
    static_spec: tuple[int, ...]    # the static-spec worker's pool (covers every load)

    @classmethod
    def up_to(cls, max_bs: int, spec_max: int) -> "PoolSizes":
        ladder = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256,
                  320, 384, 448, 512]
        dec = tuple(b for b in ladder if b < max_bs) + (max_bs,)
        spec = tuple(b for b in dec if b < spec_max) + (min(spec_max, max_bs),)
        return cls(tuple(sorted(set(spec))), dec, dec)


@dataclass(frozen=True)
class VariantInputs:
    """What a variant's WorkerConfig is made from: the pools, graphs or eager, and the
    dual-pool workers' continuity and deferred draft prefills."""

    sizes: PoolSizes
    use_cuda_graphs: bool
    dual_continuity: Continuity
    defer_prefill: bool

    def plain(self) -> WorkerConfig:
        return WorkerConfig((), self.sizes.decode, self.use_cuda_graphs, continuity=None)

    def static_spec(self) -> WorkerConfig:
        return WorkerConfig(self.sizes.static_spec, (), self.use_cuda_graphs,
                            continuity=Continuity.KEEP_CURRENT)

    def dual_pools(self) -> WorkerConfig:
        return WorkerConfig(self.sizes.spec, self.sizes.decode, self.use_cuda_graphs,
                            continuity=self.dual_continuity, defer_prefill=self.defer_prefill)

    def keep_current_decode(self) -> WorkerConfig:
        return WorkerConfig((), self.sizes.decode, self.use_cuda_graphs,
                            continuity=Continuity.KEEP_CURRENT)


@dataclass(frozen=True)
class Variant:
    name: str
    config: Callable[[VariantInputs], WorkerConfig]
    pinned: Mode                      # the mode its policy holds
    # Once captured, the policy Settings name replaces the pin (a calibration as its prior).
    settings_policy: bool = False


VARIANT_TABLE = (
    Variant("plain", VariantInputs.plain, Mode.DECODE),
    Variant("static-spec", VariantInputs.static_spec, Mode.SPEC),
    Variant("dynamic", VariantInputs.dual_pools, Mode.SPEC, settings_policy=True),
    Variant("dual-off", VariantInputs.dual_pools, Mode.DECODE),
    Variant("verify-off", VariantInputs.keep_current_decode, Mode.DECODE),
)
VARIANT_BY_NAME: Mapping[str, Variant] = MappingProxyType({v.name: v for v in VARIANT_TABLE})
VARIANTS = tuple(VARIANT_BY_NAME)


@dataclass(frozen=True)
class BuiltWorker:
    name: str
    worker: DualGraphWorker
    capture: Optional[CaptureReport]         # on CUDA
    calibration: Optional[CalibrationTable]  # the dynamic worker's prior


def variant_named(name: str) -> Variant:
    if name in VARIANT_BY_NAME:
        return VARIANT_BY_NAME[name]
    raise ValueError(f"unknown variant '{name}'; choose from {', '.join(VARIANTS)}")


def build_variant(name: str, engine: ReferenceEngine, sizes: PoolSizes, *,
                  use_cuda_graphs: bool, calib_context: int, settings: Settings = Settings(),
                  dynamic_continuity: Continuity = Continuity.LAZY_CATCH_UP,
                  progress: bool = True, log: Callable[[str], None] = print,
                  tuned: Optional[TunedPools] = None, calib_repeats: int = 5) -> BuiltWorker:
    """`settings` chooses the dynamic worker's policy exactly as DGW_* variables do on a server;
    `tuned` (capture_config.TunedPools) replaces the dual-pool variants' batch sizes and the
    start-up calibration with a tuned capture config's."""
    variant = variant_named(name)
    k = engine.limits.num_draft_tokens
    if tuned is not None:
        sizes = PoolSizes(tuned.spec_bs, tuned.decode_bs, sizes.static_spec)
    config = variant.config(VariantInputs(sizes, use_cuda_graphs, dynamic_continuity,
                                          settings.defer_draft_prefill))
    worker = DualGraphWorker(engine, config, PinnedPolicy(mode=variant.pinned, num_draft_tokens=k),
                             Annotator.switched(settings.nvtx))
    report = worker.capture(progress=progress)
    table = None
    if variant.settings_policy:
        table = _apply_settings_policy(worker, sizes, settings, tuned, log, calib_context,
                                       calib_repeats)
    return BuiltWorker(name, worker, report, table)


def _apply_settings_policy(worker: DualGraphWorker, sizes: PoolSizes,
                           settings: Settings, tuned: Optional[TunedPools],
                           log: Callable[[str], None], calib_context: int,
                           calib_repeats: int) -> Optional[CalibrationTable]:
    """Give `worker` the policy `settings` name; returns its prior (a calibration) where it
    needs one: the tuned config's, else measured on `worker` now."""
    engine = worker.engine
    k = engine.limits.num_draft_tokens
    table = None
    if needs_prior(settings):
        table = tuned.calibration if tuned is not None else calibrate(worker, calib_context,
                                                                      calib_repeats)
        log(f"  calibration ({table.source}): " + ", ".join(
            f"{key.label()}={sec * 1e3:.2f}ms" for key, sec in sorted(table.latency_s.items())))
    worker.policy = build_policy(settings, PolicyContext(
        k, {Mode.SPEC: sizes.spec, Mode.DECODE: sizes.decode}, table,
        defers_prefill=worker.continuity.defers_prefill, max_rows=engine.limits.max_requests,
        draft_share=draft_share(named_sizes(engine.target.w), named_sizes(engine.draft.w))))
    return table


def toy_engine_spec(device: str, num_draft_tokens: int, max_requests: int,
                    max_context: int) -> EngineSpec:
    """The engine a toy checkpoint runs on: float32, Triton attention on CUDA, torch on the CPU."""
    return EngineSpec(num_draft_tokens=num_draft_tokens, max_requests=max_requests,
                      max_context=max_context, device=device, dtype="float32",
                      attention=default_attention(device))


def check_toy_settings(settings: Settings) -> None:
    """ConfigError for a DGW_* setting a toy model cannot honour: files tuned for a server's
    model (the toy sizes and calibrates its own pools)."""
    for key, given in (("capture_config", settings.capture_config is not None),
                       ("calibration", settings.calibration != MEASURE)):
        if given:
            env = BY_KEY[key].env
            raise ConfigError(f"{env} names a file tuned for a server's model; the toy model "
                              f"sizes and calibrates its own pools: unset {env}")


def build_trio(make_engine: Callable[[], ReferenceEngine], sizes: PoolSizes, *, cuda: bool,
               calib_context: int, settings: Settings = Settings()) -> Iterator[BuiltWorker]:
    """The TRIO, built quietly, each on its own engine from `make_engine()` (they take turns
    step by step, each with its own KV cache); yields each worker once it is ready. The dynamic
    worker's continuity is DGW_CONTINUITY's; its pools and prior are the toy model's own
    (check_toy_settings refuses the settings that name others)."""
    for name in TRIO:
        yield build_variant(name, make_engine(), sizes, use_cuda_graphs=cuda, settings=settings,
                            dynamic_continuity=settings.continuity,
                            calib_context=calib_context, progress=False, log=lambda s: None,
                            # CPU timings are noisy: a longer median.
                            calib_repeats=5 if cuda else 21)
