#!/usr/bin/env bash
# The GPU test suite (`pytest -m gpu`), one share of it a device call: `bash benchmarks/gpu_tests.sh K/N`
# runs the K-th of N shares, cut by the time each test took on the device (tests/gpu_durations.json; a
# test not in it counts as the median), so each share ends well inside a call's 10 minutes. N = 3 today.
# Before the tests it makes the device what the tests expect, from .whl/ (`bash benchmarks/device_wheels.sh`,
# carried with `carry: [".whl"]`): the pipeline's imports, the serving stack and the pinned SGLang sdist, the
# toolchain wheels (ninja, CUTLASS's headers). What is missing there is skipped by the tests, and says so.
# Logs, the junit XML (each test's time) and the summary go to $OUT (default /tmp/gpu-tests);
# `python benchmarks/gpu_durations.py $OUT/*.xml` then folds the times into tests/gpu_durations.json.
#   PACK=$OUT bash benchmarks/gpu_tests.sh 1/3      (a device call; LIMIT, default 560 s, bounds pytest)
#   bash benchmarks/gpu_tests.sh 1/1 tests/test_problems.py::test_x ...   (named tests instead of a share)
set -u
share=${1:?usage: gpu_tests.sh K/N [test ids...]}
shift
OUT=${OUT:-/tmp/gpu-tests}
mkdir -p "$OUT"
tag=${share/\//-of-}
log="$OUT/gpu-tests-$tag.log"
{
  echo "== $(date -u +%FT%TZ) share $share on $(nvidia-smi -L 2>/dev/null | head -1)"
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl
  fi
  if ls .whl/serving/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/serving/*.whl
  fi
} > "$log" 2>&1
export PYTHONPATH=/root/site PYTHONUNBUFFERED=1
{
  if ls .whl/serving/sglang-*.tar.gz >/dev/null 2>&1; then
    python3 -m pipeline serving fetch --sdist "$(ls .whl/serving/sglang-*.tar.gz | head -1)"
  fi
  bash benchmarks/toolchains_setup.sh
} >> "$log" 2>&1
# SIGINT at the limit: pytest stops as on Ctrl-C and still writes the junit XML of the tests that ran
PATH="/root/tc-site/bin:$PATH" timeout -s INT -k 20 "${LIMIT:-560}" python3 -m pytest -m gpu -p no:cacheprovider -q -rA \
  --durations=0 --shard "$share" --junitxml "$OUT/gpu-tests-$tag.xml" "$@" >> "$log" 2>&1
rc=$?
echo "== pytest exit $rc ($(date -u +%FT%TZ))" >> "$log"
tail -n 40 "$log"
exit $rc
