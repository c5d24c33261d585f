set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 LAB_GIT_REV=$REV
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/nvidia-smi.csv
timeout 330 python3 scripts/gpu_kernels.py --out $OUT/kernels --skip cast > $OUT/kernels.log 2>&1; echo "kernels exit $?" >> $OUT/stages.log
timeout 230 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py -k "tma or 16bit or merge" -x > $OUT/tests_tma.log 2>&1; echo "tests exit $?" >> $OUT/stages.log
tail -3 $OUT/tests_tma.log
grep -E "^(fp8_native|bf16_pool|splits) " $OUT/kernels.log | grep -E "h16 64x8K|h8 128x16K" | sort -k4 -n | head -40
