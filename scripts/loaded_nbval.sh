#!/usr/bin/env bash
# Strict nbval on every chapter while both CPU cores are kept busy, RUNS times in a row (default 3).
# Timing asserts in the chapters must survive a busy machine: this is the check (`make nbval-loaded`).
# Usage: bash scripts/loaded_nbval.sh [RUNS] [NOTEBOOK ...]   (run from the repository root; default: chapters/)
set -uo pipefail
RUNS=${1:-3}
shift || true
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(chapters)
PY=${PY:-.venv/bin/python}
BURNERS=${BURNERS:-$(nproc)}
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; }
trap cleanup EXIT
for _ in $(seq "$BURNERS"); do
    "$PY" -c "while True: pass" &
    pids+=($!)
done
echo "kept $BURNERS core(s) busy with pids ${pids[*]}"
failed=0
for run in $(seq "$RUNS"); do
    start=$(date +%s)
    if "$PY" -m pytest "${targets[@]}" --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
        -p no:cacheprovider -q; then status=passed; else status=FAILED; failed=$((failed + 1)); fi
    echo "loaded nbval run $run/$RUNS: $status in $(( $(date +%s) - start )) s"
done
echo "loaded nbval: $((RUNS - failed))/$RUNS runs passed"
exit $(( failed > 0 ))
