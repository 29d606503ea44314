#!/usr/bin/env bash
# Optional: the anchors that `kvpool bench store` measures side by side with kvpool
# (Mooncake Store, Redis) and the veth layout. The tests skip them when absent.
set -euo pipefail
apt-get update -q
apt-get install -y -q libibverbs1 redis-server iproute2
python3 -m pip install -q mooncake-transfer-engine-non-cuda==0.3.13.post1
