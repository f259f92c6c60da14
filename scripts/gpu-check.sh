#!/usr/bin/env bash
# The prepared GPU check, on CUDA caches shaped as vLLM's allocator shapes them (scripts/gpu_check/test_gpu_kv.py):
#   - the connector's KV copy plan addresses exactly each block's bytes, in the layout's order, on device memory;
#   - a read ordered after the forward by a CUDA event (as the store thread reads) sees the forward's writes;
#   - the integrity tag CUDA KV gets (mm8: int8 matmul + 64-bit multiply-sum, kvledger_connector/shape/tagkernel.py)
#     equals its definition computed on the host, by both kernel paths, on every recorded geometry;
#   - it measures and prints (never asserts) the tag's GB/s on the device against a device-to-host copy of the
#     same bytes, for 2 MiB blocks (32 layers x 8 KV heads x 128, bf16) in LBNHC, LHBNC and BLNHC.
#   Not covered here (needs Mooncake and vLLM on the CUDA machine): puts and gets between device and host
#   buffers through Mooncake, the tag inside a running engine.
#   scripts/gpu-check.sh pack   here (needs .venv with vLLM): writes $GPU_CHECK_DIR (default .gpu-check/):
#                               kvledger_connector/shape/kvlayout.py and shape/tagkernel.py, kvledger/errors.py,
#                               the test, geometry.json
#                               recorded from vLLM
#   scripts/gpu-check.sh run    on the CUDA machine (torch + CUDA, pytest; no vLLM, no Mooncake, no network),
#                               from the repository root; one verdict line at the end
# The folder is git-ignored and self-contained: copy it with the checkout to the CUDA machine.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${GPU_CHECK_DIR:-.gpu-check}
case "${1:-}" in
  pack)
    rm -rf "$DIR"; mkdir -p "$DIR"
    cp kvledger_connector/shape/kvlayout.py kvledger_connector/shape/tagkernel.py scripts/gpu_check/test_gpu_kv.py "$DIR"/
    # kvlayout's errors are kvledger's input errors: errors.py alone, as a namespace package (no __init__)
    mkdir -p "$DIR/kvledger" && cp kvledger/errors.py "$DIR/kvledger/"
    .venv/bin/python -m scripts.gpu_check.record_geometry > "$DIR/geometry.json" 2>"$DIR/record.log"
    bytes=$(du -sb "$DIR" | cut -f1)
    echo "gpu-check: packed $DIR ($bytes bytes, $(grep -o '"layout"' "$DIR/geometry.json" | wc -l) cases)"
    ;;
  run)
    [ -f "$DIR/geometry.json" ] || { echo "GPU-CHECK FAIL: $DIR/geometry.json missing (run pack first)"; exit 2; }
    PY=${PYTHON:-python3}
    set +e
    # bounded, so that a hung device call still ends in a verdict line
    out=$(cd "$DIR" && timeout 540 "$PY" -m pytest -q -p no:cacheprovider test_gpu_kv.py 2>&1)
    rc=$?
    set -e
    echo "$out" | tail -n 25
    dev=$("$PY" -c "import torch,os; d=os.environ.get('GPU_CHECK_DEVICE','cuda'); print(torch.cuda.get_device_name(0) if d=='cuda' and torch.cuda.is_available() else d)" 2>/dev/null || echo "?")
    summary=$(echo "$out" | grep -E '^[0-9]+ (passed|failed)|passed|failed' | tail -n 1)
    if [ $rc -eq 0 ]; then echo "GPU-CHECK PASS on $dev: $summary"; else echo "GPU-CHECK FAIL (exit $rc) on $dev: $summary"; fi
    exit $rc
    ;;
  *) echo "usage: scripts/gpu-check.sh pack|run" >&2; exit 2 ;;
esac
