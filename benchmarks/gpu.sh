#!/usr/bin/env bash
# The one entry point for GPU work: a suite a device call (10 minutes at most), its logs under $OUT, each
# step with its own limit and log, written as it runs (a step cut at its limit still leaves its log).
#
#   bash benchmarks/gpu.sh tests K/N [TEST_ID...]   the `gpu` tests, the K-th of N shares cut by measured time
#                                                    (tests/gpu_durations.json), or the named tests (K/N = 1/1)
#   bash benchmarks/gpu.sh fidelity [PROBLEM...]     the baseline against itself, 5 evaluations (default: the
#                                                    projection and the MoE), then one official evaluation's wall time
#   bash benchmarks/gpu.sh solutions [PROBLEM...]    the organizers' solutions through the official method (default:
#                                                    all five), then their stress test; TUNE_S=N searches each first
#                                                    (N seconds, written into its CONFIGS: keep the files)
#   bash benchmarks/gpu.sh baselines                 the MoE baseline against SGLang's own kernels (the adapter in a
#                                                    graph, both timed, ours scored against SGLang's); TUNE=1 first
#                                                    re-tunes the baseline's block configurations for this card
#   bash benchmarks/gpu.sh profile PROBLEM           where a solution's time goes, kernel by kernel, beside its
#                                                    baseline, and the read ceiling of the memory-bound workloads
#   bash benchmarks/gpu.sh serving                   the serving judge on a real engine (transformers serve, a
#                                                    random-weight model): the baseline against itself, B C C B
#   bash benchmarks/gpu.sh toolchains                each toolchain's example through the evaluator, with compile times
#   bash benchmarks/gpu.sh faults                    the fault matrix's GPU rows, the health check before and after
#   bash benchmarks/gpu.sh method                    the timing method's own experiments, to rerun on a new card:
#                                                    noise sources, L2 flush methods, the launch guard, the BLAS
#                                                    workspace, the transport's copy rate, the sandbox with CUDA,
#                                                    programmatic dependent launch against the fence
#
# Wheels for what the device image lacks come from .whl/ (`bash benchmarks/device_wheels.sh`; carry it with
# `carry: [".whl"]`). The device returns at most 8 files: with PACK set (the device's $OUT), logs go under
# /tmp/gpu-run and are packed into $PACK/gpu.tgz after every step:   PACK=$OUT bash benchmarks/gpu.sh solutions
# docs/BENCHMARKS.md keeps the figures, each with the suite that measured it.
set -u
suite=${1:?usage: gpu.sh tests|fidelity|solutions|baselines|profile|serving|toolchains|faults|method [ARGS...]}
shift
if [ -n "${PACK:-}" ]; then OUT=/tmp/gpu-run; fi
OUT=${OUT:-/tmp/gpu-run}
mkdir -p "$OUT"
SDIST=$(ls .whl/serving/sglang-*.tar.gz 2>/dev/null | head -1)
{
  echo "== $(date -u +%FT%TZ) $suite $* on $(nvidia-smi -L 2>/dev/null | head -1)"
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl
  fi
} >> "$OUT/steps.log" 2>&1
export PYTHONPATH=/root/site PYTHONUNBUFFERED=1
step() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s) $(date -u +%H:%M:%S)" | tee -a "$OUT/steps.log"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $(date -u +%H:%M:%S)" | tee -a "$OUT/steps.log"
  tail -n 15 "$OUT/$name.log"
  if [ -n "${PACK:-}" ]; then tar -czf "$PACK/gpu.tgz" -C "$OUT" .; fi
  return $rc
}
serving_stack() {  # the serving wheels into the interpreter itself (a sandboxed server runs it) and the pinned tree
  step serving-install 150 bash -c 'python3 -m pip install -q --no-index --no-deps --no-compile .whl/serving/*.whl \
    && python3 -m pipeline serving fetch --sdist "$0"' "$SDIST"
}
official() {  # PROBLEM TIMEOUT [official_eval.py options...]: one official evaluation, its step 10 s longer
  local p=$1 t=$2; shift 2
  step "$p${*// /}" $((t + 10)) python3 benchmarks/official_eval.py --problem "$p" --timeout "$t" "$@" \
    --json "$OUT/$p${*// /}.json"
}
case $suite in
  tests)
    share=${1:?usage: gpu.sh tests K/N [TEST_ID...]}
    shift
    tag=${share/\//-of-}
    { [ -n "$SDIST" ] && serving_stack; bash benchmarks/toolchains_setup.sh; } >> "$OUT/steps.log" 2>&1
    # SIGINT at the limit: pytest stops as on Ctrl-C and still writes the junit XML of the tests that ran
    # (`python benchmarks/gpu_durations.py $OUT/*.xml` folds their times into tests/gpu_durations.json)
    PATH="/root/tc-site/bin:$PATH" timeout -s INT -k 20 "${LIMIT:-560}" python3 -m pytest -m gpu -p no:cacheprovider \
      -q -rA --durations=0 --shard "$share" --junitxml "$OUT/gpu-tests-$tag.xml" "$@" > "$OUT/gpu-tests-$tag.log" 2>&1
    rc=$?
    echo "== pytest exit $rc ($(date -u +%FT%TZ))" >> "$OUT/gpu-tests-$tag.log"
    tail -n 40 "$OUT/gpu-tests-$tag.log"
    exit $rc ;;
  fidelity)
    [ $# -gt 0 ] || set -- muse_bf16_proj muse_moe_w4a16
    for p in "$@"; do
      step "fidelity-$p" 420 python3 benchmarks/repeatability.py --as-baseline --problem "$p" --runs 5 \
        --json "$OUT/fidelity-$p.json"
    done
    for p in "$@"; do official "$p" 170 --as-baseline; done ;;
  solutions)
    [ $# -gt 0 ] || set -- muse_bf16_proj muse_attention_decode muse_moe_w4a16 muse_decode_layer muse_prefill_layer
    for p in "$@"; do
      if [ -n "${TUNE_S:-}" ] && [ "$p" != muse_decode_layer ]; then
        step "tune-$p" $((TUNE_S + 40)) python3 benchmarks/tune_solutions.py "$p" --write --seconds 0.1 \
          --budget "$TUNE_S" --json "$OUT/tune-$p.json"
        cp -r "solutions/$p" "$OUT/solution-$p" 2>/dev/null
      fi
      if [ "$p" = muse_decode_layer ]; then python3 solutions/build_layers.py >> "$OUT/steps.log" 2>&1; fi
      official "$p" 160 --solutions
    done
    step stress 200 python3 benchmarks/stress_solutions.py --json "$OUT/stress.json" ;;
  baselines)
    serving_stack
    if [ -n "${TUNE:-}" ]; then
      step tune-moe-decode 220 python3 benchmarks/tune_fused_moe.py --write --m 1 --m 16 --m 32 \
        --json "$OUT/tune-moe-decode.json"
      step tune-moe-prefill 210 python3 benchmarks/tune_fused_moe.py --write --m 2048 --m 4096 --m 8192 \
        --seconds 0.25 --json "$OUT/tune-moe-prefill.json"
      cp reference/configs/fused_moe_w4a16.json "$OUT/"
    fi
    step sglang-gpu-tests 150 python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests/test_sglang_baseline.py
    step sglang-kernels 240 python3 benchmarks/sglang_kernels.py --quick --seconds 0.15 --m 16 --m 32 --json "$OUT/sglang-kernels.json"
    official muse_moe_w4a16 210 --as-baseline --baseline sglang --seeds 2 ;;
  profile)
    p=${1:?usage: gpu.sh profile PROBLEM}
    step "breakdown-$p" 120 python3 benchmarks/kernel_breakdown.py --problem "$p" --json "$OUT/breakdown-$p.json"
    if [ "$p" = muse_moe_w4a16 ]; then
      step moe-breakdown 120 python3 benchmarks/moe_breakdown.py --solution --m 1 --m 16 --m 32 --calls 40
    fi
    step read-ceiling 200 python3 benchmarks/read_ceiling.py --json "$OUT/read-ceiling.json" ;;
  serving)
    # transformers serve with a random-weight Qwen3-0.6B-shaped model; the baseline served against itself
    # (benchmarks/serving_noop.diff, a comment); DATASET default .whl/serving/smoke-64.json.gz = `python -m
    # pipeline serving dataset generate --conversations 64 --seed 7 --shape smoke --window 40960`
    serving_stack
    step serving-tokenizer 60 python3 -m pipeline serving tokenizer
    step serving-model 120 python3 benchmarks/serving_model.py /tmp/serving-model --device cuda
    PIPELINE_SERVING_MODEL=/tmp/serving-model step serving-eval 480 python3 -m pipeline serving evaluate \
      benchmarks/serving_noop.diff --launch transformers --dataset "${DATASET:-.whl/serving/smoke-64.json.gz}" \
      --levels "${LEVELS:-1,4,16,32}" --window-s "${WINDOW_S:-15}" --warmup-s "${WARMUP_S:-5}" --runs 1 \
      --gsm8k-questions "${GSM8K_Q:-16}" --gsm8k-max-tokens 256 --json "$OUT/serving.json" ;;
  toolchains)
    step toolchains-env 120 bash benchmarks/toolchains_setup.sh
    PATH="/root/tc-site/bin:$PATH" PIPELINE_TOOLCHAINS_REPORT="$OUT/toolchains.jsonl" step toolchains 420 \
      python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests/test_toolchains.py ;;
  faults)
    step health-before 60 python3 -m pipeline runner health --device cuda
    step faults-gpu 480 python3 -m pytest -v -p no:cacheprovider -rA -m gpu tests/test_faults.py
    step health-after 60 python3 -m pipeline runner health --device cuda ;;
  method)
    step sandbox-check 60 python3 -m pipeline sandbox-check --device cuda
    step transport 90 python3 benchmarks/transport.py --gb 1.5 --repeats 5 --json "$OUT/transport.json"
    step noise 150 python3 benchmarks/noise_sources.py --json "$OUT/noise.json"
    step flush 120 python3 benchmarks/flush_methods.py --json "$OUT/flush.json"
    for i in 1 2 3; do step guard$i 40 python3 benchmarks/launch_guard.py --json "$OUT/guard$i.json"; done
    step guard-compare 30 python3 benchmarks/launch_guard.py --compare "$OUT"/guard?.json
    step workspace 60 python3 benchmarks/blas_workspace.py --json "$OUT/workspace.json"
    step pdl-fence 240 python3 benchmarks/pdl_fence.py --json "$OUT/pdl-fence.json" ;;
  *) echo "unknown suite $suite: tests fidelity solutions baselines profile serving toolchains faults method" >&2
     exit 2 ;;
esac
