#!/usr/bin/env bash
# The Debian tools the suite needs and does not pip-install: redis-server (tests/test_remote_redis.py
# and the fleet tests start their own on a free loopback port and fail without the binary),
# setfacl (the acl package: tests/test_deploy_trust.py sets real POSIX ACLs on a trust-group
# volume) and qemu-aarch64-static (qemu-user-static: tests/test_spark_emulated.py and the DGX Spark
# recipe run an aarch64 Python as a DGX Spark's host would). Installs what is missing; nothing
# else is started or configured here. Idempotent.
set -euo pipefail
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v setfacl >/dev/null || missing+=(acl)
command -v qemu-aarch64-static >/dev/null || missing+=(qemu-user-static)
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
command -v redis-server >/dev/null && command -v setfacl >/dev/null && command -v qemu-aarch64-static >/dev/null
