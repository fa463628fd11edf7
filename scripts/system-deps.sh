#!/usr/bin/env bash
# Debian packages that the tests (default, or `tests`), the real-corpus benchmark (`real`) or the WAN testbed
# (`wan`) need, installed when missing where it can (root with apt-get); otherwise it says what to install.
#   tests: prometheus (prometheus, promtool) for the scrape test and the config and metrics checks, chromium
#          for the dashboard's browser test, tcpdump for the capture that shows TLS hides the token,
#          systemd (systemd-analyze) to verify deploy/systemd's units, iproute2 and nftables for the slow-link
#          test's network namespaces (tests/test_slow_link.py).
#          `make test` and `.ci/run` run it.
#   real:  fortunes (Debian's quotations: the corpus of benchmarks/real.py). `make bench-real` runs it.
#   wan:   iproute2 (ip netns, veth, bridge, tc tbf) and nftables (the rule that sends a worker's TCP
#          connections to its delaying proxy) for benchmarks/wan/. `make bench-wan` runs it.
set -euo pipefail
what=${1:-tests}
missing=()
case "$what" in
tests)
    command -v promtool >/dev/null && command -v prometheus >/dev/null || missing+=(prometheus)
    command -v chromium >/dev/null || missing+=(chromium)
    command -v tcpdump >/dev/null || missing+=(tcpdump)
    command -v systemd-analyze >/dev/null || missing+=(systemd)
    command -v ip >/dev/null && command -v tc >/dev/null || missing+=(iproute2)
    command -v nft >/dev/null || missing+=(nftables)
    ;;
real)
    [ -d /usr/share/games/fortunes ] || missing+=(fortunes)
    ;;
wan)
    command -v ip >/dev/null && command -v tc >/dev/null || missing+=(iproute2)
    command -v nft >/dev/null || missing+=(nftables)
    ;;
*)
    echo "usage: $0 [tests|real|wan]" >&2
    exit 2
    ;;
esac
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing Debian packages: ${missing[*]}"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
else
    echo "$what needs these Debian packages: ${missing[*]} (sudo apt-get install ${missing[*]})" >&2
    exit 1
fi
