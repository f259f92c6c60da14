#!/usr/bin/env bash
# Run a test command; when it fails, repeat its failed tests and its summary line last, below what its
# processes print while they exit (Mooncake clients' C++ logs), so the tail of a CI log names the failure.
set -uo pipefail
log=$(mktemp "${TMPDIR:-/tmp}/kvledger-test.XXXXXX")
trap 'rm -f "$log"' EXIT
"$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
    echo "== exit $rc: $*"
    grep -aE '^(FAILED|ERROR) |^=+ .*(passed|failed|error).* =+$|^[0-9]+ (passed|failed)' "$log" | tail -40
fi
exit "$rc"
