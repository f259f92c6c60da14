"""Check the runtime's NDJSON event logs against the model with TLC (trace validation).

Pattern (as CCF and etcd do it, with only TLC 2.15): the log is compiled into a TLA+ module
`TraceData` (`Trace == << [action |-> ..., ...], ... >>`); a trace spec (e.g. `tla/TraceKVLedger.tla`)
extends the model with a cursor `i` whose step is "the model action the next logged event names,
with the logged parameters, and the logged observed values after it" and advances `i`. The model may
take silent steps between events for what the runtime does not log. The invariant
`NotFullyMatched == i < Len(Trace)` is a trap: TLC violates it (exit 12) exactly when the whole log
was matched, so **exit 12 means accepted**. Any other verdict means rejected; the constraint
`Furthest` keeps the largest cursor reached in TLC register 1 and prints it when it grows, so the
first event the model could not match is `furthest + 1`.

TLC writes next to the spec, so each check runs in a scratch copy under `.tlc-out/`.

The engine knows no event vocabulary: a caller passes its normalizer (the KV ledger's are
`conformance.kvtrace`, for replayed logs, and `conformance.runlog`, for real runs; each is a program:
`python -m conformance.kvtrace LOG ...`, `python -m conformance.runlog LOG ...`).
"""
from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from conformance.engine import tlc

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is conformance/engine/)
TLA = ROOT / "tla"
OUT = ROOT / ".tlc-out"

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class TraceCheckError(RuntimeError):
    """The log could not be checked at all (unreadable line, value with no TLA+ form, TLC set-up)."""


class UnknownActionError(TraceCheckError):
    """An event names an action outside the log's vocabulary (a normalizer's schema)."""


def to_tla(v: Any) -> str:
    """A JSON value as a TLA+ expression.

    Objects whose keys are all identifiers become records; other objects (job ids as JSON keys)
    become sequences of <<key, value>> pairs with digit keys made ints; lists become sequences."""
    if isinstance(v, bool):
        return "TRUE" if v else "FALSE"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "<<" + ", ".join(to_tla(x) for x in v) + ">>"
    if isinstance(v, dict):
        if v and all(_IDENT.match(k) for k in v):
            return "[" + ", ".join(f"{k} |-> {to_tla(x)}" for k, x in v.items()) + "]"
        pairs = sorted((int(k) if k.lstrip("-").isdigit() else k, x) for k, x in v.items())
        return "<<" + ", ".join(f"<<{to_tla(k)}, {to_tla(x)}>>" for k, x in pairs) + ">>"
    if v is None:
        return '"null"'
    raise TraceCheckError(f"no TLA+ form for a {type(v).__name__} in a trace event: {v!r}")


def to_tla_const(v: Any) -> str:
    """A plain value as a TLC config constant: like `to_tla`, but lists are sets (Req = {...})."""
    if isinstance(v, list):
        return "{" + ", ".join(to_tla_const(x) for x in v) + "}"
    if isinstance(v, (bool, int, str)):
        return to_tla(v)
    raise TraceCheckError(f"no config form for constant value {v!r}")


def read_log(path: Path) -> list[dict[str, Any]]:
    events = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceCheckError(f"{path.name} line {n}: not JSON ({e.msg})") from None
        if not isinstance(ev, dict) or "action" not in ev:
            raise TraceCheckError(f"{path.name} line {n}: an event needs an 'action' field: {line[:80]}")
        events.append(ev)
    return events


def trace_module(events: list[dict[str, Any]]) -> str:
    body = ",\n  ".join(to_tla(e) for e in events)
    return f"---- MODULE TraceData ----\nTrace == <<\n  {body}\n>>\n====\n"


@dataclass
class TraceVerdict:
    accepted: bool
    events: int
    matched: int  # events the model could match, in order
    exit_code: int
    seconds: float
    distinct: int | None
    seqs: list[Any] | None = None  # the runtime `seq` of each checked event (kvtrace sets it)
    violated: str | None = None  # the invariant or property TLC named, if any
    seq_name: str = "seq"  # what `seqs` count (runlog: the log's line numbers)

    @property
    def first_unmatched(self) -> int | None:
        """1-based index of the first event the model could not match (None when accepted)."""
        return None if self.accepted else self.matched + 1

    @property
    def first_unmatched_seq(self) -> Any:
        """The runtime `seq` of the first unmatched event (None when accepted or unknown)."""
        k = self.first_unmatched
        return self.seqs[k - 1] if k is not None and self.seqs and k <= len(self.seqs) else None

    def line(self, name: str = "log") -> str:
        if self.accepted:
            return f"ACCEPTED {name}: all {self.events} events match the model ({self.seconds:.1f}s)"
        if self.violated and self.violated != "NotFullyMatched":
            return (f"REJECTED {name}: {self.violated} is violated after the first {self.matched} of "
                    f"{self.events} events (TLC exit {self.exit_code})")
        if self.matched >= self.events:
            return (f"REJECTED {name}: all {self.events} events match, but the run did not end at rest "
                    f"(a pin, a notice or a failed load block left over; TLC exit {self.exit_code})")
        seq = self.first_unmatched_seq
        at = f" ({self.seq_name} {seq} of the log)" if seq is not None else ""
        return (f"REJECTED {name}: the model matches only the first {self.matched} of {self.events} "
                f"events; event #{self.first_unmatched}{at} has no model step (TLC exit {self.exit_code})")


_CURSOR = re.compile(r'<<"cursor", (\d+)>>')


def check_events(events: list[dict[str, Any]], trace_spec: str, cfg: str, spec_dirs: Iterable[Path] = (TLA,),
                 normalize: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
                 xmx: str = "1g", timeout: float = 600, cfg_text: str | None = None,
                 done_marker: str | None = None) -> TraceVerdict:
    """Run TLC's trace check of `events` (already normalized when `normalize` is None) with the trace spec
    `trace_spec` (a module in `spec_dirs`, extending the model with the cursor) and its config `cfg`.
    `cfg_text`: the trace config to use instead of the file `cfg` (written into the scratch copy).
    `done_marker`: the spec prints <<marker, n>> when the whole log is matched and has no trap invariant;
    then accepted = TLC exit 0 with the marker printed (no counterexample of thousands of states)."""
    if normalize is not None:
        events = [e for e in (normalize(ev) for ev in events) if e is not None]
    if not events:
        raise TraceCheckError("the log has no event to check")
    OUT.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="trace-", dir=OUT))
    try:
        for d in spec_dirs:
            for f in Path(d).iterdir():
                if f.suffix in (".tla", ".cfg") and f.name != "TraceData.tla":
                    shutil.copy(f, work)
        (work / "TraceData.tla").write_text(trace_module(events))
        if cfg_text is not None:
            (work / cfg).write_text(cfg_text)
        try:
            res = tlc.run_tlc(work / f"{trace_spec}.tla", work / cfg, xmx=xmx, timeout=timeout,
                              extra_args=["-deadlock"])
        except tlc.TLCSetupError as e:
            raise TraceCheckError(f"TLC could not check the log: {e}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cursors = [int(c) for c in _CURSOR.findall(res.output)]
    if done_marker is None:
        accepted = res.exit_code == 12 and res.violated == "NotFullyMatched"
    else:
        accepted = res.exit_code == 0 and f'<<"{done_marker}",' in res.output
    matched = len(events) if accepted else max(cursors, default=0)
    return TraceVerdict(accepted, len(events), matched, res.exit_code, res.seconds, res.distinct,
                   violated=res.violated)


def check_many(logs: list[Path], check: Callable[[Path], TraceVerdict]) -> int:
    """Check each log, print one line each; the number of logs not accepted (errors included)."""
    bad = 0
    for log in logs:
        try:
            v = check(log)
        except TraceCheckError as e:
            print(f"ERROR {log.name}: {e}")
            bad += 1
            continue
        print(v.line(log.name))
        bad += not v.accepted
    return bad

