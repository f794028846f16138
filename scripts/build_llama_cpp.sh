#!/usr/bin/env bash
# Build llama.cpp's speculative-decoding binaries, pinned to the llama.cpp that llama-cpp-python vendors,
# for `ouroboros-local bench --peers llama.cpp --llama-cpp-bin DIR`.
#
# The sources come from llama-cpp-python's sdist (it ships the llama.cpp tree under vendor/llama.cpp),
# so the binaries and our Python bindings run the same llama.cpp. Everything is downloaded and built
# OUTSIDE this repository (default: $OUROBOROS_CACHE/llama.cpp-<version>, else
# ${XDG_CACHE_HOME:-~/.cache}/ouroboros-local/llama.cpp-<version>); no llama.cpp code is ever copied into the repo.
#
# Usage:
#   scripts/build_llama_cpp.sh [--backend cpu|cuda|metal|vulkan] [--prefix DIR] [--jobs N]
#                              [--version X.Y.Z] [--sdist FILE.tar.gz] [--src DIR] [--server]
#                              [--configure-only] [--dry-run]
#
#   --backend cpu     (default) -DGGML_NATIVE=ON: tuned for this CPU (not portable to older CPUs)
#   --backend cuda    adds -DGGML_CUDA=ON (needs the CUDA toolkit; set CMAKE_CUDA_ARCHITECTURES=native or
#                     e.g. 90 for H100 through CMAKE_ARGS to shorten the build)
#   --backend metal   adds -DGGML_METAL=ON (the default on macOS anyway; Apple Silicon)
#   --backend vulkan  adds -DGGML_VULKAN=ON (needs the Vulkan SDK / glslc)
#   --configure-only  fetch the sources and run CMake's configure step, build nothing
#   --server          also build llama-server (pulls in the multimodal library: ~3 more minutes on 2 cores)
#   --sdist FILE      use an already downloaded llama_cpp_python-X.Y.Z.tar.gz instead of `pip download`
#   --src DIR         use an already extracted llama.cpp source tree
#   CMAKE_ARGS="..."  extra CMake flags, appended last
#   LLAMA_CPP_PYTHON_VERSION, JOBS   defaults for --version and --jobs
#
# Time: about 10 minutes for these targets on an idle 2-core x86 machine, 30 when other builds compete;
# the shared libraries (ggml, llama, common) are two thirds of it.
#
# Afterwards:   ouroboros-local bench ... --peers llama.cpp --llama-cpp-bin "$PREFIX/build/bin"
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
BACKEND=cpu
PREFIX=""
JOBS="${JOBS:-}"
SDIST=""
SRC=""
SERVER=0
DRY=0
CONFIGURE_ONLY=0

die() { echo "build_llama_cpp.sh: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --backend) BACKEND="${2:?}"; shift 2 ;;
    --prefix) PREFIX="${2:?}"; shift 2 ;;
    --jobs|-j) JOBS="${2:?}"; shift 2 ;;
    --version) VERSION="${2:?}"; shift 2 ;;
    --sdist) SDIST="${2:?}"; shift 2 ;;
    --src) SRC="${2:?}"; shift 2 ;;
    --server) SERVER=1; shift ;;
    --dry-run) DRY=1; shift ;;
    --configure-only) CONFIGURE_ONLY=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done

# The package's cache folder, $OUROBOROS_CACHE (blank = unset; a leading ~ or ~/ expanded, not ~user/: give
# that one as an absolute path); without it, $XDG_CACHE_HOME/ouroboros-local (as before), else
# ~/.cache/ouroboros-local.
CACHE="${OUROBOROS_CACHE:-}"
[[ "$CACHE" =~ ^[[:space:]]*$ ]] && CACHE=""
case "$CACHE" in
  "~" | "~/"*) [ -n "${HOME:-}" ] || die "HOME is unset: give OUROBOROS_CACHE as an absolute path"
               CACHE="$HOME${CACHE#\~}" ;;
esac
if [ -z "$PREFIX" ] && [ -z "$CACHE" ]; then
  [ -n "${XDG_CACHE_HOME:-}${HOME:-}" ] || die "HOME is unset: set OUROBOROS_CACHE or give --prefix DIR"
  CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/ouroboros-local"
fi
PREFIX="${PREFIX:-$CACHE/llama.cpp-$VERSION}"
if [ -z "$JOBS" ]; then
  JOBS="$( (command -v nproc >/dev/null && nproc) || sysctl -n hw.ncpu 2>/dev/null || echo 2)"
fi

run() {
  echo "+ $*" >&2
  if [ "$DRY" = 0 ]; then "$@"; fi
}

# Refuse to build inside this repository: nothing of llama.cpp may land in it.
REPO_ROOT="$(cd "$(dirname "$0")/.." && pwd)"
case "$PREFIX" in /*) ;; *) PREFIX="$PWD/$PREFIX" ;; esac
case "$PREFIX/" in
  "$REPO_ROOT"/*) die "--prefix $PREFIX is inside the repository; choose a directory outside it" ;;
esac

CMAKE_FLAGS=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF
             -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_OPENSSL=OFF)
case "$BACKEND" in
  cpu) CMAKE_FLAGS+=(-DGGML_NATIVE=ON) ;;
  cuda) CMAKE_FLAGS+=(-DGGML_NATIVE=ON -DGGML_CUDA=ON) ;;
  metal) CMAKE_FLAGS+=(-DGGML_METAL=ON) ;;
  vulkan) CMAKE_FLAGS+=(-DGGML_NATIVE=ON -DGGML_VULKAN=ON) ;;
  *) die "unknown backend $BACKEND (cpu, cuda, metal, vulkan)" ;;
esac
if [ "$SERVER" = 1 ]; then CMAKE_FLAGS+=(-DLLAMA_BUILD_SERVER=ON); else CMAKE_FLAGS+=(-DLLAMA_BUILD_SERVER=OFF); fi
# shellcheck disable=SC2206
[ -n "${CMAKE_ARGS:-}" ] && CMAKE_FLAGS+=($CMAKE_ARGS)

TARGETS=(llama-speculative-simple llama-speculative llama-lookup llama-lookahead llama-bench)
[ "$SERVER" = 1 ] && TARGETS+=(llama-server)

command -v cmake >/dev/null || die "cmake is required"
run mkdir -p "$PREFIX"

# 1. sources: llama-cpp-python's sdist -> vendor/llama.cpp
find_sdist() { ls "$PREFIX"/sdist/llama[_-]cpp[_-]python-"$VERSION".tar.gz 2>/dev/null | head -n 1 || true; }
if [ -z "$SRC" ]; then
  if [ -z "$SDIST" ]; then
    SDIST="$(find_sdist)"
    if [ -z "$SDIST" ]; then
      run python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$PREFIX/sdist"
      SDIST="$(find_sdist)"
      [ "$DRY" = 1 ] && SDIST="${SDIST:-$PREFIX/sdist/llama_cpp_python-$VERSION.tar.gz}"
    fi
  fi
  [ "$DRY" = 1 ] || [ -f "$SDIST" ] || die "sdist not found: ${SDIST:-$PREFIX/sdist}"
  SRC="$(ls -d "$PREFIX"/src/*/vendor/llama.cpp 2>/dev/null | head -n 1 || true)"
  if [ -z "$SRC" ] || [ ! -f "$SRC/CMakeLists.txt" ]; then
    run rm -rf "$PREFIX/src"
    run mkdir -p "$PREFIX/src"
    run tar -xzf "$SDIST" -C "$PREFIX/src"
    SRC="$(ls -d "$PREFIX"/src/*/vendor/llama.cpp 2>/dev/null | head -n 1 || true)"
    [ "$DRY" = 1 ] && SRC="${SRC:-$PREFIX/src/llama_cpp_python-$VERSION/vendor/llama.cpp}"
  fi
fi
[ "$DRY" = 1 ] || [ -f "$SRC/CMakeLists.txt" ] || die "no llama.cpp sources in $SRC"

# 2. configure and build only the binaries the benchmark uses
run cmake -S "$SRC" -B "$PREFIX/build" "${CMAKE_FLAGS[@]}"
if [ "$CONFIGURE_ONLY" = 1 ]; then echo "configured in $PREFIX/build" >&2; exit 0; fi
run cmake --build "$PREFIX/build" --config Release -j "$JOBS" --target "${TARGETS[@]}"

echo "llama.cpp binaries (llama-cpp-python $VERSION's llama.cpp, backend $BACKEND) in: $PREFIX/build/bin" >&2
echo "use: ouroboros-local bench ... --peers llama.cpp --llama-cpp-bin $PREFIX/build/bin" >&2
echo "$PREFIX/build/bin"
