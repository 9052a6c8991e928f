#!/usr/bin/env bash
# The wheel as a user builds it from a clean clone: `pip wheel .` (build isolation, the CPU
# transports only, so it takes minutes), then checks what it holds (the module, its type stubs, the
# reshard-run command, the license, the numpy dependency), installs it into a fresh virtual
# environment and runs a refit there, and checks that building left nothing in the source tree.
# Needs the python3 the README names (3.9 or later) and the package index pip uses.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
before=$(git status --porcelain --ignored | sort)
"$python" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --upgrade pip
"$tmp/venv/bin/python" -m pip wheel -q --no-deps -w "$tmp/wheels" \
  --config-settings=cmake.define.RESHARD_WITH_CUDA=OFF . >"$tmp/wheel.log" 2>&1 ||
  { tail -40 "$tmp/wheel.log"; exit 1; }
wheel=$(ls "$tmp"/wheels/reshard-*.whl)
contents=$("$tmp/venv/bin/python" -m zipfile -l "$wheel")
for wanted in "reshard/_core" "reshard/_core.pyi" "reshard/__init__.py" "reshard/launch.py" \
  "dist-info/entry_points.txt" "dist-info/licenses/LICENSE" "dist-info/METADATA"; do
  grep -q "$wanted" <<<"$contents" || { echo "the wheel lacks $wanted"; exit 1; }
done
"$tmp/venv/bin/python" -m pip install -q "$wheel"
"$tmp/venv/bin/python" -c "import importlib.metadata as m; assert any(r.startswith('numpy') for r in m.requires('reshard')), m.requires('reshard')"
command -v "$tmp/venv/bin/reshard-run" >/dev/null || { echo "the wheel installed no reshard-run"; exit 1; }
cat >"$tmp/refit.py" <<'PY'
import numpy as np
import reshard

svc = reshard.CopyService("host").init("WARN")
me = svc.my_pe
src = np.arange(64, dtype=np.uint8) + me
dst = np.zeros(64, dtype=np.uint8)
svc.register_send(1 + me, src, 0, 64, (me + 1) % svc.n_pes)
svc.register_receive(1 + (me - 1) % svc.n_pes, dst, 0, 64, (me - 1) % svc.n_pes)
svc.schedule()
svc.run()
assert np.array_equal(dst, np.arange(64, dtype=np.uint8) + (me - 1) % svc.n_pes)
print(f"PE {me}: ok")
svc.finalize()
PY
(cd "$tmp" && "$tmp/venv/bin/reshard-run" -n 2 --timeout 120 refit.py) | grep -c ": ok" |
  grep -qx 2 || { echo "the installed wheel's refit failed"; exit 1; }
after=$(git status --porcelain --ignored | sort)
if [[ "$before" != "$after" ]]; then
  echo "building the wheel left files in the source tree:"
  diff <(echo "$before") <(echo "$after") | head -20
  exit 1
fi
echo "wheel check: $(basename "$wheel") builds, holds the module, stubs, reshard-run, LICENSE and the numpy dependency, and refits when installed"
