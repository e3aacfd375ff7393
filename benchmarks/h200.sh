#!/usr/bin/env bash
# The H200 runs docs/performance.md ("Next lease") asks for, for a lent device whose calls stop at
# a time limit and bring back a few files: each mode writes under $OUT/<mode>/ (./ when OUT is
# unset) and packs it into $OUT/<mode>.tgz at the end, so one file comes back however many ran.
#
#   bash benchmarks/h200.sh correctness  # the conformance matrix (6 shards) beside the GPU suites
#   bash benchmarks/h200.sh matrix       # the matrix alone (a second call finishes it)
#   bash benchmarks/h200.sh suites       # the GPU suites alone ($SUITES: a few of their files)
#   bash benchmarks/h200.sh kernels      # the indexer's selection, the mHC and top-k kernels against
#                                        # the XLA paths they replace (benchmarks/kernels.py,
#                                        # benchmarks/sampler.py)
#   bash benchmarks/h200.sh timing       # the kernel sweeps, the top-20 log-probs' ways, then decode /
#                                        # prefill at batches 1, 8, 32
#   bash benchmarks/h200.sh prefill      # a 32k-token prompt at batch 1, the HF peer's (its wheels
#                                        # carried alone in .wheels/hf/: docs/performance.md,
#                                        # "Reproduce") or jaxkv's in 8,192-token steps (.wheels/ without
#                                        # hf/), then 32 x 1,024 tokens in 8,192-token steps, profiled,
#                                        # without and with a long-prefill cap of 256
#   bash benchmarks/h200.sh tune         # the grouped matmul's tests, then the MoE's tiling tuned at
#                                        # $TUNE_TOKENS (benchmarks/tune_moe.py): the GPU's tuning
#                                        # table comes back in tune/tuning/, to commit
#   bash benchmarks/h200.sh tokens DIR   # the engine's tokens, each run compiled afresh: this tree and
#                                        # DIR with XLA's deterministic ops, then this tree twice without
#                                        # (do the tokens move with the compile, or with the code?)
#   bash benchmarks/h200.sh ab DIR       # another checkout (a branch: git archive it into DIR and
#                                        # carry DIR): its GPU suites, then performance.py at
#                                        # batches 1 and 32, this tree and DIR interleaved, twice;
#                                        # THIS_ARGS / OTHER_ARGS: more performance.py arguments
#                                        # each (e.g. DIR . with SUITE_S=0, OTHER_ARGS=
#                                        # "--implementation xla": one tree, two paths)
#
# CONF: folders (space-separated) of earlier calls' conformance JSON lines; their finished cells
# are skipped (cells that ended in an error run again), and the table shows them beside this call's.
# SHARDS: the matrix's processes sharing the GPU (6; on an H100's 78 GiB six ran its float32 slice
# cells out of memory, 2026-12-06: use 3 there).
# MATRIX_S / SUITE_S / SWEEP_S / PERF_S: the parts' time limits in seconds (SUITE_S=0: ab skips
# the suites); CALL_S: the whole call's (580: a part is cut to what is left, and skipped under
# 20 s, so the archive is always written); SUITE_N: the suites' pytest workers (4; the ab mode runs
# them alone: 8); PERF_BATCHES: ab's batches (1,32); ROUNDS: ab's interleaved rounds (2; a batch-32
# run takes about 125 s, so one round is what fits beside the suites in a 600 s call). tokamax (the MoE's kernel) and its dependencies
# come as wheels in .wheels/ (docs/performance.md, "Reproduce"), installed to /tmp/tk when present:
# the device cannot reach an index.
set -u
end=$((SECONDS + ${CALL_S:-580}))
mode=${1:?usage: bash benchmarks/h200.sh correctness|matrix|suites|tune|kernels|timing|prefill|ab DIR|tokens DIR}
mkdir -p "${OUT:-.}/$mode"
out=$(cd "${OUT:-.}/$mode" && pwd) # absolute: the ab mode runs in two trees
if ls .wheels/*.whl >/dev/null 2>&1; then
  pip install -q --no-deps --target /tmp/tk .wheels/*.whl $(ls .wheels/pyx/*.whl 2>/dev/null) 2>&1 | grep -v WARN
  export PYTHONPATH="$PWD:/tmp/tk"
fi
# JAX_PLATFORMS: tests/conftest.py runs the suite on the CPU unless it is set. Until 2026-12-07
# this script left it unset, so its suites ran on the device's CPU
# (docs/history.md, "twelfth session"). The CPU listed second: jax.debug.callback (performance.py's
# routing pass) places its inputs there, and `cuda` alone failed it (2026-12-07, fifteenth session).
export JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
# Compiled executables kept on disk: a later call on a machine still warm skips XLA's compile.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jcc-this} JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,memory.used --format=csv >"$out/gpu.txt"
git log -1 --format='%H %s' >>"$out/gpu.txt" 2>/dev/null
# The backend the suites and benchmarks will see (a CPU here would be the 2026-12-05..07 mistake).
python -c "import jax; print('jax', jax.__version__, jax.default_backend(), jax.devices())" >>"$out/gpu.txt" 2>&1
# The test files with kernels or the step compiled on a GPU (the rest run the same code as on the CPU).
SUITES="${SUITES:-tests/test_kernel_kda_chunk.py tests/test_kernel_sparse_mla.py tests/test_engine_equivalence.py
  tests/test_speculative.py tests/test_prompt_logprobs.py tests/test_kernel_paged_mqa_logits.py
  tests/test_kernel_kpool.py tests/test_kernel_cache_write.py tests/test_model_paged.py
  tests/test_kernel_kda_recurrence.py tests/test_grouped_matmul.py tests/test_topk_selection.py
  tests/test_kernel_top_k.py tests/test_profiling.py tests/test_kernel_mhc_mix.py tests/test_greedy_step.py}"
# run LIMIT LOG CMD...: one part, its output to $out/LOG, its exit status on this call's output.
run() {
  local limit=$1 log=$2
  shift 2
  ((limit > end - SECONDS - 10)) && limit=$((end - SECONDS - 10))
  if ((limit < 20)); then
    echo "skipped (the call's time is up): $*"
    return
  fi
  echo "== $*" >&2
  timeout "$limit" "$@" >"$out/$log" 2>&1
  echo "rc $? (limit ${limit}s): $*"
  tail -6 "$out/$log"
}
matrix() {
  export XLA_PYTHON_CLIENT_ALLOCATOR=platform # six processes share the GPU's memory
  mkdir -p "$out/c"
  for i in $(seq 0 $((${SHARDS:-6} - 1))); do
    # Each shard skips the cells already in its --out file: every earlier cell goes into each.
    for d in ${CONF:-}; do cat "$d"/*.jsonl; done >"$out/c/shard-$i.jsonl" 2>/dev/null
    timeout $((${MATRIX_S:-420} + 150)) python benchmarks/conformance.py --shard "$i/${SHARDS:-6}" --out "$out/c/shard-$i.jsonl" \
      --time-budget "${MATRIX_S:-420}" >"$out/c/log-$i.txt" 2>&1 &
  done
}
# SUITES_DONE: folders of earlier calls' suites.txt; the tests that passed there are deselected, so a
# second call finishes what the first one's time limit cut. -v: each test's outcome is in the log.
suites() {
  local done_ids=()
  for d in ${SUITES_DONE:-}; do
    mapfile -t -O "${#done_ids[@]}" done_ids < <(grep -hoE 'PASSED tests/[^ ]+|^tests/[^ ]+ PASSED' "$d"/suites*.txt |
      sed -E 's/^PASSED //; s/ PASSED$//; s/^/--deselect=/') # -n's lines, then a single process's
  done
  echo "deselected (passed in SUITES_DONE): ${#done_ids[@]}"
  run "${SUITE_S:-555}" suites.txt python -m pytest -v -n "${SUITE_N:-4}" -p no:benchmark -W ignore --durations=25 \
    "${done_ids[@]}" $SUITES
}
case $mode in
  correctness | matrix)
    matrix
    if [ "$mode" = correctness ]; then
      suites
    fi
    wait
    echo "cells: $(cat "$out"/c/*.jsonl | wc -l)"
    python benchmarks/conformance.py --markdown "$out"/c/*.jsonl >"$out/matrix.md" 2>&1
    tail -3 "$out/matrix.md"
    ;;
  suites)
    suites
    ;;
  ab)
    other=$(cd "${2:?ab needs DIR, another checkout}" && pwd)
    here=$PWD
    if [ "${SUITE_S:-300}" != 0 ]; then # 0: the suites ran already (correctness mode on that tree)
      (cd "$other" && export PYTHONPATH="$other:/tmp/tk" && run "${SUITE_S:-300}" ab-suites.txt python -m pytest \
        -q -n "${SUITE_N:-8}" -p no:benchmark -W ignore $SUITES)
    fi
    for i in $(seq "${ROUNDS:-2}"); do
      for tree in this other; do
        dir=$([ $tree = this ] && echo "$here" || echo "$other")
        args=$([ $tree = this ] && echo "${THIS_ARGS:-}" || echo "${OTHER_ARGS:-}")
        # Each tree's executables cached on disk, so a later round (or call, on a machine still
        # warm) skips XLA's compile: batch 32's warm-up took 8.5 s instead of 81 s on the H200.
        (cd "$dir" && export PYTHONPATH="$dir:/tmp/tk" JAX_COMPILATION_CACHE_DIR="/tmp/jcc-$tree" \
          JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 && run "${PERF_S:-240}" "perf-$i-$tree.txt" \
          python benchmarks/performance.py --batches "${PERF_BATCHES:-1,32}" --out "$out/perf-$tree.jsonl" $args)
      done
    done
    ;;
  tokens)
    # The step's tokens across compiles: XLA times candidate GEMM algorithms at each compile and may
    # pick another (other bits) in another process (docs/conformance.md), so tokens compared across
    # processes can differ without any code change. Each run here compiles afresh (its own empty
    # cache). TOKENS_RUNS: tree:XLA_FLAGS pairs, tree "this" or "other" (DIR); the default runs
    # both trees without the timed choice (as conformance.py does), then this tree twice with it.
    # TOKENS_ARGS: more performance.py arguments.
    other=$(cd "${2:-.}" && pwd)
    i=0
    for spec in ${TOKENS_RUNS:-this:--xla_gpu_deterministic_ops=true other:--xla_gpu_deterministic_ops=true this: this:}; do
      i=$((i + 1))
      tree=${spec%%:*}
      dir=$([ "$tree" = this ] && echo "$PWD" || echo "$other")
      (cd "$dir" && export PYTHONPATH="$dir:/tmp/tk" XLA_FLAGS="${spec#*:}" JAX_COMPILATION_CACHE_DIR="/tmp/jcc-tokens-$i" &&
        run "${PERF_S:-150}" "tokens-$i-$tree.txt" python benchmarks/performance.py --batches "${PERF_BATCHES:-32}" \
          --steps "${TOKENS_STEPS:-32}" ${TOKENS_ARGS:-} --out "$out/tokens-$i-$tree.jsonl")
      echo "run $i ($tree, XLA_FLAGS='${spec#*:}'): $(grep -ho '"output_tokens_sha256": "[0-9a-f]*"' "$out/tokens-$i-$tree.jsonl" 2>/dev/null | sort -u | tr '\n' ' ')"
    done
    ;;
  tune)
    run 240 grouped-matmul-tests.txt python -m pytest -q -p no:benchmark -W ignore tests/test_grouped_matmul.py
    run "${SWEEP_S:-300}" tune.txt python benchmarks/tune_moe.py --tokens "${TUNE_TOKENS:-8192,4096,2048,1024,512,256,128,64}" \
      --out "$out"
    mkdir -p "$out/tuning" && cp pallas_kernels/tuning/*.json "$out/tuning/"
    ;;
  kernels)
    # The indexer's selection against XLA's sort; the mHC kernel against the XLA path it replaced
    # (2 calls a loop, timed by the trace's kernel time: XLA compiled 10 unrolled calls of the
    # reference for minutes on the H100, and 2-call loops' wall time is dispatch); the sampler's
    # top-k kernel against XLA's.
    run 120 select.txt python benchmarks/kernels.py --only topk_selection --iters 20 --out "$out/select"
    run 150 mhc.txt python benchmarks/kernels.py --only mhc_mix --iters 2 --repeats 20 --clock device --out "$out/mhc"
    run 200 sampler.txt python benchmarks/sampler.py --batches 1,8,32,128 --ways 4,8 --top-logprobs \
      --top-k-blocks 2048 --top-k-warps 4 --iters 50 --out "$out/sampler.json"
    ;;
  timing)
    # Nothing else on the GPU. The chunked KDA pair's settings (about 20 s each), then the sparse
    # MLA kernel's at 64 x 32k (the column slices among them), the top-k's table, then the engine.
    run "${SWEEP_S:-200}" kda_chunk.txt python benchmarks/kernels.py --sweep --sweep-only --only kda_chunk \
      --out "$out/kda_chunk"
    run "${SWEEP_S:-200}" sparse_mla.txt python benchmarks/kernels.py --sweep --sweep-only \
      --only sparse_mla_decode --out "$out/sparse_mla"
    run 60 top_logprobs.txt python benchmarks/sampler.py --top-logprobs --no-nucleus --iters 50 \
      --out "$out/top_logprobs.json"
    run "${PERF_S:-180}" performance.txt python benchmarks/performance.py --batches 1,8,32 \
      --out "$out/performance.jsonl"
    ;;
  prefill)
    # The peer's wheels and jaxkv's do not fit one call's 64 MiB beside the tree (15 + 38 + 19 MB;
    # tokamax imports xprof, so its 31 MB wheel cannot be left out: 2026-12-07, twenty-third
    # session), so each part runs in the call its wheels came with: .wheels/hf/ carried alone (the
    # peer), or .wheels/ without hf/ (jaxkv).
    if [ -d .wheels/hf ]; then
      # The peer's transformers (glm5_next needs >= 5.24; the machine has 5.17) and
      # flash-linear-attention, ahead of the machine's on the path (jaxkv imports neither). It
      # prints batch 1's line first; the larger batches at 32k run until the limit or out of memory.
      pip install -q --no-deps --target /tmp/hf .wheels/hf/*.whl 2>&1 | grep -v WARN
      (export PYTHONPATH="/tmp/hf:${PYTHONPATH:-$PWD}" && run "${PERF_S:-300}" prefill-32k-hf.txt python \
        .wheels/hf/hf_peer_bench.py 32768)
    fi
    if ls .wheels/tokamax-*.whl >/dev/null 2>&1; then
      # Profiled: where a long-context step's time goes (on an H100, 80 ms of kernels against 64 at
      # 1k context: the sparse MLA kernel +9 ms, the recurrence at batch 1 +4; docs/performance.md,
      # "Open", 2).
      run "${PERF_S:-300}" prefill-32k.txt python benchmarks/performance.py --batches 1 --context 32768 \
        --budget 8192 --steps 8 --profile /tmp/prof-32k --out "$out/prefill-32k.jsonl"
      # With a long-prefill cap of 256 too: all 32 prompts in each step, chains of 256 tokens (docs/engine.md).
      run "${PERF_S:-300}" budget-8192.txt python benchmarks/performance.py --batches 32 --budget 8192 --steps 8 \
        --long-prefill-token-threshold 0,256 --profile /tmp/prof-8192 --out "$out/budget-8192.jsonl" # the traces stay there: the rows carry their summaries
    fi
    ;;
  *)
    echo "unknown mode $mode: want correctness, matrix, suites, tune, kernels, timing, prefill, ab DIR or tokens DIR" >&2
    exit 2
    ;;
esac
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" && rm -rf "$out"
