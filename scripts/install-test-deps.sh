#!/usr/bin/env bash
# Debian packages that tests run for real (not Python packages: those are in pyproject.toml).
# Idempotent and quick when everything is present (no apt-get call at all). Run by `make test`.
#
#   prometheus   /usr/bin/prometheus 2.42: tests/fault/test_prometheus.py runs every Grafana
#                dashboard query against it (it skips, naming this script, if the binary is absent)
#   chromium     /usr/bin/chromium: tests/distributed/test_report_browser.py opens `megascale report`
#                in headless Chromium through Playwright (the `playwright` Python package, in the
#                dev extra; never `playwright install`, which downloads a browser build)
#   chromium-driver  /usr/bin/chromedriver, for WebDriver-based checks of the same pages
#   nftables     /usr/sbin/nft: tests/cluster's network faults (partition, cut, loss) between hosts
#                made of network namespaces (tests/cluster/netns_hosts.py)
#   iptables     /usr/sbin/iptables: tests/cluster's delay fault (the xt NFQUEUE target; this
#                kernel's nftables has no queue expression)
#   slurmctld, slurmd, slurm-client, munge   Slurm 22.05 across tests/cluster's hosts
#                (tests/cluster/slurm_hosts.py, test_slurm.py: srun + torchrun); no daemon is
#                started by the install (the tests start and stop their own)
#
# Add a package as "BINARY:PACKAGE" to NEEDED. --no-install-recommends keeps prometheus to one
# package (its recommends pull ~35 more: node exporter, ipmitool, smartmontools, JS libraries).
# Without apt-get, or without root/sudo, it warns and exits 0: the tests that need the binary
# then skip with a reason. Set MEGASCALE_REQUIRE_TEST_DEPS=1 (CI) to make that an error instead.
set -euo pipefail

NEEDED=(
    "prometheus:prometheus"
    "chromium:chromium"
    "chromedriver:chromium-driver"
    "nft:nftables"
    "iptables:iptables"
    "slurmctld:slurmctld"
    "slurmd:slurmd"
    "srun:slurm-client"
    "munged:munge"
)

missing=()
for entry in "${NEEDED[@]}"; do
    binary=${entry%%:*}
    package=${entry#*:}
    if ! command -v "$binary" >/dev/null 2>&1 && [ ! -x "/usr/bin/$binary" ] \
        && [ ! -x "/usr/sbin/$binary" ]; then
        missing+=("$package")
    fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

fail() {
    echo "install-test-deps: $1; tests needing ${missing[*]} will skip" >&2
    [ "${MEGASCALE_REQUIRE_TEST_DEPS:-0}" = 1 ] && exit 1
    exit 0
}

command -v apt-get >/dev/null 2>&1 || fail "no apt-get to install ${missing[*]}"
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
    else
        fail "not root and no password-less sudo to install ${missing[*]}"
    fi
fi
echo "install-test-deps: apt-get install ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -q >/dev/null || fail "apt-get update failed"
"${SUDO[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null \
    || fail "apt-get install ${missing[*]} failed"
