# 12g: the page id of each refill loaded a tile ahead (early_page.diff on 86cf165) against 86cf165's kernel
# (kernels/mla_decode_fp8_gluon.py.prev = git show 86cf165:kernels/mla_decode_fp8_gluon.py), in one device call
export PYTHONUNBUFFERED=1; W=/tmp/w4; mkdir -p $W
for v in new prev; do
  if [ $v = prev ]; then cp kernels/mla_decode_fp8_gluon.py $W/new.py; cp kernels/mla_decode_fp8_gluon.py.prev kernels/mla_decode_fp8_gluon.py; fi
  timeout 140 python3 scripts/gpu_gluon.py --out $W/$v --heads 16 32 64 --variants default > $W/$v.log 2>&1; echo $v fast rc=$?
  timeout 100 python3 scripts/gpu_gluon.py --accurate --out $W/${v}_acc --heads 16 --variants default > $W/${v}_acc.log 2>&1; echo $v acc rc=$?
done
python3 - <<'PY'
import json
for v in ("new","prev"):
  for f in ("gpu_gluon.json","../%s_acc/gpu_gluon_accurate.json"%v):
    d=json.load(open(f"/tmp/w4/{v}/{f}"))
    for r in d['rows']: print(v, r['H'],r['B'],r['L'],r['topk'],r['precision'],r.get('graph_us') and round(r['graph_us'],1),r.get('rel_err') and round(r['rel_err'],4),r.get('error','')[:80])
PY
cd /tmp && tar czf $OUT/w4.tgz w4
