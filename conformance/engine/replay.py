"""Replay TLC behaviours against the real system and report the first divergence.

A behaviour is a list of model states (from `conformance.engine.export`); step k is the action named by
state k's `lastAction` (name and parameters). A *driver* maps each model action onto the real system
(kvledger's ledgers, vLLM's `BlockPool`, torch tensors, Mooncake) and maps both sides onto one
abstract state:

    driver.reset(init)                 fresh system in the model's initial state
    driver.apply(action, pre, post)    do the action on the real system; raise `Refused` if the
                                       system will not do it (a divergence: the model did it)
    driver.observe()                   the implementation's abstract state   {field: value}
    driver.expect(state)               the model state projected onto the same fields

After every step observe() must equal expect(post). The first difference stops the behaviour and
becomes a `Divergence`:

    DIVERGENCE behaviour 17 (simulate), step 6 of 23: Collect
      pins:      model [[1, [2, 3], 0]]   impl [[1, [2, 3], 1]]
      prefix: Admit(r=r1) -> Compute(r=r1) -> EmitStore(r=r1) -> Receive(w=w1) -> ...

"step 6 of 23" counts actions from 1; `prefix` lists the actions that matched before it.

What a divergence is (`Divergence.kind`): "state" (a field differs), "refused" (the system raised
`Refused`), "check" (it raised one of the caller's named check errors, `checks`, e.g. a violated
invariant) or "crash" (any other exception, in apply, observe, expect or reset: no named check failed,
so a caller counting findings, such as a mutant table, must not count it as one).
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

from conformance.engine.export import Export


class Refused(RuntimeError):
    """The real system refused an action that the model took (or has no mapping for it)."""


class Driver(Protocol):
    def reset(self, init: dict[str, Any]) -> None: ...

    def apply(self, action: dict[str, Any], pre: dict[str, Any], post: dict[str, Any]) -> None: ...

    def observe(self) -> dict[str, Any]: ...

    def expect(self, state: dict[str, Any]) -> dict[str, Any]: ...

    def close(self) -> None: ...


def action_str(action: dict[str, Any]) -> str:
    args = ", ".join(f"{k}={v}" for k, v in action.items() if k != "name")
    return f"{action.get('name', '?')}({args})"


KINDS = ("state", "refused", "check", "crash")


@dataclass
class Divergence:
    behaviour: int
    origin: str
    step: int  # 1-based action number (0: the initial state)
    length: int  # actions in the behaviour
    action: str
    fields: dict[str, tuple[Any, Any]]  # field -> (model, impl)
    error: str | None = None  # the system raised instead of doing the action (type, message, where)
    prefix: list[str] = field(default_factory=list)
    kind: str = "state"  # one of KINDS

    def __str__(self) -> str:
        lines = [f"DIVERGENCE behaviour {self.behaviour} ({self.origin}), step {self.step} of "
                 f"{self.length}: {self.action}"]
        if self.error:
            what = {"refused": "refused", "check": "a named check failed",
                    "crash": "CRASH (no named check failed)"}.get(self.kind, "the system raised")
            lines.append(f"  {what}: {self.error}")
        width = max((len(f) for f in self.fields), default=0)
        for f, (m, i) in self.fields.items():
            lines.append(f"  {f + ':':<{width + 1}} model {m!r}   impl {i!r}")
        tail = self.prefix[-8:]
        more = "... -> " if len(self.prefix) > 8 else ""
        lines.append(f"  prefix: {more}{' -> '.join(tail) or '(initial state)'}")
        return "\n".join(lines)

    @property
    def crash(self) -> bool:
        return self.kind == "crash"


def diff(model: dict[str, Any], impl: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {k: (model.get(k), impl.get(k)) for k in sorted(set(model) | set(impl))
            if model.get(k) != impl.get(k)}


def raised(e: BaseException) -> str:
    """An exception as one line: type, message, and the innermost frame it came from."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


def replay_behaviour(driver: Driver, states: list[dict[str, Any]], index: int = 0,
                     origin: str = "", *, checks: tuple[type[BaseException], ...] = ()) -> Divergence | None:
    """Replay one behaviour; the first divergence, or None when every step conforms. ``checks``: the
    exception types that are named checks of the system (see the module doc: anything else a crash)."""
    n = len(states) - 1
    prefix: list[str] = []
    k, name = 0, "Init"

    def failed(e: Exception) -> Divergence:
        kind = "refused" if isinstance(e, Refused) else "check" if isinstance(e, checks) else "crash"
        return Divergence(index, origin, k, n, name, {}, raised(e) if kind != "refused" else str(e),
                          prefix, kind)

    try:
        driver.reset(states[0])
        d = diff(driver.expect(states[0]), driver.observe())
    except Exception as e:  # noqa: BLE001 - classified, never lost
        return failed(e)
    if d:
        return Divergence(index, origin, 0, n, "Init", d)
    for k in range(1, len(states)):
        pre, post = states[k - 1], states[k]
        if post == pre:  # a stuttering step (the model rests once everything finished): nothing to do
            continue
        act = post.get("lastAction", {"name": "?"})
        name = action_str(act)
        try:
            driver.apply(act, pre, post)
            d = diff(driver.expect(post), driver.observe())
        except Exception as e:  # noqa: BLE001 - classified, never lost
            return failed(e)
        if d:
            return Divergence(index, origin, k, n, name, d, None, prefix)
        prefix.append(name)
    return None


@dataclass
class ReplayReport:
    behaviours: int = 0
    steps: int = 0
    conforming: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.behaviours > 0 and not self.divergences

    @property
    def crashes(self) -> list[Divergence]:
        return [d for d in self.divergences if d.crash]

    @property
    def findings(self) -> list[Divergence]:
        """The divergences a named check shows (state, refused, check): every one but the crashes."""
        return [d for d in self.divergences if not d.crash]

    @staticmethod
    def merged(parts: Iterable[ReplayReport]) -> ReplayReport:
        """One report of an export replayed in shards side by side (its time: the slowest shard's)."""
        out = ReplayReport()
        for r in parts:
            out.behaviours += r.behaviours
            out.steps += r.steps
            out.conforming += r.conforming
            out.divergences += r.divergences
            out.seconds = max(out.seconds, r.seconds)
        out.divergences.sort(key=lambda d: d.behaviour)
        return out

    def line(self) -> str:
        crashed = f", {len(self.crashes)} crashed" if self.crashes else ""
        return (f"[replay] {self.conforming}/{self.behaviours} behaviours conform{crashed} "
                f"({self.steps} steps, {self.seconds:.1f}s)")


def replay_export(exp: Export, driver: Driver, *, limit: int | None = None,
                  origins: Iterable[str] | None = None, stop_after: int | None = 1,
                  progress: Callable[[str], None] | None = None,
                  checks: tuple[type[BaseException], ...] = (), crashes_stop: bool = True,
                  shard: tuple[int, int] = (0, 1)) -> ReplayReport:
    """Replay the export's behaviours (optionally only some origins / the first `limit`; with
    ``shard=(k, n)`` only those whose index is k modulo n, so n processes replay an export between them).

    Stops after `stop_after` divergences (None: replay everything); with ``crashes_stop=False`` only the
    findings count towards it (a crash is kept and the replay goes on to look for a named check that
    fails). ``checks``: see :func:`replay_behaviour`."""
    rep = ReplayReport()
    t0 = time.monotonic()
    wanted = set(origins) if origins is not None else None
    try:
        for idx, (origin, b) in enumerate(exp.behaviours):
            if idx % shard[1] != shard[0] or (wanted is not None and origin not in wanted):
                continue
            if limit is not None and rep.behaviours >= limit:
                break
            states = exp.steps(b)
            rep.behaviours += 1
            rep.steps += len(states) - 1
            div = replay_behaviour(driver, states, idx, origin, checks=checks)
            if div is None:
                rep.conforming += 1
            else:
                rep.divergences.append(div)
                if progress:
                    progress(str(div))
                counted = rep.divergences if crashes_stop else rep.findings
                if stop_after is not None and len(counted) >= stop_after:
                    break
    finally:
        driver.close()
    rep.seconds = time.monotonic() - t0
    return rep
