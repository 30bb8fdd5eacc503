"""Errors a user can act on. Each message names the problem and the fix."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable


class DualGraphError(Exception):
    """Base class: every error this package raises on purpose."""


class ConfigError(DualGraphError, ValueError):
    """A configuration value is invalid (bad K, mismatched draft/target shapes, ...)."""


class CheckpointError(DualGraphError):
    """A checkpoint directory cannot be read or does not describe a supported model."""


class NoGraphForBatch(DualGraphError):
    """A batch is larger than every captured graph and eager fallback is disabled."""


class ContextOverflow(DualGraphError):
    """A request would grow past the model's context length or the request table width."""


class KVPoolExhausted(DualGraphError):
    """The KV pool cannot hold even one plain-decode token per running request."""


class StaleConfig(DualGraphError):
    """A capture config was measured on another GPU or model shape."""


def report_user_errors(fn: Callable[..., int], *args: Any, **kwargs: Any) -> int:
    """`fn(*args, **kwargs)`, for a command's entry point: a DualGraphError (an error a user can
    act on) becomes one stderr line `error: <message>` naming the problem and the fix, no
    traceback, and exit status 2; so does a file the command cannot read or write, and an
    interrupt (Ctrl-C) one line and status 130."""
    try:
        return fn(*args, **kwargs)
    except DualGraphError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:               # the reader went away (`| head`): nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:
        if exc.filename is None:          # not a path's problem: a bug or the system's
            raise
        print(f"error: cannot use {exc.filename}: {exc.strerror or exc}; pass a path this "
              "user can read or write", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
