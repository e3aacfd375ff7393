# Recurrence vs chunked form at one long request against many short ones (same tokens per step).
import json, os, sys
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import kernels as K
rows = []
for reqs, tokens in [(1, 8192), (32, 256), (1, 2048), (4, 2048)]:
  for impl, kw in [("recurrent", {}), ("pallas", {})]:
    sec, nbytes = K.bench_kda_chunk(reqs, tokens, impl, 10, 3, **kw)
    r = dict(reqs=reqs, tokens=tokens, impl=impl, us=sec * 1e6)
    rows.append(r); print(json.dumps(r), flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "kda_b1.json"), "w"), indent=1)
