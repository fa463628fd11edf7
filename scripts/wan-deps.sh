#!/usr/bin/env bash
# Debian packages the WAN testbed (benchmarks/wan.py) needs: iproute2 (ip netns, veth, bridge, tc tbf) and
# nftables (the rule that sends a worker's TCP connections to its delaying proxy). Installs what is missing
# when it can (root with apt-get); otherwise says what to install. `make bench-wan` runs it.
set -euo pipefail
missing=()
command -v ip >/dev/null && command -v tc >/dev/null || missing+=(iproute2)
command -v nft >/dev/null || missing+=(nftables)
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing Debian packages: ${missing[*]}"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
else
    echo "the WAN benchmark needs these Debian packages: ${missing[*]} (sudo apt-get install ${missing[*]})" >&2
    exit 1
fi
