"""Errors the profile checker raises on purpose; each message says what to do."""

from dual_graph_worker.core.errors import DualGraphError


class ProfileInputError(DualGraphError):
    """The profile cannot be read (missing file, unknown format, failed export)."""


class NsysNotFound(ProfileInputError):
    """A .nsys-rep needs `nsys export`, and nsys is not on PATH."""
