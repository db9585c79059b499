#!/usr/bin/env bash
# On the lent GPU machine (device tool): install the wheels carried in .whl/, then run the named steps,
# writing what should come back under $OUT. Steps: probe, conformance [pytest -k expr], bench [args].
#   bash bench/gpu_session.sh probe conformance
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site
cd /tmp  # import the installed wheels, not the checkout
OUT=${OUT:-/tmp/out}
status=0
deepinfer() { python3 -c 'import sys; from deepinfer_core.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }
while [ $# -gt 0 ]; do
    step=$1; shift
    case $step in
        probe)
            deepinfer backends --json > "$OUT/backends.json" 2>&1 || status=1
            nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv >> "$OUT/nvidia_smi.txt" ;;
        conformance)
            filter=${CONFORMANCE_K:-}
            deepinfer conformance --backend nvidia_sm100 \
                --report "$OUT/conformance_nvidia_sm100.json" ${filter:+-k "$filter"} 2>&1 | tail -60 || status=1 ;;
        bench)
            python3 "$OLDPWD/bench/gpu_decode.py" ${BENCH_ARGS:-} --out "$OUT/gpu_decode.json" \
                --plot "$OUT/gpu_decode.png" 2>&1 | tee "$OUT/bench.log" | tail -40 || status=1 ;;
        *) echo "unknown step $step"; status=2 ;;
    esac
done
exit $status
