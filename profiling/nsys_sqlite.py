"""Nsight Systems report -> `Trace`, through its SQLite export.

Every table is optional and every SELECT names only the columns that exist, since nsys creates
tables lazily and columns vary by version. Which tables and columns are read, and how
``globalTid`` packs process and thread: docs/design.md, "Seeing what the worker does".
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
from pathlib import Path
from typing import Iterable, NamedTuple, Optional, Sequence

from profiling.errors import NsysNotFound, ProfileInputError
from profiling.events import EventKind, GpuInfo, KernelKey, Trace, TraceEvent

NVTX_MARK = 34
NVTX_PUSH_POP_RANGE = 59
NVTX_START_END_RANGE = 60
NVTX_DOMAIN_CREATE = 75
# 70/71 are payload-carrying variants of the two range types in recent exports.
_NVTX_RANGE_TYPES = frozenset({NVTX_PUSH_POP_RANGE, NVTX_START_END_RANGE, 70, 71})

API_TABLES = ("CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_DRIVER")
KERNEL_TABLE = "CUPTI_ACTIVITY_KIND_KERNEL"
GRAPH_TABLE = "CUPTI_ACTIVITY_KIND_GRAPH_TRACE"

_SQLITE_MAGIC = b"SQLite format 3\x00"
REPORT_SUFFIXES = (".nsys-rep", ".qdrep")  # .qdrep: the name before nsys 2021.4


def split_global_tid(global_tid: Optional[int]) -> tuple[Optional[int], Optional[int]]:
    """(pid, tid) from nsys's serialized globalTid/globalPid."""
    if global_tid is None:
        return None, None
    g = int(global_tid)
    return (g >> 24) & 0xFFFFFF, g & 0xFFFFFF


def export_sqlite(report: Path, out_dir: Path) -> Path:
    """Run `nsys export` on a .nsys-rep; the SQLite file lands in out_dir."""
    nsys = shutil.which("nsys")
    if nsys is None:
        raise NsysNotFound(
            f"{report} is an Nsight Systems report and reading it needs `nsys export`, but nsys "
            "is not on PATH. Install Nsight Systems, or run `nsys export --type sqlite "
            f"--force-overwrite true -o {report.with_suffix('.sqlite').name} {report.name}` "
            "where nsys exists and pass the .sqlite file; without nsys at all, profile with "
            "torch.profiler and pass its Chrome trace JSON instead.")
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = next((report.name[:-len(s)] for s in REPORT_SUFFIXES if report.name.endswith(s)),
                report.stem)
    out = out_dir / f"{stem}.sqlite"
    cmd = [nsys, "export", "--type", "sqlite", "--force-overwrite", "true",
           "-o", str(out), str(report)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stderr or proc.stdout or "").strip()[-2000:]
        raise ProfileInputError(
            f"`{' '.join(cmd)}` failed (exit {proc.returncode}); is {report} a complete "
            f"report from a matching nsys version?\n{tail}")
    return out


def is_sqlite(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(len(_SQLITE_MAGIC)) == _SQLITE_MAGIC
    except OSError:
        return False


class _Db:
    """Schema-tolerant access to one export."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.tables = {r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}
        self._columns: dict[str, set[str]] = {}

    def columns(self, table: str) -> set[str]:
        if table not in self._columns:
            self._columns[table] = {r[1] for r in self.conn.execute(f'PRAGMA table_info("{table}")')}
        return self._columns[table]

    def select(self, table: str, columns: Sequence[str]) -> Iterable[tuple]:
        """Rows of `columns`, NULL for any column this export lacks."""
        present = self.columns(table)
        exprs = ", ".join(f'"{c}"' if c in present else "NULL" for c in columns)
        return self.conn.execute(f'SELECT {exprs} FROM "{table}"')

    def strings(self) -> dict[int, str]:
        if "StringIds" not in self.tables:
            return {}
        return {int(i): v for i, v in self.select("StringIds", ("id", "value")) if i is not None}


def _resolve(value: object, strings: dict[int, str]) -> Optional[str]:
    """A name column holds a StringIds id in real exports; accept text too."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    return strings.get(int(value))


def _nvtx_events(db: _Db, strings: dict[int, str], warnings: list[str]) -> list[TraceEvent]:
    if "NVTX_EVENTS" not in db.tables:
        warnings.append("no NVTX_EVENTS table: profile with `nsys profile --trace=cuda,nvtx`")
        return []
    rows = list(db.select("NVTX_EVENTS",
                          ("start", "end", "eventType", "text", "textId", "globalTid", "domainId")))
    domains_by_pid: dict[tuple[Optional[int], int], str] = {}
    domains: dict[int, str] = {}
    for start, end, etype, text, text_id, gtid, domain_id in rows:
        if etype == NVTX_DOMAIN_CREATE and domain_id is not None:
            name = text if text is not None else _resolve(text_id, strings)
            if name:
                domains_by_pid[(split_global_tid(gtid)[0], int(domain_id))] = name
                domains[int(domain_id)] = name
    out: list[TraceEvent] = []
    unterminated = 0
    for start, end, etype, text, text_id, gtid, domain_id in rows:
        if etype == NVTX_DOMAIN_CREATE or start is None:
            continue
        message = text if text is not None else _resolve(text_id, strings)
        if message is None:
            continue
        pid, tid = split_global_tid(gtid)
        domain = None
        if domain_id:  # 0 / NULL: the default domain
            domain = domains_by_pid.get((pid, int(domain_id))) or domains.get(int(domain_id))
        if etype == NVTX_MARK:
            kind = EventKind.NVTX_MARK
        elif etype in _NVTX_RANGE_TYPES:
            kind = EventKind.NVTX_RANGE
        else:  # an eventType this reader does not know: judge by the interval
            kind = EventKind.NVTX_RANGE if end is not None and end > start else EventKind.NVTX_MARK
        if kind is EventKind.NVTX_RANGE and end is None:
            unterminated += 1
            continue
        end_ns = int(end) if kind is EventKind.NVTX_RANGE else int(start)
        out.append(TraceEvent(kind, message, int(start), end_ns, pid, tid, None, domain))
    if unterminated:
        warnings.append(f"{unterminated} NVTX ranges never ended (profile stopped mid-range?); "
                        "they were ignored")
    return out


def _api_calls(db: _Db, strings: dict[int, str], warnings: list[str]) -> list[TraceEvent]:
    out: list[TraceEvent] = []
    present = [t for t in API_TABLES if t in db.tables]
    if not present:
        warnings.append("no CUPTI_ACTIVITY_KIND_RUNTIME table: profile with "
                        "`nsys profile --trace=cuda,nvtx`")
    for table in present:
        for start, end, name_id, name, corr, gtid in db.select(
                table, ("start", "end", "nameId", "name", "correlationId", "globalTid")):
            api = _resolve(name_id, strings) or _resolve(name, strings)
            if api is None or start is None:
                continue
            pid, tid = split_global_tid(gtid)
            out.append(TraceEvent(EventKind.API_CALL, api, int(start),
                                  int(end) if end is not None else int(start), pid, tid,
                                  int(corr) if corr is not None else None))
    return out


class _Launched(NamedTuple):
    """What the launches made on the GPU, by each launch's (pid, correlation id)."""

    short_names: dict[KernelKey, str]       # eager kernels
    demangled_names: dict[KernelKey, str]   # eager kernels
    graph_ids: dict[KernelKey, int]         # graph replays
    gpu_ns: dict[KernelKey, int]            # eager kernels and graph replays


def _add_gpu_time(gpu_ns: dict[KernelKey, int], key: KernelKey, start, end) -> None:
    if start is not None and end is not None:
        gpu_ns[key] = gpu_ns.get(key, 0) + max(int(end) - int(start), 0)


def _launched(db: _Db, strings: dict[int, str], warnings: list[str]) -> _Launched:
    """One pass over the graph table and one over the kernel table. A graph-node kernel row
    shares its graph launch's id: where that launch has a graph row (--cuda-graph-trace=graph),
    the row already spans it and it is left out; where none does (--cuda-graph-trace=node),
    the launch's GPU time is the sum of its node kernels."""
    out = _Launched({}, {}, {}, {})
    if GRAPH_TABLE in db.tables:
        for corr, exec_id, graph_id, gpid, start, end in db.select(
                GRAPH_TABLE, ("correlationId", "graphExecId", "graphId", "globalPid", "start",
                              "end")):
            if corr is None:
                continue
            key = (split_global_tid(gpid)[0], int(corr))
            gid = exec_id if exec_id is not None else graph_id
            if gid is not None:
                out.graph_ids.setdefault(key, int(gid))
            _add_gpu_time(out.gpu_ns, key, start, end)
    spanned = set(out.gpu_ns)
    summed: set[KernelKey] = set()
    if KERNEL_TABLE in db.tables:
        for corr, short, demangled, name, gpid, node, start, end in db.select(
                KERNEL_TABLE, ("correlationId", "shortName", "demangledName", "name",
                               "globalPid", "graphNodeId", "start", "end")):
            if corr is None:
                continue
            key = (split_global_tid(gpid)[0], int(corr))
            if node:
                if key not in spanned:
                    summed.add(key)
                    _add_gpu_time(out.gpu_ns, key, start, end)
                continue
            full = _resolve(demangled, strings) or _resolve(name, strings)
            kname = _resolve(short, strings) or full
            if kname:
                out.short_names.setdefault(key, kname)
            if full:
                out.demangled_names.setdefault(key, full)
            _add_gpu_time(out.gpu_ns, key, start, end)
    if summed:
        warnings.append(f"{len(summed)} graph launches have node kernels but no graph-trace "
                        "row (profiled with --cuda-graph-trace=node?): their GPU time is the "
                        "sum of their kernels, gaps between kernels left out")
    return out


def _gpus(db: _Db) -> tuple[GpuInfo, ...]:
    if "TARGET_INFO_GPU" not in db.tables:
        return ()
    cols = db.columns("TARGET_INFO_GPU")
    major, minor = "computeMajor", "computeMinor"
    if major not in cols:  # other spellings seen across versions
        major, minor = "computeCapabilityMajor", "computeCapabilityMinor"
    seen: dict[GpuInfo, None] = {}
    for name, maj, mnr in db.select("TARGET_INFO_GPU", ("name", major, minor)):
        gpu = GpuInfo(str(name or "unknown GPU"),
                      int(maj) if maj is not None else None,
                      int(mnr) if mnr is not None else None)
        seen.setdefault(gpu, None)
    return tuple(seen)


def load_sqlite(path: Path) -> Trace:
    """Read an nsys SQLite export into the normalized model."""
    if not path.exists():
        raise ProfileInputError(f"{path} does not exist")
    if not is_sqlite(path):
        raise ProfileInputError(f"{path} is not an SQLite database; pass an nsys .nsys-rep, its "
                                "SQLite export, or a torch.profiler Chrome trace (.json)")
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        db = _Db(conn)
        strings = db.strings()
        warnings: list[str] = []
        events = _nvtx_events(db, strings, warnings) + _api_calls(db, strings, warnings)
        events.sort(key=lambda e: (e.start_ns, -e.end_ns))
        launched = _launched(db, strings, warnings)
        return Trace(tuple(events), launched.short_names, _gpus(db),
                     source=f"nsys SQLite export {path}", warnings=tuple(warnings),
                     kernel_demangled=launched.demangled_names, graph_ids=launched.graph_ids,
                     gpu_ns=launched.gpu_ns)
    finally:
        conn.close()
