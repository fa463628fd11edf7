#!/usr/bin/env bash
# Debian packages the tests use: prometheus (prometheus, promtool) for the scrape test and the config and
# metrics checks, chromium for the dashboard's browser test. Installs what is missing when it can (root
# with apt-get); otherwise says what to install. `make test` and `.ci/run` run it.
set -euo pipefail
missing=()
command -v promtool >/dev/null && command -v prometheus >/dev/null || missing+=(prometheus)
command -v chromium >/dev/null || missing+=(chromium)
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing Debian packages: ${missing[*]}"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
else
    echo "the tests need these Debian packages: ${missing[*]} (sudo apt-get install ${missing[*]})" >&2
    exit 1
fi
