"""The generated documentation: README's settings table and docs/vs-upstream.md's config tables, rendered
from the key tables (keys.py, kvledger_connector/upstream_keys.py) and checked in between markers
(``python -m kvledger_connector.config --write``; a test fails on drift).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from kvledger_connector import upstream_keys as upstream
from kvledger_connector.config.keys import KEYS, Key
from kvledger_connector.config.parsers import size_text

_ACCEPTS: dict[str, str] = {
    "address": "`host:port`", "metadata": "`http://host:port/metadata`, `P2PHANDSHAKE`, `etcd://…`, `redis://…`",
    "host": "host name or IP address", "protocol": "`tcp`, `rdma`", "devices": "comma list of device names",
    "bool": "`true`, `false`", "namespace": "`\"\"` or 1–64 of `A-Z a-z 0-9 . _ -`",
    "version": "`\"\"` or 1–64 of `A-Z a-z 0-9 . _ -`",
    "path": "path; `\"\"` or null: off", "integrity": "`checksum`, `mac`, `off`", "firewall": "`off`, `nftables`",
}


def _accepts(key: Key) -> str:
    if key.type == "int":
        lo, hi = key.bounds
        return f"{lo:,}–{hi:,}"
    if key.type == "size":
        lo, hi = key.bounds
        return f"{size_text(lo)}–{size_text(hi)} (bytes or e.g. `\"4GB\"`)"
    return _ACCEPTS[key.type]


def _shown_default(key: Key) -> str:
    if key.shown_default is not None:
        return key.shown_default
    if isinstance(key.default, bool):
        return str(key.default).lower()
    if key.type == "size":
        return size_text(key.default)
    return '""' if key.default == "" else str(key.default)


def _also_from(key: Key) -> str:
    out = ["file" if key.in_file else "extra config only"]
    out += [f"upstream `{u.name}`" for u in upstream.KEYS if u.kind == "alias" and u.ours == key.name]
    out += [f"`{u.name}` (below a file or extra-config value)" for u in upstream.ENV if u.ours == key.name]
    return "; ".join(out)


def _row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def settings_markdown() -> str:
    """README's settings table: every key, its default, what it accepts, where else it is read from."""
    lines = [_row("key", "default", "accepts", "also from", "meaning"), "|---|---|---|---|---|"]
    lines += [_row(f"`{k.name}`", _shown_default(k), _accepts(k), _also_from(k), k.doc) for k in KEYS]
    return "\n".join(lines)


def upstream_markdown() -> str:
    """docs/vs-upstream.md's config tables: each upstream key and variable, then the keys only here."""
    out: list[str] = []
    for where, title in (("file", "## Config keys: the `MOONCAKE_CONFIG_PATH` file"),
                         ("extra", "## Config keys: `kv_connector_extra_config`")):
        out += [title, "", _row("upstream key (upstream default)", "here", "test"), "|---|---|---|"]
        out += [_row(f"`{u.name}` ({u.upstream_default})", u.here, u.tests) for u in upstream.KEYS if u.where == where]
        out.append("")
    out += ["## Environment", "", _row("upstream variable", "here", "test"), "|---|---|---|"]
    out += [_row(f"`{u.name}`", u.here, u.tests) for u in upstream.KEYS if u.where == "env"]
    out += ["", "Not read here: `VLLM_MOONCAKE_DISK_STAGING_USABLE_RATIO` and upstream's disk-staging settings "
                "(upstream sizes a load-splitting budget with them; the tier here is `disk_offload`).", "",
            "## Config keys only here", "",
            "Meanings, defaults and bounds: README's settings table (rendered from the same table).", "",
            _row("key", "test"), "|---|---|"]
    upstream_names = {u.ours for u in upstream.KEYS if u.kind in ("same", "alias")}
    out += [_row(f"`{k.name}`", k.tests) for k in KEYS if k.name not in upstream_names]
    return "\n".join(out)


#: file (relative to the repository root) -> (region name, renderer)
GENERATED: dict[str, tuple[str, Callable[[], str]]] = {
    "README.md": ("settings", settings_markdown),
    "docs/vs-upstream.md": ("upstream config", upstream_markdown),
}


def _markers(region: str) -> tuple[str, str]:
    return (f"<!-- generated ({region}): python -m kvledger_connector.config --write; "
            f"edit config/keys.py, not this -->", f"<!-- end generated ({region}) -->")


def spliced(text: str, region: str, body: str) -> str:
    """`text` with its generated `region` replaced by `body`; ValueError when the markers are missing."""
    begin, end = _markers(region)
    head, sep, rest = text.partition(begin)
    old, sep2, tail = rest.partition(end)
    if not sep or not sep2:
        raise ValueError(f"generated region {region!r}: markers missing ({begin!r} ... {end!r})")
    return f"{head}{begin}\n{body}\n{end}{tail}"


def main(argv: list[str]) -> int:
    """``python -m kvledger_connector.config``: print a table, or check or rewrite the checked-in copies."""
    ap = argparse.ArgumentParser(prog="python -m kvledger_connector.config",
                                 description="Render the config tables; --write updates the checked-in copies.")
    ap.add_argument("--markdown", choices=["settings", "upstream"], help="print one table")
    ap.add_argument("--write", action="store_true", help="rewrite the generated regions of " + ", ".join(GENERATED))
    ap.add_argument("--check", action="store_true", help="exit 1 when a checked-in region differs")
    ap.add_argument("--root", default=".", help="the repository root (default: .)")
    args = ap.parse_args(argv)
    if args.markdown:
        print(settings_markdown() if args.markdown == "settings" else upstream_markdown())
    stale = []
    for rel, (region, render) in GENERATED.items() if args.write or args.check else ():
        path = Path(args.root) / rel
        text = path.read_text(encoding="utf-8")
        new = spliced(text, region, render())
        if new != text:
            stale.append(rel)
            if args.write:
                path.write_text(new, encoding="utf-8")
    if stale:
        print(("rewrote " if args.write else "stale: ") + ", ".join(stale), file=sys.stderr)
    return 1 if stale and args.check and not args.write else 0

