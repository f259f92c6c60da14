"""Every invariant, property, action and model config that the code and docs cite is defined.

The definitions: spec/README.md (`**S<n> `Name`**`, `**L<n> `Name`**`, `**`Name`**`: the invariants and
properties), kvledger.trace.EVENTS (the action vocabulary; spec/machines.json's triggers and the model's
`lastAction` names must be exactly its actions), the TLA+ modules (operators, constants, witnesses,
mutants) and the config files. A citation is recognised by its shape, so a renamed or removed name fails
where it is still cited, naming the file and the line:

- `S<n>` anywhere; `L<n>` followed by a name or in a range `L<i>-L<j>` (`L0` alone is a KV layer);
- an id followed by a name (`S2 DmaReadsPinned`, `S2 `DmaReadsPinned``): the id's own name;
- `invariant X` / `property X`: a name of spec/README.md;
- a CamelCase word of the name pattern spec/README.md states (first word `No`, or a listed last word:
  `...Pinned`, `...Reported`, `...Once`): a spec name, a mutant, or a TLA+ definition;
- in prose (markdown, Python comments and docstrings, TLA+ comments) `Name(r)`, `Name(w, r)`, ...:
  an action or a TLA+ operator;
- in Python, an action string compared to or emitted as an action (`a == "Put"`, `emit(actor, "Put"`);
- `MC_<name>` (or a prefix `MC_<name>*`): a config of tla/ or tests/conformance/kv/.
"""
from __future__ import annotations

import io
import json
import re
import tokenize
from functools import lru_cache
from pathlib import Path

from kvledger.trace import ACTIONS

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("README.md", "docs/*.md", "spec/README.md", "kvledger/**/*.py", "kvledger_connector/**/*.py",
           "conformance/**/*.py", "testbed/**/*.py", "bench/**/*.py", "tla/*.tla")
CONFIG_DIRS = ("tla", "tests/conformance/kv")

_CAMEL = r"[A-Z][a-z]+(?:[A-Z][a-z]*)+"
_ID = re.compile(r"(?<![\w.])([SL])(\d+)(?![\w])")
_ID_NAME = re.compile(r"(?<![\w.])([SL]\d+)\+?[ ]+`?([A-Z][A-Za-z]+)`?")
_L_RANGE = re.compile(r"(?<![\w.])L(\d+)\s*(?:–|-|\.\.|…)\s*L(\d+)(?!\w)")
_KIND_NAME = re.compile(r"\b(?:invariants?|property|properties)[ ]+`?(" + _CAMEL + r")`?")
_SHAPED = re.compile(r"(?<![\w.])(" + _CAMEL + r")(?!\w)")
_APPLIED = re.compile(r"(?<![\w.])([A-Z][a-z]+(?:[A-Z][a-z]*)*)\((?:[a-z]\w{0,2}(?:=[\w-]+)?)"
                      r"(?:,\s*[a-z]\w{0,2}(?:=[\w-]+)?)*\)")
_PY_ACTION = (
    re.compile(r"\b(?:a|action)\s*(?:==|!=)\s*[\"']([A-Z]\w*)[\"']"),
    re.compile(r"\[[\"'](?:action|name)[\"']\]\s*(?:==|!=)\s*[\"']([A-Z]\w*)[\"']"),
    re.compile(r"[\"']action[\"']\s*:\s*[\"']([A-Z]\w*)[\"']"),
    re.compile(r"\b_?emit\w*\((?:[^(),\"']+,\s*|[\"'][a-z]+[\"'],\s*)?[\"']([A-Z]\w*)[\"']"),
    re.compile(r"\b_spec\([\"']([A-Z]\w*)[\"']"),
)
_PY_ACTION_SET = re.compile(r"\b(?:a|action)\s+(?:not\s+)?in\s+[({\[]([^)}\]]*)[)}\]]")
_CONFIG = re.compile(r"(?<![\w/])(MC_[a-z]\w*)(\*|\{)?")  # MC_ + upper case: Mooncake's env vars


def _humps(word: str) -> list[str]:
    return re.findall(r"[A-Z][a-z]*", word)


@lru_cache(maxsize=None)
def spec_names() -> tuple[dict[str, str], frozenset[str]]:
    """({id: name}, every invariant and property name) from spec/README.md's bold headings."""
    text = (ROOT / "spec/README.md").read_text()
    ids = {f"{k}{n}": name for k, n, name in re.findall(r"^\*\*([SL])(\d+) `(\w+)`\*\*", text, re.M)}
    names = set(ids.values()) | set(re.findall(r"^\*\*`(\w+)`\*\*", text, re.M))
    return ids, frozenset(names)


@lru_cache(maxsize=None)
def tla_names() -> frozenset[str]:
    """Operators, constants and witnesses (`Witness_X` defines X) of tla/*.tla, mutants of the configs."""
    names: set[str] = set()
    for f in sorted((ROOT / "tla").glob("*.tla")):
        in_constants = False
        for line in f.read_text().splitlines():
            m = re.match(r"^(\w+)\s*(?:\([^)]*\))?\s*==", line)
            if m:
                names.add(m.group(1))
                names.add(m.group(1).removeprefix("Witness_"))
            m = re.match(r"^CONSTANTS?\b(.*)", line)
            if m or (in_constants and re.match(r"^\s+\w+\s*,?\s*(\\\*.*)?$", line)):
                names.update(re.findall(r"\b([A-Za-z]\w*)\b", re.sub(r"\\\*.*", "", m.group(1) if m else line)))
                in_constants = True
            elif in_constants and line.strip():
                in_constants = False
    for d in CONFIG_DIRS:
        for f in (ROOT / d).glob("*.cfg"):
            names.update(re.findall(r'^\s*Mutant\s*=\s*"(\w+)"', f.read_text(), re.M))
    return frozenset(names)


@lru_cache(maxsize=None)
def config_stems() -> frozenset[str]:
    return frozenset(f.stem for d in CONFIG_DIRS for f in (ROOT / d).glob("*.cfg"))


@lru_cache(maxsize=None)
def _shape_ends() -> frozenset[str]:
    """The last words of spec/README.md's name pattern ("... the outcome's last word one of `A`, `B` ...")."""
    text = " ".join((ROOT / "spec/README.md").read_text().split())
    m = re.search(r"last word one of ((?:`[A-Z][a-z]+`,? (?:or )?)+)", text)
    assert m, "spec/README.md states no name pattern"
    return frozenset(re.findall(r"`([A-Z][a-z]+)`", m.group(1)))


def _prose(text: str, suffix: str) -> list[tuple[int, str]]:
    """(line number, text) of the prose of a file: all of markdown, TLA+ comments, Python comments and
    docstrings (string statements)."""
    if suffix == ".md":
        return list(enumerate(text.splitlines(), 1))
    if suffix == ".tla":
        out, depth = [], 0
        for i, line in enumerate(text.splitlines(), 1):
            kept = []
            for part in re.split(r"(\(\*|\*\)|\\\*.*)", line):
                if part == "(*":
                    depth += 1
                elif part == "*)":
                    depth = max(0, depth - 1)
                elif part.startswith("\\*") or depth:
                    kept.append(part)
            out.append((i, " ".join(kept)))
        return out
    out, prev = [], tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and prev in (
                tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.NL)):
            out += [(tok.start[0] + k, s) for k, s in enumerate(tok.string.splitlines())]
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            prev = tok.type
        elif tok.type == tokenize.NL and prev in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            prev = tokenize.NEWLINE
    return out


def stale_citations(text: str, where: str, suffix: str | None = None) -> list[str]:
    """`where:line: ...` for every citation in `text` that names nothing defined."""
    suffix = suffix or Path(where).suffix
    ids, names = spec_names()
    tla, ends = tla_names(), _shape_ends()
    bad: list[str] = []
    seen: set[tuple[int, str]] = set()

    def flag(i: int, name: str, why: str) -> None:  # one message per name and line, the first rule's
        if (i, name) not in seen:
            seen.add((i, name))
            bad.append(f"{where}:{i}: {name} {why}")

    for i, line in enumerate(text.splitlines(), 1):
        named_l = {m.group(1) for m in _ID_NAME.finditer(line)}
        ranged = {f"L{n}" for m in _L_RANGE.finditer(line) for n in m.groups()}
        for m in _ID.finditer(line):
            cid = m.group(0)
            if cid not in ids and (m.group(1) == "S" or cid in named_l | ranged):
                flag(i, cid, "is no invariant or property of spec/README.md")
        for m in _ID_NAME.finditer(line):
            cid, name = m.groups()
            if cid in ids and re.fullmatch(_CAMEL + "|[A-Z][a-z]+", name) and name != ids[cid] and (
                    name in names or _humps(name)[0] == "No" or _humps(name)[-1] in ends):
                flag(i, name, f"cited as {cid}, which is {ids[cid]} in spec/README.md")
        for m in _KIND_NAME.finditer(line):
            if m.group(1) not in names:
                flag(i, m.group(1), "is no invariant or property of spec/README.md")
        for m in _SHAPED.finditer(line):
            w = m.group(1)
            if (_humps(w)[0] == "No" or _humps(w)[-1] in ends) and w not in names and w not in tla:
                flag(i, w, "is shaped like an invariant but is no name of spec/README.md, no mutant and "
                     "no TLA+ definition")
        for m in _CONFIG.finditer(line):
            stem, prefix = m.groups()
            ok = any(s.startswith(stem) for s in config_stems()) if prefix else stem in config_stems()
            if not ok:
                flag(i, stem + (prefix or ""), f"is no config of {' or '.join(CONFIG_DIRS)}")
        if suffix == ".py":
            found = [m.group(1) for p in _PY_ACTION for m in p.finditer(line)]
            found += [lit for m in _PY_ACTION_SET.finditer(line)
                      for lit in re.findall(r"[\"']([A-Z]\w*)[\"']", m.group(1))]
            for a in found:
                if a not in ACTIONS:
                    flag(i, a, "is used as an action but is not in kvledger.trace.EVENTS")
    for i, line in _prose(text, suffix):
        for m in _APPLIED.finditer(line):
            if m.group(1) not in ACTIONS and m.group(1) not in tla:
                flag(i, m.group(0), "is no action of kvledger.trace.EVENTS and no TLA+ operator")
    return bad


def _scanned() -> list[Path]:
    files = {p for pat in SCANNED for p in ROOT.glob(pat) if p.is_file()}
    return sorted(p for p in files if ".venv" not in p.parts and "__pycache__" not in p.parts)


# ---------------------------------------------------------------------------------------------- definitions
def test_spec_defines_the_ids_in_order_and_the_model_defines_every_name() -> None:
    ids, names = spec_names()
    s = sorted(int(k[1:]) for k in ids if k[0] == "S")
    l_ = sorted(int(k[1:]) for k in ids if k[0] == "L")
    assert s == list(range(1, len(s) + 1)) and len(s) >= 9, s
    assert l_ == list(range(1, len(l_) + 1)) and len(l_) >= 4, l_
    assert "LifecycleConforms" in names
    unshaped = [n for n in names if len(_humps(n)) > 1 and _humps(n)[0] != "No" and _humps(n)[-1] not in _shape_ends()]
    assert unshaped == [], f"names that spec/README.md's name pattern does not cover: {unshaped}"
    models = [ROOT / "tla/KVLedger.tla", ROOT / "tla/ResetEpoch.tla"]  # the models of tla/ (not witnesses, traces)
    defined = {n for m in models for n in re.findall(r"^(\w+)\s*(?:\([^)]*\))?\s*==", m.read_text(), re.M)}
    assert names <= defined, f"named in spec/README.md, defined in no model of tla/: {sorted(names - defined)}"


def test_the_model_configs_check_only_spec_names() -> None:
    _, names = spec_names()
    bad = []
    for f in sorted((ROOT / "tla").glob("MC_*.cfg")):
        text = re.sub(r"\\\*.*", "", f.read_text())
        for block in re.findall(r"^(?:INVARIANTS?|PROPERT(?:Y|IES))\b(.*(?:\n[ \t]+.*)*)", text, re.M):
            bad += [f"{f.name}: {n}" for n in re.findall(r"\w+", block) if n not in names and n != "TypeOK"]
    assert bad == [], bad


def test_actions_are_one_vocabulary() -> None:
    model = set(re.findall(r'name \|-> "(\w+)"', (ROOT / "tla/KVLedger.tla").read_text()))
    assert model - {"Init"} == set(ACTIONS), (sorted(model ^ set(ACTIONS)))
    machines = json.loads((ROOT / "spec/machines.json").read_text())["machines"]
    triggers = {t["trigger"] if isinstance(t, dict) else t[2]
                for m in machines.values() for t in m["transitions"]}
    assert triggers <= set(ACTIONS), sorted(triggers - set(ACTIONS))


# ---------------------------------------------------------------------------------------------- citations
def test_every_cited_name_is_defined() -> None:
    files = _scanned()
    assert len(files) > 30 and ROOT / "README.md" in files
    bad = [b for f in files for b in stale_citations(f.read_text(), str(f.relative_to(ROOT)))]
    assert bad == [], "\n".join(bad)


def test_planted_bad_citations_fail_and_good_ones_pass() -> None:
    good = ("S2 DmaReadsPinned guards the read; `S4 `NoStaleEffect`` too; L1 `PinsReleased`, L1–L4.\n"
            "invariant LoadsPinned, property NoStaleEffect; `Admit(r)`, `DropGeneration(w, r)`, Pinned(j);\n"
            "mutant NoTailPin, witness TwoPins, MC_lag, MC_mutant_* and MC_replay_2ranks; KV layer L0.\n")
    assert stale_citations(good, "good.md") == []
    planted = {
        "S11 is checked": "S11 is no invariant",
        "S2 NoPollution": "which is DmaReadsPinned",
        "L5 `Gone` holds": "L5 is no invariant",
        "the invariant NoPolution": "NoPolution is no invariant",
        "see `JobsPinned`": "JobsPinned is shaped like an invariant",
        "a `Admitt(r)` step": "Admitt(r) is no action",
        "`S4 `NoStaleEfect``": "which is NoStaleEffect",
        "runs MC_nowhere": "MC_nowhere is no config",
    }
    for text, why in planted.items():
        got = stale_citations(text, "planted.md")
        assert len(got) == 1 and got[0].startswith("planted.md:1: ") and why in got[0], (text, got)
    code = 'def f(a):\n    """Step `Recieve(w)`."""\n    return a == "Recieve" or emit(actor, "Puts")\n'
    got = stale_citations(code, "planted.py")
    assert [g.split(": ", 1)[0] for g in got] == ["planted.py:3", "planted.py:3", "planted.py:2"], got
