"""`make verify`'s witness stage: no invariant of the CI model check holds vacuously.

    python -m conformance.witness                   every witness against the CI configs
    python -m conformance.witness --only S4 [...]   some witnesses
    python -m conformance.witness --stories         also print each witness's behaviour, step by step

An invariant checked in states where the hazard it guards against never happens proves nothing.  For
each safety invariant and action property of tla/KVLedger.tla, tla/Witness.tla defines `Witness_X`:
that hazard (S4: a rank reports an old generation's job after it registered the new generation, ...).
This stage asks TLC to reach it: it checks `NotWitness_X` (an invariant for a state witness, an action
property for a step witness) in a copy of each CI config that checks the guarded invariant, and stops
at the first config where TLC reports a violation, i.e. a shortest behaviour into the hazard (its
length is the depth).  A witness no CI config reaches fails the stage, naming its invariant, and so does
an invariant of the CI configs that has no witness.

Prints one table: invariant | hazard | config | depth | seconds.  Exit 0 only when every witness is
reached; 1 names the unreached ones; 2 when TLC could not run.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from conformance import model_check
from conformance.engine.tlc import REPO, TLC_OUT, TLCResult, TLCSetupError, in_parallel, run_tlc

TLA = REPO / "tla"
SPEC = TLA / "Witness.tla"
CFG_DIR = TLC_OUT / "witness"


@dataclass(frozen=True)
class Witness:
    name: str                  # Witness_<name> / NotWitness_<name> in the witness module
    guards: str                # the invariant or property a config must check for the witness to count
    hazard: str                # one line: the situation the invariant guards against
    step: bool = False         # an action-level witness: checked as an action property (TLC exit 13)
    prefer: tuple[str, ...] = ()   # configs to try first (a config that misses costs a full run)
    only: tuple[str, ...] = ()     # if set: the witness must be reached in one of these configs
    label: str = ""            # the table's invariant column (default: the S-id and name)
    gate: bool = True          # unreached fails the stage (False: informational, see INFO)
    spec: str = "Witness"      # tla/<spec>.tla defining Witness_<name>, run with the configs of its model

    @property
    def operator(self) -> str:
        return f"NotWitness_{self.name}"

    @property
    def expect_code(self) -> int:
        return 13 if self.step else 12

    @property
    def row_name(self) -> str:
        return self.label or f"{self.name} {self.guards}"


WITNESSES: list[Witness] = [
    Witness("S1", "NoPollution", "a queued live job pins a block its request released; a request must allocate"),
    Witness("S2", "DmaReadsPinned", "a DMA read in flight on a block its request released (only the pin holds it)"),
    Witness("Tail", "DmaReadsPinned", "a DMA read of a job's partial tail its request released (only the tail pin)",
            prefer=("MC_lag",), label="S2 DmaReadsPinned+"),
    Witness("Held", "DmaReadsPinned", "a held request's deferred job reads its blocks after the finish (table kept)",
            prefer=("MC_held",), label="S2 DmaReadsPinned++"),
    Witness("S3", "RefCountExact", "a release drops one ref of a block another holder keeps", step=True),
    Witness("S4", "NoStaleEffect", "a rank reports an old generation's job after registering the new one (ABA)",
            step=True, prefer=("MC_lag", "MC_nonotice")),
    Witness("S5", "ReportedOnce", "one rank reported a job while another rank's DMA read of it is in flight"),
    Witness("S6", "BoundedPins", "EmitStore deferred by the pin cap", prefer=("MC_lag",)),
    Witness("S7", "NoGarbageCompute", "a block whose load failed must be recomputed before it counts",
            prefer=("MC_nonotice",)),
    Witness("S8", "LoadErrorsReported", "a load finished after a failed sub-batch with later sub-batches",
            prefer=("MC_lag",)),
    Witness("S9", "LoadsPinned", "an aborted request's load still writes: only the load pin holds its blocks",
            prefer=("MC_safety",)),
    Witness("Lifecycle", "LifecycleConforms", "a request state closes on the last Report after finish (closing->closed)",
            step=True, label="LifecycleConforms"),
    Witness("TwoPins", "BoundedPins", "two store jobs pinned at once", prefer=("MC_lag",),
            label="S6 BoundedPins+"),
    Witness("SharedPin", "RefCountExact", "one block pinned by two jobs", prefer=("MC_lag",),
            label="S3 RefCountExact+"),
    Witness("StaleDmaRead", "NoStaleEffect", "no preemption notice: a DMA read finds its job stale by generation",
            only=("MC_nonotice",), label="S4 NoStaleEffect+"),
    Witness("CrossRank", "NoGarbageCompute", "identical KV stored once: a rank loads a key only another rank put",
            step=True, only=("MC_stripe",), label="S7 NoGarbageCompute+"),
    Witness("StripeHole", "NoGarbageCompute",
            "chunk 1's owner never put it, the other rank put chunk 2; a lookup is due",
            only=("MC_stripe",), label="S7 NoGarbageCompute++"),
    Witness("S10", "NoPreResetLoad", "another client put a pre-reset object back after its keys' removal",
            spec="ResetEpoch"),
]

# Not gates, runnable with --only: branches the model never takes (measured; see tla/Witness.tla).
INFO: list[Witness] = [
    Witness("RegisterOther", "NoStaleEffect", "Register's OTHER arm: a job of a closed or outgrown generation",
            step=True, label="Register OTHER arm", gate=False),
]


# ------------------------------------------------------------------------------------------------
# Configs
# ------------------------------------------------------------------------------------------------
_KEYWORDS = ("CONSTANTS", "CONSTANT", "INIT", "NEXT", "SPECIFICATION", "INVARIANTS", "INVARIANT",
             "PROPERTIES", "PROPERTY", "VIEW", "SYMMETRY", "CONSTRAINTS", "CONSTRAINT",
             "ACTION_CONSTRAINTS", "ACTION_CONSTRAINT", "CHECK_DEADLOCK")
_KW = re.compile(r"^\s*(" + "|".join(_KEYWORDS) + r")\b")
_CHECKS = {"INVARIANTS", "INVARIANT", "PROPERTIES", "PROPERTY"}
# liveness properties (checked under FairSpec in MC_live*): not what this stage is about
_TEMPORAL = {"PinsReleased", "NoLeakAtRest", "LoadsFinish", "Progress", "HeldReleased"}


def _sections(text: str) -> list[tuple[str, list[str]]]:
    """The config as (keyword, lines) sections, comments dropped; text before any keyword is ('', ...)."""
    out: list[tuple[str, list[str]]] = [("", [])]
    for raw in text.splitlines():
        line = raw.split("\\*", 1)[0].rstrip()
        if not line.strip():
            continue
        m = _KW.match(line)
        if m:
            out.append((m.group(1), [line]))
        else:
            out[-1][1].append(line)
    return [(k, ls) for k, ls in out if ls]


def checked_names(cfg_text: str) -> set[str]:
    """The invariants and properties a config checks."""
    names: set[str] = set()
    for kw, lines in _sections(cfg_text):
        if kw in _CHECKS:
            names |= set(" ".join(lines).split()[1:])
    return names


def witness_cfg(cfg_text: str, w: Witness) -> str:
    """The config with its checks replaced by the witness (constants, specification, view kept)."""
    kept = [ln for kw, lines in _sections(cfg_text) if kw not in _CHECKS for ln in lines]
    check = "PROPERTY" if w.step else "INVARIANT"
    return "\n".join(kept + [f"{check} {w.operator}", ""])


def ci_safety_configs() -> dict[str, Path]:
    """The fixed-design CI configs of the model check that check safety invariants, in CI order."""
    out: dict[str, Path] = {}
    for c in model_check.CI:
        if c.design == "fixed" and checked_names(c.path.read_text()) - {"TypeOK"} - _TEMPORAL:
            out[c.cfg] = c.path
    return out


def order(w: Witness, configs: dict[str, Path]) -> list[str]:
    """The configs a witness is tried in: those that check its invariant, preferred ones first."""
    names = [n for n in configs if w.guards in checked_names(configs[n].read_text())]
    if w.only:
        names = [n for n in w.only if n in names]
    pref = [n for n in w.prefer if n in names]
    return pref + [n for n in names if n not in pref]


# ------------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------------
@dataclass
class Attempt:
    cfg: str
    result: TLCResult | None
    error: str | None = None


@dataclass
class WRow:
    witness: Witness
    attempts: list[Attempt]

    @property
    def hit(self) -> Attempt | None:
        for a in self.attempts:
            r = a.result
            if r is not None and r.exit_code == self.witness.expect_code and r.violated == self.witness.operator:
                return a
        return None

    @property
    def reached(self) -> bool:
        return self.hit is not None

    @property
    def errors(self) -> list[str]:
        out = [f"{a.cfg}: {a.error}" for a in self.attempts if a.error]
        for a in self.attempts:
            r = a.result
            if r is not None and r.exit_code != 0 and a is not self.hit:
                out.append(f"{a.cfg}: TLC exit {r.exit_code} ({r.outcome} {r.violated or ''})".rstrip())
        return out

    @property
    def seconds(self) -> float:
        return sum(a.result.seconds for a in self.attempts if a.result)


def run_witness(w: Witness, configs: dict[str, Path], *, spec: Path | None = None, xmx: str = "1g",
                timeout: float = 600.0, cfg_dir: Path = CFG_DIR) -> WRow:
    """Try the witness in each of its configs until TLC reaches it (in `spec`, default its own module)."""
    spec = TLA / f"{w.spec}.tla" if spec is None else spec
    cfg_dir.mkdir(parents=True, exist_ok=True)
    attempts: list[Attempt] = []
    for name in order(w, configs):
        path = cfg_dir / f"{name}__{w.name}.cfg"
        path.write_text(witness_cfg(configs[name].read_text(), w))
        try:
            res = run_tlc(spec, path, xmx=xmx, extra_args=["-deadlock"], timeout=timeout)
            attempts.append(Attempt(name, res))
        except TLCSetupError as e:
            attempts.append(Attempt(name, None, str(e)))
        finally:
            path.unlink(missing_ok=True)
        row = WRow(w, attempts)
        if row.reached or attempts[-1].error or attempts[-1].result.exit_code != 0:
            return row
    return WRow(w, attempts)


HEADER = f"{'invariant':<24} {'hazard':<78} {'config':<12} {'depth':>5} {'sec':>6}"


def row_line(r: WRow) -> str:
    w, hit = r.witness, r.hit
    if hit is not None:
        cfg, depth = hit.cfg, str(len(hit.result.trace))
    else:
        cfg, depth = ("ERROR" if r.errors else "NOT REACHED"), "-"
    return f"{w.row_name:<24} {w.hazard[:78]:<78} {cfg:<12} {depth:>5} {r.seconds:>6.1f}"


def unwitnessed(configs: dict[str, Path], witnesses: Sequence[Witness]) -> list[str]:
    """Invariants and properties the configs check that no witness stands for."""
    checked: set[str] = set()
    for p in configs.values():
        checked |= checked_names(p.read_text())
    return sorted(checked - {"TypeOK"} - _TEMPORAL - {w.guards for w in witnesses})


def report(rows: list[WRow], missing: list[str], configs: dict[str, Path], total_s: float, *,
           stories: bool = False, out: Callable[[str], None] = print) -> bool:
    out("")
    out(HEADER)
    out("-" * len(HEADER))
    for r in rows:
        out(row_line(r))
    out("-" * len(HEADER))
    bad = [r for r in rows if not r.reached and r.witness.gate]
    out(f"{sum(r.reached for r in rows)}/{len(rows)} hazards reached in the CI configs "
        f"({', '.join(configs)}); total {total_s:.1f}s")
    for r in rows:
        for e in r.errors:
            out(f"{r.witness.operator} {e}")
    for r in rows:
        if r.reached:
            continue
        tried = ", ".join(a.cfg for a in r.attempts) or "no CI config checks it"
        tag = ("UNCHECKED (TLC error)" if r.errors else "VACUOUS") if r.witness.gate else "not reached (not a gate)"
        out(f"{tag}: {r.witness.guards}: no CI config reaches its hazard ({r.witness.hazard}); tried {tried}")
    for name in missing:
        out(f"VACUOUS: {name}: checked in the CI configs but no witness of its hazard is defined")
    if stories:
        for r in rows:
            if r.hit is not None:
                out(f"\n{r.witness.row_name} in {r.hit.cfg}: {r.witness.hazard}")
                for line in model_check.story(r.hit.result.trace):
                    out(line)
    return not bad and not missing


def main(argv: list[str] | None = None, *, witnesses: Iterable[Witness] | None = None,
         configs: dict[str, Path] | None = None, spec: Path | None = None, cfg_dir: Path = CFG_DIR) -> int:
    ap = argparse.ArgumentParser(prog="python -m conformance.witness", description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="run only these witnesses (S1..S10, Tail, Held, Lifecycle, TwoPins, SharedPin, StaleDmaRead; "
                         "RegisterOther: a branch no config takes, searched in full)")
    ap.add_argument("--stories", action="store_true", help="print each witness's behaviour")
    ap.add_argument("--xmx", default="1g", help="TLC heap (default 1g)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per TLC run (default 600)")
    args = ap.parse_args(argv)
    ws = list(WITNESSES if witnesses is None else witnesses)
    cfgs = ci_safety_configs() if configs is None else configs
    if args.only:
        known = {w.name: w for w in ws + ([] if witnesses is not None else INFO)}
        unknown = [n for n in args.only if n not in known]
        if unknown:
            print(f"witness: unknown witness {unknown[0]!r}; known: {', '.join(known)}", file=sys.stderr)
            return 2
        ws = [known[n] for n in args.only]
    missing = [] if args.only else unwitnessed(cfgs, ws)
    t0 = time.monotonic()

    def one(w: Witness) -> WRow:
        print(f"[witness] {w.name} ({w.guards}) ...", flush=True)
        return run_witness(w, cfgs, spec=spec, xmx=args.xmx, timeout=args.timeout, cfg_dir=cfg_dir)
    rows = in_parallel(one, ws)  # a witness's configs run in turn (the first that reaches it ends the row)
    ok = report(rows, missing, cfgs, time.monotonic() - t0, stories=args.stories,
                out=lambda s: print(s, flush=True))
    if rows and all(r.errors and not r.reached for r in rows):
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
