#!/usr/bin/env bash
# The lab's GPU study on an offline NVIDIA GPU machine (seen on an H200): the benchmark grid and
# every notebook at the seed's scale (profile gpu-seed), into one run folder, packed as one file.
#
#   bash scripts/gpu_study.sh [bench|notebooks|all] [OUT_DIR]
#
# Such a machine has torch and triton but no Jupyter stack and no network: fetch the wheels here
# first with ../shared/tools/device-wheels.sh (-> .whl/) and, for the FlashInfer peers,
# ../shared/tools/flashinfer-offline.sh (-> fi/); carry both folders. Both install into /tmp/site.
set -euo pipefail
what=${1:-all}
out=${2:-${OUT:-/tmp/lab-out}}
cd "$(dirname "$0")/.."
site=/tmp/site
mkdir -p "$site" "$out"
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$@"; }
if [ -d fi ] && [ ! -d "$site/flashinfer" ]; then
  tar xzf fi/flashinfer-reduced.tgz -C "$site" && pipi fi/*.whl
fi
if [ -d .whl ] && [ ! -d "$site/papermill" ]; then pipi .whl/*.whl; fi
export PYTHONPATH="$site:$PWD" PATH="$site/bin:$PATH" PYTHONUNBUFFERED=1 MPLBACKEND=agg
run_dir=$(python3 -c "from labkit import results; print(results.new_run_dir(tag=None))")
echo "run folder: $run_dir"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$run_dir/nvidia-smi.csv"
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 -m labkit.bench --grid gpu --run-dir "$run_dir" 2>&1 | tee "$run_dir/bench.log"
fi
if [ "$what" = notebooks ] || [ "$what" = all ]; then
  python3 -m labkit.cli run --profile gpu-seed --out "$run_dir" 2>&1 | tee "$run_dir/notebooks.log"
fi
tar czf "$out/run.tgz" -C "$(dirname "$run_dir")" "$(basename "$run_dir")"
echo "packed $(du -sh "$out/run.tgz" | cut -f1) -> $out/run.tgz"
