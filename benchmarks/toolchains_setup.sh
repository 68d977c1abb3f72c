#!/usr/bin/env bash
# The first half of `bash benchmarks/gpu.sh toolchains` (and of its `tests` suite): what this GPU machine has to build a
# submission with, and the toolchain wheels brought in .whl/toolchains/ made importable the way a
# worker imports (`python -I` ignores PYTHONPATH, so a .pth file in the interpreter's own site-packages
# names the folder they are installed in; the sandbox binds every folder on the evaluator's sys.path).
# Prints everything it finds; a missing toolchain is said, never an error: the tests skip what is missing.
set -u
echo "python: $(command -v python3) $(python3 -V 2>&1)"
nvidia-smi -L 2>&1 | head -2
echo "which nvcc: $(command -v nvcc || echo 'none on PATH')"
for nvcc in "$(command -v nvcc)" /usr/local/cuda/bin/nvcc "${CUDA_HOME:-/nonexistent}/bin/nvcc"; do
  if [ -n "$nvcc" ] && [ -x "$nvcc" ]; then echo "nvcc --version ($nvcc):"; "$nvcc" --version | tail -2; break; fi
done
echo "ninja: $(command -v ninja || echo 'none on PATH') $(ninja --version 2>/dev/null)"
echo "c++: $(command -v c++ || echo 'none') $(c++ --version 2>/dev/null | head -1)"
SITE=/root/tc-site
if ls .whl/toolchains/*.whl >/dev/null 2>&1; then
  echo "installing into $SITE: $(cd .whl/toolchains && ls *.whl | tr '\n' ' ')"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/toolchains/*.whl
  pth="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/muse-toolchains.pth"
  echo "$SITE" > "$pth" && echo "wrote $pth"
else
  echo "no wheels in .whl/toolchains/"
fi
echo "the evaluator's probe (environment.toolchains), with $SITE/bin on PATH:"
PATH="$SITE/bin:$PATH" python3 -c "
import json
from pipeline.kernel import toolchains
found = toolchains.probe()
print(json.dumps(found, indent=1))
print(toolchains.describe(found))"
