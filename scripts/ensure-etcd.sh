#!/usr/bin/env bash
# Make sure an etcd server binary (v3 API, 3.4+) is available for the tests.
# Installs Debian's etcd-server when missing; never starts a system service.
set -euo pipefail
if command -v etcd >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "etcd is not installed and this is not root: install Debian's etcd-server, or etcd tests will be skipped" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
# Keep the package's post-install script from starting a system-wide etcd.
created_policy=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    created_policy=1
fi
trap '[ "$created_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d' EXIT
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends etcd-server >/dev/null
command -v etcd >/dev/null
