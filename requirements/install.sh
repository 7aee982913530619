#!/bin/sh
# The one dependency installer: the README's set-up commands, .ci/run and the Dockerfile all run this script.
#
#   sh requirements/install.sh VENV LOCK [--editable]
#
# VENV       a virtual environment (python3 -m venv; the image's venv also sees the base image's torch stack)
# LOCK       requirements/verify.lock (the verifier alone: no torch), cpu.lock, test.lock or gpu.lock, installed
#            with --require-hashes: pip refuses any file whose SHA-256 is not in the lock and any dependency the
#            lock does not pin
# --editable install cvm-tune itself in development mode (README, CI); the image installs a copy of the tree
#
# With test.lock it then runs test-tools.sh: the programs the tests drive besides Python (Debian's chromium, node and
# npm, age: apt-get where missing) and the browser verifier's locked npm packages, into npm's cache.
#
# cvm-tune itself has no hash in a lock (it is the source tree being built); its code hash is in every manifest
# (code.source_sha256). Build isolation is off so that the build backend (setuptools) is the locked one.
set -eu
venv=$1
lock=$2
mode=${3:-}
pip() { "$venv/bin/python" -m pip --disable-pip-version-check "$@"; }
say() { echo "install.sh: $*" >&2; }
say "installing $lock into $venv, every file hash-checked (a first install downloads up to ~1 GB: minutes)"
pip install --quiet --require-hashes -r "$(dirname "$0")/pip.lock"  # a pip that handles extras under --require-hashes
pip install --quiet --require-hashes -r "$lock"
say "installing cvm-tune itself"
if [ "$mode" = "--editable" ]; then
    pip install --quiet --no-deps --no-build-isolation --editable .
else
    pip install --quiet --no-deps --no-build-isolation .
fi
pip check >&2
say "done: $venv"
if [ "$(basename "$lock")" = "test.lock" ]; then
    sh "$(dirname "$0")/test-tools.sh"
fi
