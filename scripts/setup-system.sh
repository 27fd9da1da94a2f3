#!/usr/bin/env bash
# System packages the tests need: redis-server, redis-cli and redis-benchmark (Debian's
# redis-server and redis-tools), and, where root can install it, iproute2 (the cross-host
# tests' network namespaces; they say why they cannot run without it). Idempotent:
# nothing happens when they are present.
set -euo pipefail

need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v redis-cli >/dev/null && command -v redis-benchmark >/dev/null || need+=(redis-tools)
if ! command -v ip >/dev/null && ! [[ -x /usr/sbin/ip ]] && [[ $(id -u) -eq 0 ]]; then
    need+=(iproute2)
fi
((${#need[@]})) || exit 0

if [[ $(id -u) -eq 0 ]]; then
    sudo=()
elif command -v sudo >/dev/null; then
    sudo=(sudo -n)
else
    echo "setup-system: ${need[*]} missing and no root to install them; install them and run again" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null; then
    echo "setup-system: ${need[*]} missing; install them with your package manager (Debian: apt-get)" >&2
    exit 1
fi
echo "setup-system: installing ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# The package starts a server on port 6379; the tests start their own on free ports.
"${sudo[@]}" systemctl disable --now redis-server >/dev/null 2>&1 || "${sudo[@]}" service redis-server stop >/dev/null 2>&1 || true
