#!/usr/bin/env bash
# Run test commands in tracks side by side (one per core), in phases one after another:
#   tracks.sh CMD... [-- CMD...]... [== CMD... [-- CMD...]...]...
# "--" starts another track of the same phase; "==" starts the next phase, once every track of this one
# ended (a suite that must not share the machine runs alone in a phase of its own). Each track runs its
# commands in turn, every one even after a failure. A command's output goes to its own log, printed whole
# when the command ends (through scripts/summarized.sh, so a failure's summary is its last lines), so two
# tracks never interleave their lines. Ends with one line per command (status, minutes) and exits 1 if
# any command failed.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/kvledger-tracks.XXXXXX")
trap 'rm -rf "$work"' EXIT
phases=()    # per phase, its tracks joined by an ASCII record separator
tracks=()
current=()
end_track() {
    [ ${#current[@]} -gt 0 ] && tracks+=("$(printf '%s\n' "${current[@]}")")
    current=()
}
end_phase() {
    end_track
    [ ${#tracks[@]} -gt 0 ] && phases+=("$(printf '%s\x1e' "${tracks[@]}")")
    tracks=()
}
for arg in "$@"; do
    case "$arg" in
        --) end_track ;;
        ==) end_phase ;;
        *) current+=("$arg") ;;
    esac
done
end_phase
[ ${#phases[@]} -gt 0 ] || { echo "tracks.sh: no command given" >&2; exit 2; }

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

n_track=0
for phase in "${phases[@]}"; do
    pids=()
    while IFS= read -r -d $'\x1e' track; do
        n_track=$((n_track + 1))
        run_track "$n_track" "$track" &
        pids+=($!)
    done <<<"$phase"
    for p in "${pids[@]}"; do
        wait "$p"
    done
done

status=0
echo "== tracks: every command's status and minutes"
while IFS=$'\t' read -r id rc secs cmd; do
    awk -v id="$id" -v rc="$rc" -v s="$secs" -v cmd="$cmd" \
        'BEGIN { printf "%-5s %-8s %5.1f min  %s\n", id, (rc == 0 ? "ok" : "FAIL(" rc ")"), s / 60, cmd }'
    [ "$rc" = 0 ] || status=1
done < <(sort -V "$work/results")
exit "$status"
