"""`make verify`'s model check: TLC on the fixed design, the legacy design and the mutants.

    python -m conformance.model_check            the CI set (fixed configs, legacy bugs, mutants)
    python -m conformance.model_check --deep     a larger set of fixed configs (make verify-deep)
    python -m conformance.model_check --only MC_legacy_aba [--only ...]

Prints ONE table (config, design, result, distinct states, depth, seconds, expected vs got), then
each counterexample of the legacy and mutant rows as a story, one line per step: `Action(params)`
and what changed in the abstract state.  Exit 0 only when every fixed config passes and every
legacy config and mutant fails exactly as expected (TLC exit code and invariant/property name).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from conformance.engine.tlc import (PARALLEL_RUNS, REPO, Function, ModelValue, Record, TLCResult, TLCSetupError,
                                    TraceStep, in_parallel, run_tlc)

SPEC = REPO / "tla" / "KVLedger.tla"
TLA = REPO / "tla"

EXIT_NAME = {0: "ok", 11: "deadlock", 12: "invariant", 13: "property"}


@dataclass(frozen=True)
class Check:
    cfg: str                   # tla/<cfg>.cfg
    design: str                # fixed | legacy | mutant
    expect_code: int           # TLC exit code: 0 pass, 12 invariant, 13 (action/temporal) property
    expect_violation: str | None
    guards: str                # what the row demonstrates (upstream issue)
    deadlock: bool = True      # check for deadlock (fixed configs); legacy/mutant rows hunt one bug
    spec: str = "KVLedger"     # tla/<spec>.tla

    @property
    def path(self) -> Path:
        return TLA / f"{self.cfg}.cfg"

    @property
    def spec_path(self) -> Path:
        return TLA / f"{self.spec}.tla"

    @property
    def expected(self) -> str:
        return "pass" if self.expect_code == 0 else f"{EXIT_NAME.get(self.expect_code)} {self.expect_violation}"


CI: list[Check] = [
    Check("MC_safety", "fixed", 0, None, "S1-S9 + lifecycle, 2 req x 2 ranks, 1 block, store faults"),
    Check("MC_lag", "fixed", 0, None, "lagging rank offsets, late notices, pin cap 2 of 3 blocks (ABA)"),
    Check("MC_nonotice", "fixed", 0, None, "reset_prefix_cache path: no preemption notices, 2 blocks"),
    Check("MC_stripe", "fixed", 0, None, "identical KV stored once: each key put by one rank, loaded by all"),
    Check("MC_held", "fixed", 0, None, "held requests: saves deferred at the cap as they finish, MaxHeld 1 of 3"),
    Check("MC_live", "fixed", 0, None, "PinsReleased NoLeakAtRest LoadsFinish Progress, 2 req"),
    Check("MC_live_faults", "fixed", 0, None, "the same liveness + HeldReleased with store faults, 1 req, held"),
    Check("MC_legacy_pollution", "legacy", 12, "NoPollution", "vLLM #52360", deadlock=False),
    Check("MC_legacy_aba", "legacy", 13, "NoStaleEffect", "vLLM #51637 (ABA)", deadlock=False),
    Check("MC_legacy_load", "legacy", 12, "LoadErrorsReported", "load path stops at failing sub-batch",
          deadlock=False),
    Check("MC_mutant_NoPin", "mutant", 12, "DmaReadsPinned", "no pin on EmitStore", deadlock=False),
    Check("MC_mutant_ReportTwice", "mutant", 12, "ReportedOnce", "failed put reported twice", deadlock=False),
    Check("MC_mutant_KeyedByReqId", "mutant", 13, "NoStaleEffect", "worker ledger keyed by req_id",
          deadlock=False),
    Check("MC_live_nofair", "mutant", 13, "temporal", "no fairness: PinsReleased must fail", deadlock=False),
    Check("MC_mutant_NoCap", "mutant", 12, "BoundedPins", "EmitStore ignores the pin cap", deadlock=False),
    Check("MC_mutant_LoadPinFirstRank", "mutant", 12, "LoadsPinned",
          "load pins dropped at the first rank's report (abort mid-load)", deadlock=False),
    Check("MC_mutant_NoTailPin", "mutant", 12, "DmaReadsPinned",
          "partial tail not pinned (finish frees it under the read)", deadlock=False),
    Check("MC_mutant_FreeAtFinish", "mutant", 12, "DmaReadsPinned",
          "held request's table freed at finish (its deferred job reads reused blocks)", deadlock=False),
    # tla/ResetEpoch.tla: reset_cache against another client of the shared store
    Check("MC_reset_epoch", "fixed", 0, None, "S10: resets move the keys; replays, evictions, removals best-effort",
          spec="ResetEpoch"),
    Check("MC_reset_epoch_norefusal", "fixed", 0, None, "S10 with puts landing after the reset (no refusal)",
          spec="ResetEpoch"),
    Check("MC_legacy_reset_replay", "legacy", 12, "NoPreResetLoad",
          "reset keeps the keys: a pre-reset object put back loads", deadlock=False, spec="ResetEpoch"),
]

DEEP: list[Check] = [
    Check("MC_deep_safety", "fixed", 0, None, "MC_safety with 2 blocks"),
    Check("MC_deep_lag", "fixed", 0, None, "1 req x 2 ranks, 2 chunks, 4 job ids, 2 faults, late notices"),
]


# ------------------------------------------------------------------------------------------------
# Stories: one line per counterexample step
# ------------------------------------------------------------------------------------------------
def fmt(v: Any) -> str:
    """A TLC value, printed compactly."""
    if isinstance(v, bool):
        return "T" if v else "F"
    if isinstance(v, ModelValue):
        return str(v)
    if isinstance(v, str):
        return v
    if isinstance(v, tuple):
        return "<" + ",".join(fmt(x) for x in v) + ">"
    if isinstance(v, frozenset):
        return "{" + ",".join(sorted(fmt(x) for x in v)) + "}"
    if isinstance(v, Record):
        return "[" + ",".join(f"{k}={fmt(x)}" for k, x in v.items()) + "]"
    if isinstance(v, dict):
        return "(" + ",".join(f"{fmt(k)}:{fmt(x)}" for k, x in v.items()) + ")"
    return str(v)


def diff(old: Any, new: Any, path: str = "") -> list[str]:
    """Paths that changed between two TLC values, as `path: old->new`."""
    if old == new:
        return []
    if isinstance(old, dict) and isinstance(new, dict) and old.keys() == new.keys():
        out: list[str] = []
        for k in old:
            sub = f"{path}.{k}" if isinstance(old, Record) else f"{path}[{fmt(k)}]"
            out += diff(old[k], new[k], sub)
        return out
    # a sequence/function of like values diffs per index; a mixed pair such as <<r1, 2>> is one value
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new) > 1 and \
            len({type(x) for x in old + new}) == 1:
        out = []
        for i, (a, b) in enumerate(zip(old, new), start=1):
            out += diff(a, b, f"{path}[{i}]")
        return out
    return [f"{path}: {fmt(old)}->{fmt(new)}"]


def action_label(last: Any) -> str:
    if not isinstance(last, dict) or "name" not in last:
        return "?"
    params = ", ".join(f"{k}={fmt(v)}" for k, v in last.items() if k != "name")
    return f"{last['name']}({params})"


def story(trace: list[TraceStep], *, back_to: int | None = None, stuttering: bool = False,
          width: int = 230) -> list[str]:
    """The counterexample as lines: `  n. Action(params)  | var.path: old->new; ...`."""
    lines: list[str] = []
    prev: dict[str, Any] | None = None
    for st in trace:
        label = action_label(st.state.get("lastAction"))
        if prev is None:
            lines.append(f"  {st.index:>2}. {label}")
        else:
            changes: list[str] = []
            for var in st.state:
                if var != "lastAction" and var in prev:
                    changes += [c if c.startswith(var) else var + c for c in diff(prev[var], st.state[var])]
            text = "; ".join(changes) if changes else "(no change)"
            line = f"  {st.index:>2}. {label:<44} | {text}"
            lines.append(line if len(line) <= width else line[: width - 3] + "...")
        prev = st.state
    if back_to is not None:
        lines.append(f"      ... and back to state {back_to} (a cycle that never meets the property)")
    elif stuttering:
        lines.append("      ... then stutters forever")
    return lines


# ------------------------------------------------------------------------------------------------
# Running the set
# ------------------------------------------------------------------------------------------------
@dataclass
class Row:
    check: Check
    result: TLCResult | None
    error: str | None = None

    @property
    def got(self) -> str:
        if self.error:
            return "error"
        r = self.result
        if r is None:
            return "error"
        if r.exit_code == 0:
            return "pass"
        return f"{EXIT_NAME.get(r.exit_code, r.outcome)} {r.violated or ''}".strip()

    @property
    def as_expected(self) -> bool:
        r = self.result
        if r is None:
            return False
        return r.exit_code == self.check.expect_code and (
            self.check.expect_code == 0 or r.violated == self.check.expect_violation)


def run_check(c: Check, *, xmx: str = "1g", timeout: float = 600.0) -> Row:
    extra = [] if c.deadlock else ["-deadlock"]
    try:
        return Row(c, run_tlc(c.spec_path, c.path, xmx=xmx, extra_args=extra, timeout=timeout))
    except TLCSetupError as e:
        return Row(c, None, str(e))


HEADER = f"{'config':<26} {'design':<7} {'result':<6} {'distinct':>9} {'depth':>5} {'sec':>6}  " \
         f"{'expected':<27} {'got':<27} guards"


def row_line(r: Row) -> str:
    res = r.result
    verdict = "OK" if r.as_expected else "FAIL"
    distinct = f"{res.distinct:,}" if res and res.distinct is not None else "-"
    depth = str(res.depth) if res and res.depth is not None else "-"
    secs = f"{res.seconds:.1f}" if res else "-"
    return (f"{r.check.cfg:<26} {r.check.design:<7} {verdict:<6} {distinct:>9} {depth:>5} {secs:>6}  "
            f"{r.check.expected:<27} {r.got:<27} {r.check.guards}")


def run_set(checks: Iterable[Check], *, out: Callable[[str], None] = print, xmx: str = "1g",
            timeout: float = 600.0, jobs: int = PARALLEL_RUNS) -> list[Row]:
    """Every check's row, in the checks' order; up to `jobs` TLC runs at once (each its own process)."""
    def one(c: Check) -> Row:
        out(f"[model-check] {c.cfg} ...")
        row = run_check(c, xmx=xmx, timeout=timeout)
        out(f"[model-check] {c.cfg}: {'as expected' if row.as_expected else 'NOT as expected'}")
        return row
    return in_parallel(one, checks, jobs=jobs)


def report(rows: list[Row], total_s: float, out: Callable[[str], None] = print) -> bool:
    out("")
    out(HEADER)
    out("-" * len(HEADER))
    for r in rows:
        out(row_line(r))
    ok = all(r.as_expected for r in rows)
    n_ok = sum(r.as_expected for r in rows)
    out("-" * len(HEADER))
    out(f"{n_ok}/{len(rows)} rows as expected; total {total_s:.1f}s; "
        f"{sum((r.result.distinct or 0) for r in rows if r.result):,} distinct states")
    for r in rows:
        if r.error:
            out(f"\n{r.check.cfg}: {r.error}")
    for r in rows:
        res = r.result
        if res is None or res.exit_code == 0 or not res.trace:
            continue
        tag = "counterexample" if r.check.design != "fixed" else "UNEXPECTED counterexample"
        out(f"\n{r.check.cfg} ({r.check.design}, {r.check.guards}): {tag} for "
            f"{res.violated or res.outcome}, {len(res.trace)} states")
        for line in story(res.trace, back_to=res.back_to, stuttering=res.stuttering):
            out(line)
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m conformance.model_check", description=__doc__.splitlines()[0])
    ap.add_argument("--deep", action="store_true", help="run the larger fixed configs (make verify-deep)")
    ap.add_argument("--only", action="append", default=[], metavar="CFG", help="run only these configs")
    ap.add_argument("--xmx", default="1g", help="TLC heap (default 1g)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per TLC run (default 600; 1800 with --deep)")
    args = ap.parse_args(argv)
    checks = DEEP if args.deep else CI
    if args.only:
        known = {c.cfg: c for c in CI + DEEP}
        unknown = [n for n in args.only if n not in known]
        if unknown:
            print(f"model_check: unknown config {unknown[0]!r}; known: {', '.join(known)}", file=sys.stderr)
            return 2
        checks = [known[n] for n in args.only]
    t0 = time.monotonic()
    timeout = args.timeout if args.timeout is not None else (1800.0 if args.deep else 600.0)
    rows = run_set(checks, out=lambda s: print(s, flush=True), xmx=args.xmx, timeout=timeout)
    ok = report(rows, time.monotonic() - t0)
    setup_errors = [r for r in rows if r.error]
    if setup_errors and len(setup_errors) == len(rows):
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
