#!/usr/bin/env bash
# Engine benchmarks (docs/engine.md): `jaxkv bench` on glm-5.3-flash-mini with random weights, bf16
# weights and latents, fp8 pooled indexer keys, packed layout, block size 1024. One JSON line per
# run goes to $OUT/engine-bench.jsonl (or ./ when OUT is unset); a run that fails or times out
# leaves a {"failed": ...} line instead.
set -u
out="${OUT:-.}/engine-bench.jsonl"
common=(--config glm-5.3-flash-mini --dtype bfloat16 --kv-cache-dtype bfloat16 --indexer-cache-dtype fp8
        --block-size 1024 --memory-gib 24 --context 1024 --steps 64 --max-num-batched-tokens 512 --json)
bench() {
  echo "== $*" >&2
  timeout "${BENCH_TIMEOUT:-300}" python -m jaxkv bench "${common[@]}" "$@" >>"$out" \
    || echo "{\"failed\": \"$*\"}" >>"$out"
}
python -c "import jax; print(jax.__version__, jax.devices())" >&2
# In order of priority: whatever fits the time you have comes back.
bench --batch 8 --buckets 8,512
bench --batch 32 --max-num-reqs 32 --buckets 32,512
bench --batch 8 --buckets 32,512 --num-spec 3
bench --batch 8 --buckets 8,512 --implementation pallas
bench --batch 8 --buckets 16,512 --num-spec 1
