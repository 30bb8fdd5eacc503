"""Errors a user can act on. Each message names the problem and the fix."""

from __future__ import annotations

import errno
import os
import select
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


# A path's problem the user can fix; any other OSError is a bug or the system's, traceback kept.
_PATH_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR,
                          errno.EEXIST, errno.EROFS, errno.ENOSPC})


def report_user_errors(fn: Callable[..., int], *args: Any, **kwargs: Any) -> int:
    """`fn(*args, **kwargs)`, for a command's entry point: a DualGraphError (an error a user can
    act on) becomes one stderr line `error: <message>` naming the problem and the fix, no
    traceback, and exit status 2; so does a path the command cannot use. An interrupt (Ctrl-C)
    is one line and status 130; a reader of stdout that went away (`| head`), a quiet 141."""
    try:
        status = fn(*args, **kwargs)
        sys.stdout.flush()      # a reader gone shows here, not in the interpreter's flush at exit
        return status
    except DualGraphError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        return 141
    except OSError as exc:
        if exc.filename is None or exc.errno not in _PATH_ERRNOS:
            raise
        where = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
        fix = "free space on that disk" if exc.errno == errno.ENOSPC else \
            "pass a path this user can read or write"
        print(f"error: cannot use {where}: {exc.strerror}; {fix}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _stdout_gone() -> bool:
    """Whether stdout's reader went away; if so stdout is pointed at the null device, so the
    interpreter's own flush at exit stays quiet."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        pass
    else:
        if not _reader_closed():          # unbuffered, the flush had nothing to write
            return False
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError):          # no file descriptor behind stdout (a capture)
        pass
    return True


def _reader_closed() -> bool:
    """Whether stdout is a pipe whose reader closed it (poll reports an error on its end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):     # no descriptor, or no poll on this system
        return False
