#!/usr/bin/env bash
# The remote-tier tests (tests/test_remote_redis.py) start their own redis-server on a free
# loopback port and fail without the binary. Install Debian's package when it is missing;
# nothing else is started or configured here. Idempotent.
set -euo pipefail
command -v redis-server >/dev/null && exit 0
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server >/dev/null
command -v redis-server >/dev/null
