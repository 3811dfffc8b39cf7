#!/bin/sh
# Installs gpuckpt into an engine image's own Python, and replaces nothing the engine installed.
# Run by the worker Containerfiles beside it, as root, at build time:
#
#   install-gpuckpt.sh ENGINE SOURCE VERSION
#
# ENGINE is the engine's distribution (vllm, sglang): gpuckpt goes into the Python that has it,
# the one the engine runs and loads gpuckpt's adapter from (PYTHON names it where `python3` is
# not). SOURCE is gpuckpt's source tree (or a wheel), VERSION the version it must install (the
# image's labels say it).
#
# Why nothing may be replaced: torch must stay the image's own CUDA build. The engine's compiled
# kernels (vLLM's, sgl-kernel, flashinfer) are built against that torch and its CUDA libraries;
# PyPI's torch is another build (another CUDA, another ABI), and pip swapping it in breaks them or
# changes the CUDA runtime the KV cache is computed with. gpuckpt asks only for torch>=2.4 so
# that the engine's torch satisfies it. Here the engine, its torch, numpy and the CUDA packages
# are constraints of the install, at exactly their installed versions: pip may add gpuckpt's own
# dependencies but can change none of these — a requirement that would has the build fail, with
# pip's message — and the build fails too if one of them is not as it was afterwards.
set -eu

if [ "$#" -ne 3 ]; then
    echo "usage: install-gpuckpt.sh ENGINE SOURCE VERSION" >&2
    exit 2
fi
engine=$1
source=$2
version=$3
python=${PYTHON:-python3}

fail() {
    echo "install-gpuckpt.sh: $*" >&2
    exit 1
}

# From /: Python puts the working directory first on its path, and a builder's WORKDIR (an engine
# image's workspace, a source tree) could hold metadata that would answer for the installed one.
case $source in /*) ;; *) source=$PWD/$source ;; esac
cd /

# The engine images install into their distribution's Python; pip refuses that where the image
# kept the EXTERNALLY-MANAGED marker (PEP 668), and installing beside the engine is the point.
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$python" -m pip list --format=freeze >"$work/before"
# The engine and what its kernels are built against. The rest of the image (Debian's own Python
# packages among them) is left to pip's only-if-needed rule: pinning all of it would refuse
# harmless upgrades of packages no kernel links against.
kept="${engine}|torch|torchvision|torchaudio|triton|pytorch[-_.]triton|numpy|xformers"
kept="$kept|flashinfer([-_.][a-z0-9]+)*|sgl[-_.]kernel|sglang[-_.]kernel"
kept="$kept|nvidia[-_.][a-z0-9_.-]+|cuda[-_.][a-z0-9_.-]+"
grep -iE "^($kept)==" "$work/before" >"$work/kept" || true
grep -qiE "^${engine}==" "$work/kept" || fail "$engine is not installed in $python: not the engine's Python (PYTHON)"
grep -qiE "^torch==" "$work/kept" || fail "torch is not installed in $python"

echo "install-gpuckpt.sh: kept as installed:"
sed 's/^/  /' "$work/kept"

"$python" -m pip install --no-cache-dir --constraint "$work/kept" "$source" ||
    fail "pip cannot install gpuckpt without replacing one of the packages kept above (pip says which)"

"$python" -m pip list --format=freeze >"$work/after"
if grep -vxF -f "$work/after" "$work/kept" >"$work/changed"; then
    fail "the install changed what the engine installed: $(tr '\n' ' ' <"$work/changed")"
fi

installed=$("$python" -c 'import importlib.metadata as m; print(m.version("gpuckpt"))')
[ "$installed" = "$version" ] || fail "installed gpuckpt $installed, not $version (GPUCKPT_VERSION)"
# The command the pod's preStop runs: on the image's PATH, and importing in the engine's Python.
command -v gpuckpt >/dev/null || fail "gpuckpt is not on PATH ($PATH)"
gpuckpt --help >/dev/null
echo "install-gpuckpt.sh: gpuckpt $installed installed beside $(grep -iE "^${engine}==" "$work/kept")"
