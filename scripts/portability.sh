#!/usr/bin/env bash
# Strict nbval on every chapter under CPU kernel paths other than this machine's own (`make portability`).
# `make test` checks the stored outputs with the host's kernels; a reader's laptop, Colab or an older CI runner
# takes other ones (another summation order, another fp16 path). Each path is chosen at process start by an
# environment variable that the notebook kernels inherit:
#   ATEN_CPU_CAPABILITY=default                  ATen's generic kernels (what a CPU without AVX2 runs)
#   ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
#                                                a processor with AVX2 and no AVX-512 (most laptops)
# On a processor without AVX-512 the second path is the host's own; a variable naming an instruction set the
# processor lacks falls back to what it has.
# Usage: bash scripts/portability.sh [NOTEBOOK ...]   (run from the repository root; default: chapters/)
set -uo pipefail
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(chapters)
PY=${PY:-.venv/bin/python}
TIMED=chapters/05_no_sync.ipynb
# chapter 5 is run on its own when the targets include it (all chapters, or it by name)
alone=0
for t in "${targets[@]}"; do
    case "$t" in chapters|chapters/|"$TIMED") alone=1 ;; esac
done
WORKERS=${WORKERS:-2}
paths=(
    "ATEN_CPU_CAPABILITY=default"
    "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2"
)
failed=0
for path in "${paths[@]}"; do
    start=$(date +%s)
    # shellcheck disable=SC2086  # the path is a list of NAME=VALUE words
    capability=$(env $path "$PY" -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
    echo "== kernel path: $path (ATen runs $capability)"
    status=passed
    # chapter 5 runs last and alone, as in `make test`: its timing cell measures what no_sync() saves on this
    # machine's cores, and a chapter on the other worker moves the measurement out of the cost model's 2x band
    # shellcheck disable=SC2086
    env $path "$PY" -m pytest "${targets[@]}" --ignore="$TIMED" --nbval --nbval-current-env \
        --nbval-sanitize-with tests/nbval_sanitize.cfg -p no:cacheprovider -q -n "$WORKERS" --dist loadfile
    rc=$?
    [ $rc -ne 0 ] && [ $rc -ne 5 ] && status=FAILED  # 5: nothing left to collect (chapter 5 named alone)
    if [ "$alone" -eq 1 ]; then
        # shellcheck disable=SC2086
        env $path "$PY" -m pytest "$TIMED" --nbval --nbval-current-env \
            --nbval-sanitize-with tests/nbval_sanitize.cfg -p no:cacheprovider -q || status=FAILED
    fi
    [ "$status" = FAILED ] && failed=$((failed + 1))
    echo "kernel path $path: $status in $(( $(date +%s) - start )) s"
done
echo "portability: $(( ${#paths[@]} - failed ))/${#paths[@]} kernel paths passed"
exit $(( failed > 0 ))
