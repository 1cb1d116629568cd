#!/usr/bin/env bash
# Builds the real Kubernetes CRD API server (k8s.io/apiextensions-apiserver) from Debian's own Go
# sources and the glue in this folder (main.go), for tests/k8s/test_apiserver.py.
#
#   tests/k8s/apiserver/build.sh            the cached binary's path; builds it first if the cache
#                                           has none for this glue (run by `make test`)
#   tests/k8s/apiserver/build.sh --check    the cached binary's path, or exit 1 saying why (no
#                                           network; what the test fixture runs)
#   tests/k8s/apiserver/build.sh --rebuild  resolve the packages again (Debian sid moves) and build
#                                           if their versions changed
#
# Nothing is installed system-wide: apt runs with private state dirs pointing at Debian sid
# (signed by the Debian archive keyring), resolves the closure of
# golang-k8s-apiextensions-apiserver-dev, downloads its golang-*-dev packages plus Debian's Go
# (~270 MB) and extracts them with `dpkg-deb -x` (~2.3 GB, deleted after the build). The build is
# GOPATH mode and offline (GO111MODULE=off GOPROXY=off).
#
# Cache: ${MEGASCALE_CACHE:-~/.cache/megascale}/apiserver/<glue>-<packages>/apiextensions-apiserver
# (~90 MB), <glue> a hash of main.go and this script, <packages> a hash of the resolved package
# versions (Go's among them, listed in packages.txt beside the binary). A cold build takes a few
# minutes on 2 cores (1.3 GB peak RSS); a warm call only looks the binary up.
#
# On failure: one line on stderr (kept for --check in last-error) and exit 1.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
CACHE=${MEGASCALE_CACHE:-$HOME/.cache/megascale}/apiserver
MIRROR=${MEGASCALE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
ROOT_PKG=golang-k8s-apiextensions-apiserver-dev

die() {
    mkdir -p "$CACHE"
    echo "apiserver build: $*" | tee "$CACHE/last-error" >&2
    exit 1
}

glue_hash() { cat "$HERE/main.go" "$HERE/build.sh" | sha256sum | cut -c1-16; }

cached() { ls -t "$CACHE"/"$(glue_hash)"-*/apiextensions-apiserver 2>/dev/null | head -1; }

case "${1:-}" in
    --check)
        bin=$(cached || true)
        [ -n "$bin" ] && { echo "$bin"; exit 0; }
        cat "$CACHE/last-error" 2>/dev/null >&2 || echo "apiserver build: not built yet" >&2
        exit 1 ;;
    --rebuild) ;;
    "")
        bin=$(cached || true)
        [ -n "$bin" ] && { echo "$bin"; exit 0; } ;;
    *) echo "usage: $0 [--check|--rebuild]" >&2; exit 2 ;;
esac

command -v apt-get >/dev/null || die "no apt-get (Debian's Go sources come from apt)"
command -v dpkg-deb >/dev/null || die "no dpkg-deb"
[ -r "$KEYRING" ] || die "no Debian archive keyring at $KEYRING"
[ "$(id -u)" -eq 0 ] || die "not root (apt with private state dirs needs root here)"

APT="$CACHE/apt"
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/etc/preferences.d" "$APT/debs"
echo "deb [signed-by=$KEYRING] $MIRROR sid main" >"$APT/etc/sources.list"
: >"$APT/status"
APT_OPTS=(
    -o "Dir::Etc::SourceList=$APT/etc/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
    -o "Dir::Etc::PreferencesParts=$APT/etc/preferences.d"
    -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT/cache" -o "Dir::State::status=$APT/status"
    -o "Debug::NoLocking=1" -o "APT::Install-Recommends=0" -o "Acquire::Languages=none"
)
# Refresh the lists at most once a day: a warm run with a cached binary pays nothing.
if [ -z "$(find "$APT/lists" -maxdepth 1 -name '*Packages*' -mmin -1440 2>/dev/null | head -1)" ]; then
    apt-get "${APT_OPTS[@]}" update -q >"$APT/update.log" 2>&1 \
        || die "apt-get update of Debian sid failed (see $APT/update.log)"
fi
apt-get "${APT_OPTS[@]}" -s install "$ROOT_PKG" golang-go >"$APT/resolve.log" 2>&1 \
    || die "cannot resolve $ROOT_PKG in Debian sid (see $APT/resolve.log)"
# "Inst name (version sid [arch])": the Go libraries and the Go toolchain, nothing else.
mapfile -t PKGS < <(awk '/^Inst /{v=$3; gsub(/[()]/,"",v); print $2"="v}' "$APT/resolve.log" \
    | grep -E '^(golang-.*-dev|golang-1\.[0-9]+-(go|src))=' | sort)
[ ${#PKGS[@]} -gt 0 ] || die "empty package closure (see $APT/resolve.log)"
GOPKG=$(printf '%s\n' "${PKGS[@]}" | grep -E '^golang-1\.[0-9]+-go=' | head -1)
[ -n "$GOPKG" ] || die "no golang-1.NN-go in the closure"
GOVER=${GOPKG%%=*}; GOVER=${GOVER#golang-}; GOVER=${GOVER%-go}

KEY="$(glue_hash)-$(printf '%s\n' "${PKGS[@]}" | sha256sum | cut -c1-16)"
OUT="$CACHE/$KEY"
if [ -x "$OUT/apiextensions-apiserver" ]; then echo "$OUT/apiextensions-apiserver"; exit 0; fi

echo "apiserver build: ${#PKGS[@]} packages, Go $GOVER, cache key $KEY (a few minutes, once)" >&2
(cd "$APT/debs" && apt-get "${APT_OPTS[@]}" download -q "${PKGS[@]}" >"$APT/download.log" 2>&1) \
    || die "downloading the packages failed (see $APT/download.log)"

WORK=$(mktemp -d "$CACHE/build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
for pkg in "${PKGS[@]}"; do
    name=${pkg%%=*}
    deb=$(ls "$APT/debs/${name}"_*.deb | sort -V | tail -1)
    dpkg-deb -x "$deb" "$WORK/root"
done
mkdir -p "$WORK/glue/src/megascale.test/apiserver"
cp "$HERE/main.go" "$WORK/glue/src/megascale.test/apiserver/"
GOROOT="$WORK/root/usr/lib/go-$GOVER"
[ -x "$GOROOT/bin/go" ] || die "no go binary in $GOPKG"
(
    cd "$WORK/glue/src/megascale.test/apiserver"
    env GO111MODULE=off GOPROXY=off GOTOOLCHAIN=local CGO_ENABLED=0 \
        GOROOT="$GOROOT" GOPATH="$WORK/glue:$WORK/root/usr/share/gocode" \
        GOCACHE="$WORK/gocache" HOME="$WORK" \
        "$GOROOT/bin/go" build -trimpath -ldflags=-s -o "$WORK/apiextensions-apiserver" .
) >"$CACHE/build.log" 2>&1 || die "go build failed (see $CACHE/build.log)"
rm -f "$CACHE/last-error"
mkdir -p "$OUT"
printf '%s\n' "${PKGS[@]}" >"$OUT/packages.txt"
mv "$WORK/apiextensions-apiserver" "$OUT/apiextensions-apiserver"
# Older keys of the same glue are stale once a new one is built.
find "$CACHE" -maxdepth 1 -name "$(glue_hash)-*" ! -name "$KEY" -exec rm -rf {} +
echo "$OUT/apiextensions-apiserver"
