"""Entry point SGLang calls (group ``sglang.srt.plugins``, see pyproject.toml).

``load_plugins()`` (srt/plugins/__init__.py:103-141) calls ``register()`` with no arguments in the
main process and again in every scheduler process (spawn start method), and only *logs* an
exception, after which the user sees nothing but "Unknown speculative algorithm name". So this
function logs at ERROR with the fix before re-raising, and is idempotent: the registry itself
records whether the name is taken (no module-level flag).
"""

from __future__ import annotations

import logging

from dual_graph_worker.core.settings import read_setting

from dual_graph_worker.engines.sglang.version import (
    check_sglang_version,
    installed_sglang_version,
)

logger = logging.getLogger(__name__)


def register() -> None:
    try:
        _register()
    except Exception as exc:
        logger.error("dual-graph-worker: DUAL_GRAPH_EAGLE3 was NOT registered: %s", exc)
        raise


def _register() -> None:
    check_sglang_version(installed_sglang_version())
    # Parsed as the worker parses it ("none" or blank: unset), so the two agree.
    probe = read_setting("capture_probe")
    if probe:
        # Before any model runner exists: the target's graphs are captured before the worker.
        # Idempotent, as registration is.
        from dual_graph_worker.engines.sglang.capture_probe import install_capture_probe

        install_capture_probe(probe)

    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from dual_graph_worker.engines.sglang.hooks import register_hooks
    from dual_graph_worker.engines.sglang.spec_algo import (
        ALGORITHM_NAME,
        DualGraphEagle3Spec,
        validate_server_args,
        worker_factory,
    )

    try:
        existing = SpeculativeAlgorithm.from_string(ALGORITHM_NAME)
    except ValueError:
        existing = None           # not registered yet in this process
    if existing is not None:
        if isinstance(existing, DualGraphEagle3Spec):
            logger.debug("%s already registered in this process", ALGORITHM_NAME)
            return
        raise RuntimeError(f"speculative algorithm {ALGORITHM_NAME} is already registered by "
                           f"another plugin ({existing!r}); uninstall one of them")

    SpeculativeAlgorithm.register(
        ALGORITHM_NAME,
        # The worker keeps EAGLEWorkerV2's overlap contract: on_publish once per forward, the
        # FutureMap relay layout, extra_keep_alive_refs for cross-stream lifetimes.
        supports_overlap=True,
        validate_server_args=validate_server_args,
        spec_class=DualGraphEagle3Spec,
    )(worker_factory)
    # The queue-length hint and the result timestamps the worker reads (hooks.py).
    register_hooks()
    # The draft-valid radix tree lazy catch-up uses when the radix cache is on (radix.py).
    from dual_graph_worker.engines.sglang.radix import register_backend

    register_backend()
    logger.info("dual-graph-worker: registered --speculative-algorithm %s", ALGORITHM_NAME)
