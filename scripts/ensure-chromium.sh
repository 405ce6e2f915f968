#!/usr/bin/env bash
# Make sure a headless Chromium is available for the timeline's browser test
# (tests/integration/test_failover_view.py). Installs Debian's chromium when
# missing, as root. When it cannot be installed it says why and exits 0: that
# test is then skipped, naming the reason.
set -uo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "chromium is not installed and this is not root: install Debian's chromium, or the timeline's browser test will be skipped" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends chromium >/dev/null; }; then
    echo "could not install Debian's chromium with apt-get: the timeline's browser test will be skipped" >&2
    exit 0
fi
command -v chromium >/dev/null || echo "chromium installed but not on PATH: the timeline's browser test will be skipped" >&2
