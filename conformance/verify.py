"""`make verify`: the project's main check, as a thin orchestrator with a summary.

Stage 1 runs the TLC model check (conformance.model_check: the fixed design passes, the legacy
design and the mutants fail as expected).  Later stages (replay of TLC behaviours against the real
connector, trace validation) plug in as further entries of STAGES.  Exit 0 only when every stage does.
"""
from __future__ import annotations

import sys
import time
from typing import Callable

from conformance import model_check

Stage = tuple[str, Callable[[list[str]], int]]
STAGES: list[Stage] = [
    ("model check (TLC)", model_check.main),
]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    results: list[tuple[str, int, float]] = []
    for name, run in STAGES:
        print(f"== verify: {name}", flush=True)
        t0 = time.monotonic()
        try:
            code = run([])
        except Exception as e:  # a stage that crashes is a failed stage, reported in one line
            print(f"verify: stage {name!r} crashed: {type(e).__name__}: {e}", file=sys.stderr)
            code = 2
        results.append((name, code, time.monotonic() - t0))
    print("\n== verify summary")
    for name, code, secs in results:
        print(f"  {'PASS' if code == 0 else 'FAIL'}  {name:<28} exit {code}  {secs:6.1f}s")
    total = sum(s for _, _, s in results)
    worst = max((c for _, c, _ in results), default=0)
    print(f"  total {total:.1f}s -> {'PASS' if worst == 0 else 'FAIL'}")
    return worst


if __name__ == "__main__":
    sys.exit(main())
