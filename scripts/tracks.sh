#!/usr/bin/env bash
# Run test commands in tracks side by side (one per core): tracks.sh CMD... [-- CMD...]...
# Each track runs its commands in turn, every one even after a failure. A command's output goes to its
# own log, printed whole when the command ends (through scripts/summarized.sh, so a failure's summary is
# its last lines), so two tracks never interleave their lines. Ends with one line per command (status,
# minutes) and exits 1 if any command failed.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/kvledger-tracks.XXXXXX")
trap 'rm -rf "$work"' EXIT

tracks=()
current=()
for arg in "$@"; do
    if [ "$arg" = "--" ]; then
        tracks+=("$(printf '%s\n' "${current[@]}")")
        current=()
    else
        current+=("$arg")
    fi
done
[ ${#current[@]} -gt 0 ] && tracks+=("$(printf '%s\n' "${current[@]}")")
[ ${#tracks[@]} -gt 0 ] || { echo "tracks.sh: no command given" >&2; exit 2; }

run_track() {  # $1: track number, $2: its commands, one per line
    local t=$1 n=0 cmd log t0 rc
    while IFS= read -r cmd; do
        [ -n "$cmd" ] || continue
        n=$((n + 1))
        log="$work/$t.$n.log"
        t0=$(date +%s)
        echo "== track $t: started: $cmd"
        "$here/summarized.sh" bash -c "$cmd" >"$log" 2>&1
        rc=$?
        {
            flock 9
            echo "== track $t: $cmd"
            cat "$log"
            printf '%s\t%d\t%d\t%s\n' "$t.$n" "$rc" "$(( $(date +%s) - t0 ))" "$cmd" >>"$work/results"
        } 9>>"$work/lock"
    done <<<"$2"
}

pids=()
for i in "${!tracks[@]}"; do
    run_track "$((i + 1))" "${tracks[$i]}" &
    pids+=($!)
done
for p in "${pids[@]}"; do
    wait "$p"
done

status=0
echo "== tracks: every command's status and minutes"
while IFS=$'\t' read -r id rc secs cmd; do
    awk -v id="$id" -v rc="$rc" -v s="$secs" -v cmd="$cmd" \
        'BEGIN { printf "%-5s %-8s %5.1f min  %s\n", id, (rc == 0 ? "ok" : "FAIL(" rc ")"), s / 60, cmd }'
    [ "$rc" = 0 ] || status=1
done < <(sort -V "$work/results")
exit "$status"
