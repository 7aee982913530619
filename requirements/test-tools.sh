#!/bin/sh
# The programs outside Python that the test suite drives, installed where they are missing. install.sh runs this
# after installing requirements/test.lock, so the README's test command alone sets up a fresh machine.
#
#   sh requirements/test-tools.sh
#
# - Debian's chromium (the browser verifier's tests drive it; $CHROMIUM names another build), node and npm (they
#   rebuild the page), age (a bundle is decrypted with the standard tool as well): `apt-get install` where one is
#   missing, as root or through `sudo -n`; elsewhere the script stops and names what to install.
# - The page's locked npm packages (web/package-lock.json), into npm's cache: the tests install them from there
#   without the network. The checkout is not touched (the install runs in a scratch copy of the two package files).
set -eu
web="$(cd "$(dirname "$0")/../web" && pwd)"

missing=""
{ command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; } || missing="$missing nodejs npm"
[ -x "${CHROMIUM:-/usr/bin/chromium}" ] || missing="$missing chromium"
command -v age >/dev/null 2>&1 || missing="$missing age"
if [ -n "$missing" ]; then
    if [ "$(id -u)" = 0 ]; then
        as_root=""
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        as_root="sudo -n"
    else
        as_root="none"
    fi
    if ! command -v apt-get >/dev/null 2>&1 || [ "$as_root" = none ]; then
        echo "error: the tests need these programs:$missing" >&2
        echo "fix: install them (Debian: sudo apt-get install$missing), then run this command again" >&2
        exit 1
    fi
    echo "installing Debian packages:$missing (the tests drive them)" >&2
    $as_root apt-get update -qq >/dev/null
    # shellcheck disable=SC2086  # one word a package
    if ! $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null; then
        echo "error: apt-get install$missing failed" >&2
        echo "fix: install them by hand (sudo apt-get install$missing), then run this command again" >&2
        exit 1
    fi
fi

echo "filling npm's cache with web/'s locked packages" >&2
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT INT TERM
cp "$web/package.json" "$web/package-lock.json" "$scratch/"
if ! (cd "$scratch" && npm ci --prefer-offline --ignore-scripts --no-audit --no-fund --loglevel=error >/dev/null); then
    echo "error: npm ci of web/package-lock.json failed (the npm registry must be reachable once)" >&2
    echo "fix: check npm's registry setting (npm config get registry), then run this command again" >&2
    exit 1
fi
