#!/usr/bin/env bash
# The lab's GPU study on an offline NVIDIA GPU machine (seen on an H200), in one go: the benchmark
# grid with the peers, every notebook at the seed's scale (profile gpu-seed), the GPU-marked tests,
# the kernel variant grid and the Gluon kernel's tuning table, into one run folder packed as one
# file ($OUT/run.tgz).
#
#   bash scripts/gpu_study.sh [OUT_DIR]      # stages: STAGES="warm bench notebooks tests rows kernels gluon topk cand first"
#                                            # TOPK_ARGS / GLUON_ARGS: extra arguments of those two scripts
#
# Such a machine has torch and triton but no Jupyter stack and no network: fetch the wheels here
# first with ../shared/tools/device-wheels.sh pytest-xdist (-> .whl/) and, for the FlashInfer peers,
# ../shared/tools/flashinfer-offline.sh (-> fi/); carry both folders. Both install into /tmp/site.
# Such a copy has no .git: pass the revision it was made from as LAB_GIT_REV (results record it):
#   LAB_GIT_REV=$(git rev-parse HEAD)$(git diff --quiet HEAD || echo +dirty) bash scripts/gpu_study.sh
# Each stage has a time limit (seconds, T_<stage>) so that a slow one cannot lose the others. On the
# H200 (run 7): warm ~70 s, bench ~75 s, notebooks ~250 s; tests (122, compile-bound) ~250 s on 8
# workers (run 8), more than 545 s on one; with a 600 s limit per device call, run "tests" alone and
# "warm bench notebooks" in another.
# The run folder gets finished.json (labkit.results.FINISHED) last, and only when every stage exited 0;
# without it load_runs and the report call its records partial (stages.log says which stage failed).
set -uo pipefail
out=${1:-${OUT:-/tmp/lab-out}}
stages=${STAGES:-warm tests bench notebooks}
cd "$(dirname "$0")/.."
site=/tmp/site
mkdir -p "$site" "$out"
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$@"; }
if [ -d fi ] && [ ! -d "$site/flashinfer" ]; then tar xzf fi/flashinfer-reduced.tgz -C "$site" && pipi fi/*.whl; fi
if [ -d .whl ] && [ ! -d "$site/papermill" ]; then pipi .whl/*.whl; fi
export PYTHONPATH="$site:$PWD" PATH="$site/bin:$PATH" PYTHONUNBUFFERED=1 MPLBACKEND=agg
run_dir=$(python3 -c "from labkit import results; print(results.new_run_dir(tag=None))")
echo "run folder: $run_dir"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$run_dir/nvidia-smi.csv"
stage() {  # stage NAME SECONDS CMD...: run with a limit, log into the run folder, carry on
  local name=$1 secs=$2; shift 2
  echo "== $name (limit ${secs}s): $*" | tee -a "$run_dir/stages.log"
  local t0=$SECONDS
  timeout "$secs" "$@" > >(tee "$run_dir/$name.log") 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0))s" | tee -a "$run_dir/stages.log"
  exits+=("$name=$rc")
  [ "$rc" -eq 0 ] || failed+=("$name")
}
xdist_args() { python3 -c 'import xdist' 2>/dev/null && echo "-n ${TEST_WORKERS:-8}"; }
exits=() failed=()
for s in $stages; do
  case $s in
    # compile the rows kernel's specializations and FlashInfer's modules in parallel (Triton's disk cache)
    warm) stage warm "${T_warm:-150}" python3 scripts/gpu_rows.py --warm 12 --out "$run_dir/warm" ;;
    bench) stage bench "${T_bench:-600}" python3 -m labkit.bench --grid gpu --run-dir "$run_dir" --write-select ${BENCH_ARGS:-} ;;
    notebooks) stage notebooks "${T_notebooks:-330}" python3 -m labkit.cli run --profile gpu-seed --out "$run_dir" --no-progress ;;
    # pyproject already passes -q; a second -q would drop pytest's "N passed" line from the log
    # with pytest-xdist installed (carry its wheel in .whl/), -n 8: the stage is compile-bound
    # TEST_FILES: a subset of the GPU test files (default: all of them)
    tests) stage tests "${T_tests:-420}" python3 -m pytest -p no:cacheprovider -m gpu $(xdist_args) ${TEST_FILES:-tests/test_kernels.py \
             tests/test_timing.py tests/test_memory.py tests/test_profiling.py tests/test_roofline.py tests/test_peers.py \
             tests/test_lab.py tests/test_gluon.py tests/test_plans.py tests/test_graphs.py tests/test_rows_kernel.py \
             tests/test_indexer.py tests/test_sparse_paths.py tests/test_dsa.py tests/test_rows_plan.py \
             tests/test_topk_select.py tests/test_topk_cuda.py} ;;
    rows) stage rows "${T_rows:-300}" python3 scripts/gpu_rows.py --out "$run_dir/rows" ;;
    kernels) stage kernels "${T_kernels:-80}" python3 scripts/gpu_kernels.py --quick --out "$run_dir/kernels" ;;
    gluon) stage gluon "${T_gluon:-150}" python3 scripts/gpu_gluon.py --out "$run_dir/gluon" ${GLUON_ARGS:-} ;;
    # the first-timed artefact: the same launch timed after a float64 reference, idle, fp32 load, a freed alloc
    first) stage first "${T_first:-120}" python3 scripts/gpu_first_timing.py --out "$run_dir/first" ;;
    # the DSA indexer's logits and top-k beside torch.topk (run 10: about 60 s)
    topk) stage topk "${T_topk:-150}" python3 scripts/gpu_topk.py --out "$run_dir/topk" ${TOPK_ARGS:-} ;;
    # the parts of logits + top-k with the logits kernel's candidates (run 20: about 15 s a shape)
    cand) stage cand "${T_cand:-100}" python3 scripts/gpu_cand_parts.py --shapes 64x32768 1x32768 64x131072 ;;
  esac
done
if [ ${#failed[@]} -eq 0 ]; then
  python3 -c 'import sys; from labkit import results
results.mark_finished(sys.argv[1], "scripts/gpu_study.sh", stages={a.split("=")[0]: int(a.split("=")[1]) for a in sys.argv[2:]})' \
    "$run_dir" "${exits[@]}" && echo "finished: $run_dir/finished.json"
else
  echo "not marked finished: stage(s) ${failed[*]} failed (stages.log)" | tee -a "$run_dir/stages.log"
fi
tar czf "$out/run.tgz" -C "$(dirname "$run_dir")" "$(basename "$run_dir")"
cp "$run_dir/stages.log" "$out/" 2>/dev/null
echo "packed $(du -sh "$out/run.tgz" | cut -f1) -> $out/run.tgz"
