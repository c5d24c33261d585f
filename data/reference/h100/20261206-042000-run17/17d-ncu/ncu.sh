#!/bin/bash
# ncu of the sparse Gluon cases; $1 = out dir
out=$1; mkdir -p $out
for c in gluon64_sparse_ds gluon128_sparse gluon64_sparse; do
  timeout 150 ncu --clock-control none --kernel-name regex:gluon --launch-skip 2 --launch-count 1 --set full \
      --import-source no -o $out/$c python3 scripts/ncu_cases.py $c > $out/${c}_ncu.log 2>&1
  ncu -i $out/$c.ncu-rep --page source --print-source sass --csv > $out/${c}_sass.csv 2>/dev/null
  ncu -i $out/$c.ncu-rep --page details > $out/${c}_details.txt 2>&1
  python3 scripts/ncu_cases.py --stalls $out/${c}_sass.csv > $out/${c}_stalls.txt 2>&1
  rm -f $out/$c.ncu-rep $out/${c}_sass.csv
  echo "== $c"; head -14 $out/${c}_stalls.txt; grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|DRAM Throughput|Memory Throughput|Local Memory|Shared Memory Configuration Size|Dynamic Shared" $out/${c}_details.txt | head -12
done
