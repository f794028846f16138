#!/usr/bin/env bash
# Build, test and benchmark ouroboros-local on a lent NVIDIA GPU machine: no package registry there, at
# most 64 MiB travels per call, and a session has about 15 minutes of device time, start included.
#
# One llama.cpp build (CUDA, this GPU's architecture only) serves both sides of the comparison: our
# bindings load it through llama-cpp-python's Python package (LLAMA_CPP_LIB_PATH), and llama.cpp's own
# binaries (llama-lookup, llama-speculative-simple) are the peers. Both come from the llama.cpp that
# llama-cpp-python's sdist vendors, so we and the peers run the same kernels.
#
# Here, before any device time:
#   scripts/gpu_check.sh pack [GGUF...]  write .gpu/c1 .. .gpu/cN (ignored by git), each at most 60 MiB
#                                        and what the working tree leaves of a call's 64 (less 2 MiB):
#                                        llama.cpp's sources and the llama_cpp package from the sdist,
#                                        the gguf and diskcache wheels, the prompt sets of ../shared/bench,
#                                        and the GGUFs cut into parts (default: SmolLM2-135M, then
#                                        Qwen2.5-Coder-0.5B and -1.5B, from the catalogue's cache: 28
#                                        folders). Prints the device calls to make.
#   scripts/gpu_check.sh rehearse        `next` on this CPU (cached models, 1 prompt a set, 8 tokens, a CUDA
#                                        GPU's defaults forced): fails where a part of the plan would fail
#                                        there (~9 minutes with the cost curves cached; run it before
#                                        any device time)
# On the device machine (the `run` tool; each call carries one folder, timeout_s a little above need):
#   scripts/gpu_check.sh start            carry .gpu/c1: unpack, start the CUDA build in the background
#   scripts/gpu_check.sh stash .gpu/cK    carry .gpu/cK, K = 2..N: back to back while the build runs (an
#                                         idle machine goes back after 30 s, and the build with it)
#   scripts/gpu_check.sh bench NAME [FLAGS...]
#                                         wait for the build, reassemble and sha256-check the models, run
#                                         the benchmark set NAME (smol, qwen05, qwen15; see bench_set), more
#                                         bench FLAGS into $OUT/$LABEL.tgz (LABEL defaults to NAME), print
#                                         its table
#   scripts/gpu_check.sh ab NAME REPEATS 'FLAGS A' 'FLAGS B' [FLAGS...]
#                                         two settings side by side: bench NAME REPEATS times each, in
#                                         the order A B B A ..., each arm's speed-ups per set as mean
#                                         (lowest-highest), then where the decode time goes (ms per 100
#                                         tokens by kind of round), into $OUT/NAME-ab.md, and the runs into
#                                         $OUT/NAME-runs.tgz (NAME: AB_LABEL, else the set). A run of
#                                         vanilla and auto takes ~25 s (1.5B) and ~20 s (SmolLM2)
#   scripts/gpu_check.sh next             the plan for the next GPU session, in one call after the stashes
#                                         (timeout_s 600, NEXT_SECONDS=560): preflight, rounds of 4 (the
#                                         default) against --round-size 0 for the 1.5B and for SmolLM2
#                                         (ab), then the full comparisons with the peers under the GPU's
#                                         defaults (rounds of 4, flash attention auto, round switch on):
#                                         bench qwen15, then bench smol, each interrupted at a deadline
#                                         (BENCH_DEADLINE, epoch seconds: SIGINT, the prompts done are
#                                         reported; an ab gives each of its runs an equal share of the
#                                         time left), then profile (if a minute is left)
#   scripts/gpu_check.sh preflight        llama.cpp's devices and the engine's defaults here (doctor, into
#                                         $OUT/doctor.txt); fails unless rounds of 4 and flash attention
#                                         auto are the defaults (next then asks for them by flag)
#   scripts/gpu_check.sh profile          where auto's Python goes on the GPU: SmolLM2 on mt_bench under the
#                                         defaults, the time split per round of vanilla, then of auto under
#                                         cProfile, into $OUT/profile.txt (~15 s; next runs it too)
#   scripts/gpu_check.sh test             the fast test suite on the GPU build
#   scripts/gpu_check.sh measure          cost curves c(k) of a Qwen2.5-1.5B-shaped model on GPU and CPU
# On an H200 (2026-11-26) start took 33-36 s (the machine's start), each stash ~5 s, the build 267 s,
# bench smol 72 s and bench qwen05 188 s. The 27 stashes fit inside the build's time (all carried after
# 193 s of device time); then one call `bench qwen15; bench smol` took 522 s: 12 of a session's 15
# minutes in all. Issue the stashes back to back (the machine goes back after 30 s idle).
# The third H200 run (2026-11-26, twenty-fifth session): start 32 s, all 27 stashes carried at 175 s, then
# `LABEL=smol-off ... bench smol --overlap off --peers ""; LABEL=smol-on ... bench smol; LABEL=q15-on ...
# bench qwen15 --methods vanilla,prompt-lookup,auto --peers ""` and the same with --overlap off: 294 s,
# the build's wait included; a bench of vanilla and auto alone took ~20 s (SmolLM2) and ~25 s (1.5B).
# Side by side: runs alternating --overlap off and on (its default on a GPU), as in docs/reports/h200-c.
# Branching suffix trees change the batch's shape: with --round-size, add
# --method-options '{"suffix": {"max_branches": 1}}'.
# The report's "py ms/round" is our Python only since c32bbd8: before it, the wait for the GPU (in
# llama_get_logits; llama_decode only queues the work) was counted too, ~1.25 ms of the H200's 1.35 ms step.
# Since 18e43c0 every bench report ends with "Where the decode time goes" (ms per 100 tokens by kind of
# round) and `ab` prints it per setting.
# The fourth H200 run (2026-11-27, thirty-seventh session; docs/reports/h200-d): pack made 28 folders
# (all three models); start 31 s, all 27 stashes carried at 174 s (three or four `run` calls in one
# message run one after another), then one call: `LABEL=smol bench smol; LABEL=q15 bench qwen15`, then
# two repeats of each with `--methods vanilla,prompt-lookup,auto --peers ''`, guarded by $SECONDS: 551 s
# (the build's last ~120 s, smol 57 s, qwen15 259 s, a repeat 17-26 s). 12.2 minutes in all.
# The fifth H200 run (2026-11-27, thirty-eighth session; docs/reports/h200-e): the same 28 folders, all
# carried at 175 s, then `NEXT_FULL_BEFORE=300 next` (then: two ab calls and a full bench of the 1.5B in
# rounds of 4, which ran into the call's 590 s limit and was lost with three of the ab's files, as more
# than 8 came back). Rounds of 4 kept the CUDA graph: `auto` 1.5B gsm8k 0.95x -> 1.03x, code edits 1.20x
# -> 1.40x, SmolLM2 gsm8k 0.98x -> 1.20x, humaneval 1.17x -> 1.55x, but SmolLM2 mt_bench 1.01x -> 0.93x:
# every round drafted in the open. Since 017f0b5 every round of one size drafts while it decodes;
# `next` now measures that (ab leaves one archive per side-by-side, so nothing is left out).
# The sixth H200 run (2026-11-27, thirty-ninth session; docs/reports/h200-f): the same 28 folders, all
# carried at 213 s; the build took 381 s (267-294 s before), so `next` waited ~200 s for it and took 455 s
# (ab qwen15, ab smol, smol overlap off/on, smol rounds of 4/8; qwen15 4/8 skipped by its guard). Rounds
# of 4 drafting while they decode: `auto` >= 1.04x on every set of the 1.5B, SmolLM2 1.26x / 0.95x /
# 1.55x / 1.46x (gsm8k, mt_bench, humaneval, code edits). A last call (177 s, 864 of 900 s in all) ran
# two full benches under `timeout`: both killed, nothing reported; hence BENCH_DEADLINE's SIGINT.
# The seventh H200 run (2026-11-27, forty-second session; docs/reports/h200-g): start 37 s, all 27 stashes
# carried at 221 s, the build 274 s, then `next` (556 s): bench qwen15 (9 contenders; gsm8k cut to 4
# prompts by its deadline), bench smol, an ab of flash attention. It ran without rounds of 4 (libggml
# was not found beside LLAMA_CPP_LIB_PATH's build, so devices() raised and the default fell back without
# a word); hence preflight. Flash attention made SmolLM2's plain decoding 13% faster.
# The eighth H200 run (2026-11-29, sixty-third session; docs/reports/h200-h): 29 folders; start 36 s, all
# carried at 181 s, the build 310 s, then `NEXT_SECONDS=560 next` (521 s; the plan before this one: the
# round switch off/on for SmolLM2, bench qwen15 cut to 1 gsm8k prompt, bench smol whole, no profile),
# then two ab calls of the 1.5B, rounds of 4 against --round-size 0 (23 s, a mistyped arm, and 43 s):
# 794 s of device time in all. Rounds of 4 lost on gsm8k and humaneval (above, at `next`).
set -uo pipefail
CAP_MIB=60
SITE=/tmp/site
MODELS="${GPU_CHECK_MODELS:-/tmp/gpu-models}"   # both set by `rehearse` only
LLAMA="${GPU_CHECK_LLAMA:-/tmp/llama}"
OUT="${OUT:-/tmp/gpu-out}"
PY=python3
SDIST_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"

pack() {
  local pack_dir=.gpu work
  local models=("$@")
  if [ ${#models[@]} -eq 0 ]; then
    local cache="${OUROBOROS_CACHE:-$HOME/.cache/ouroboros-local}/models"
    models=("$cache/smollm2-135m-instruct.gguf" "$cache/qwen2.5-coder-0.5b-instruct.gguf"
            "$cache/qwen2.5-coder-1.5b-instruct.gguf")
  fi
  local m   # what is missing is said before anything is downloaded or written
  for m in "${models[@]}"; do
    [ -f "$m" ] || { echo "pack: no model $m (ouroboros-local models fetch NAME, or name GGUFs)" >&2; exit 1; }
  done
  ls "${BENCH_DIR:-../shared/bench}"/*.jsonl > /dev/null 2>&1 \
    || { echo "pack: no prompt sets in ${BENCH_DIR:-../shared/bench} (set BENCH_DIR)" >&2; exit 1; }
  # each call carries the working tree beside its folder, 64 MiB in all: the folders get what the tree
  # leaves, less 2 MiB for the tree's growth until the session (it was 3 MiB and grew 1.4 in 3 days)
  local tree_bytes cap_mib
  tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null \
    | awk '{s += $1} END {print s + 0}')
  cap_mib=$(( (64 * 1048576 - tree_bytes) / 1048576 - 2 ))
  [ "$cap_mib" -gt "$CAP_MIB" ] && cap_mib=$CAP_MIB
  [ "$cap_mib" -ge 16 ] || { echo "pack: the working tree takes $((tree_bytes >> 20)) MiB of the 64" >&2; exit 1; }
  work=$(mktemp -d)
  rm -rf "$pack_dir" && mkdir -p "$work/payload"
  # no half-packed folders, no temporary copies (expanded now: the names are this function's)
  trap "rm -rf '$work'; [ -f '$pack_dir/done' ] || rm -rf '$pack_dir'" EXIT
  # llama.cpp sources without what a CUDA build never reads (other backends, models, docs, web UI)
  local sdist
  sdist=$(ls "${SDIST:-$work}"/llama_cpp_python-"$SDIST_VERSION".tar.gz 2>/dev/null | head -1)
  if [ -z "$sdist" ]; then
    $PY -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$SDIST_VERSION" -d "$work" || exit 1
    sdist=$(ls "$work"/llama_cpp_python-"$SDIST_VERSION".tar.gz)
  fi
  tar xzf "$sdist" -C "$work" || exit 1
  local src="$work/llama_cpp_python-$SDIST_VERSION"
  mkdir -p "$work/tree/src" && cp -r "$src/llama_cpp" "$work/tree/" && rm -rf "$work/tree/llama_cpp/lib"
  local skip=() b
  for b in vulkan sycl opencl hexagon et metal webgpu openvino cann virtgpu; do
    skip+=(--exclude="ggml/src/ggml-$b")
  done
  (cd "$src/vendor/llama.cpp" && tar cf - "${skip[@]}" --exclude=tools/ui CMakeLists.txt CMakePresets.json \
     LICENSE cmake common examples pocs ggml include src vendor tools licenses) | tar xf - -C "$work/tree/src"
  tar czf "$work/payload/llama-src.tgz" -C "$work/tree" . || exit 1
  # gguf for our GGUF reader, diskcache for llama_cpp's import: the image has neither
  $PY -m pip download -q --no-deps --only-binary=:all: gguf diskcache -d "$work/payload" || exit 1
  cp "${BENCH_DIR:-../shared/bench}"/*.jsonl "$work/payload/" || exit 1
  # every model after the small files, cut so that each folder fills to the cap: fewest calls
  $PY - "$pack_dir" "$cap_mib" "$work/payload" "${models[@]}" <<'EOF' || exit 1
import hashlib, os, sys
pack_dir, cap, payload, models = sys.argv[1], int(sys.argv[2]) << 20, sys.argv[3], sys.argv[4:]
folder, used, part = 1, 0, 0
def room() -> int:
    return cap - used
def target() -> str:
    path = os.path.join(pack_dir, f"c{folder}")
    os.makedirs(path, exist_ok=True)
    return path
for name in sorted(os.listdir(payload)):
    data = open(os.path.join(payload, name), "rb").read()
    open(os.path.join(target(), name), "wb").write(data)
    used += len(data)
for model in models:
    name, digest = os.path.basename(model), hashlib.sha256()
    with open(model, "rb") as f:
        while True:
            if room() <= 0:
                folder, used = folder + 1, 0
            chunk = f.read(room())
            if not chunk:
                break
            digest.update(chunk)
            open(os.path.join(target(), f"{name}.part{part:03d}"), "wb").write(chunk)
            used, part = used + len(chunk), part + 1
    open(os.path.join(pack_dir, "c1", name + ".sha256"), "w").write(f"{digest.hexdigest()}  {name}\n")
print(f"{folder} folders in {pack_dir}/ (at most {cap >> 20} MiB each); device calls, back to back:")
print("  run: scripts/gpu_check.sh start            carry [.gpu/c1]")
for k in range(2, folder + 1):
    print(f"  run: scripts/gpu_check.sh stash .gpu/c{k}    carry [.gpu/c{k}]")
print("  run: scripts/gpu_check.sh bench qwen15     (then bench smol, bench qwen05, and with --round-size 4)")
EOF
  touch "$pack_dir/done"
  rm -rf "$work"
  grep -qx '/.gpu/' .gitignore 2>/dev/null || echo "note: add /.gpu/ to .gitignore"
}

setup_env() {
  mkdir -p "$SITE" "$MODELS" "$OUT"
  if [ -n "${REHEARSE:-}" ]; then   # this machine's llama_cpp package and its own library
    export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
    return
  fi
  export PYTHONPATH="$PWD:$SITE" PYTHONUNBUFFERED=1 LLAMA_CPP_LIB_PATH="$LLAMA/build/bin"
  export OUROBOROS_CACHE=/tmp/ouroboros-cache
  # The image's /opt/gcc toolchain links a copy of libstdc++ into libggml-cuda.so and exports it;
  # llama.cpp then resolves std::ostream calls into that copy and crashes while printing model info.
  # Loading the system libstdc++ first makes every library use it.
  local lib
  for lib in /lib/x86_64-linux-gnu/libstdc++.so.6 /usr/lib64/libstdc++.so.6; do
    [ -f "$lib" ] && export LD_PRELOAD="$lib" && break
  done
}

stash() {
  mkdir -p "$MODELS" && cp "$1"/* "$MODELS"/ && ls "$1"
}

wait_for_build() {
  [ -n "${REHEARSE:-}" ] && return   # `rehearse`: the build of scripts/build_llama_cpp.sh
  local i
  for i in $(seq 1 120); do
    [ -f /tmp/build.done ] && break
    [ $((i % 12)) -eq 1 ] && tail -1 /tmp/build.log
    sleep 5
  done
  if ! grep -q "^0$" /tmp/build.done 2>/dev/null; then
    echo "llama.cpp build not finished or failed:"; tail -30 /tmp/build.log; exit 1
  fi
  echo "build took $(cat /tmp/build.seconds 2>/dev/null) s"
}

# reassemble every stashed model and check it against the sha256 that pack wrote
assemble() {
  [ -n "${REHEARSE:-}" ] && return   # `rehearse`: the catalogue's cache, checked when it was fetched
  local sum name
  for sum in "$MODELS"/*.sha256; do
    name=$(basename "$sum" .sha256)
    [ -f "$MODELS/$name" ] || cat "$MODELS/$name".part* > "$MODELS/$name"
    (cd "$MODELS" && sha256sum -c "$name.sha256") || { rm -f "$MODELS/$name"; echo "missing parts of $name"; }
  done
}

known_set() {
  case "$1" in smol|qwen05|qwen15) return 0 ;; esac
  echo "unknown bench set $1 (smol, qwen05, qwen15)" >&2; return 1
}

# benchmark sets: what `bench NAME` runs (model, methods, peers, prompt sets)
bench_set() {
  local S="$MODELS" bin="$LLAMA/build/bin"
  case "$1" in
    smol)    # the small target of the H100 run: nothing pays, what is left is our overhead
      set -- -m "$MODELS/smollm2-135m-instruct.gguf" --methods vanilla,prompt-lookup,suffix,auto \
        --peers llama.cpp:vanilla \
        --prompts "$S/gsm8k.jsonl,$S/mt_bench.jsonl,$S/humaneval.jsonl,$S/codeedit.jsonl" ;;
    qwen05)  # the draft-free methods on a Qwen target, a second pass of codeedit as the history workload
      set -- -m "$MODELS/qwen2.5-coder-0.5b-instruct.gguf" --methods vanilla,prompt-lookup,suffix,auto \
        --peers llama.cpp:ngram-mod \
        --prompts "$S/humaneval.jsonl,$S/codeedit.jsonl,$S/codeedit.jsonl,$S/gsm8k.jsonl,$S/mt_bench.jsonl" ;;
    qwen15)  # the default target with its same-family draft, against llama.cpp's draft and n-gram modes
      # (pearl and ouroboros left out since docs/reports/h200-g: 0.55-0.61x and 0.91-0.99x on the H200,
      # where a 0.5B step costs 0.69 of a 1.5B step; the time goes to the rest)
      set -- -m "$MODELS/qwen2.5-coder-1.5b-instruct.gguf" -d "$MODELS/qwen2.5-coder-0.5b-instruct.gguf" \
        --methods vanilla,prompt-lookup,speculative,auto \
        --peers llama.cpp:draft-simple,llama.cpp:ngram-mod \
        --prompts "$S/humaneval.jsonl,$S/codeedit.jsonl,$S/codeedit.jsonl,$S/gsm8k.jsonl" ;;
    *) echo "unknown bench set $1 (smol, qwen05, qwen15)"; return 2 ;;
  esac
  # BENCH_DEADLINE (epoch seconds): interrupt the bench then (SIGINT, as Ctrl-C: it reports the prompts
  # it finished), so that a call ends inside its time limit with something to bring back
  local until=() left
  if [ -n "${BENCH_DEADLINE:-}" ]; then
    left=$((BENCH_DEADLINE - $(date +%s)))
    [ "$left" -gt 5 ] || { echo "bench $NAME: no time left before BENCH_DEADLINE"; return 1; }
    until=(timeout -s INT -k 30 "$left")
  fi
  "${until[@]}" $PY -m ouroboros_local bench "$@" "${EXTRA[@]}" --gpu-layers "${GPU_LAYERS:-all}" \
    --llama-cpp-bin "$bin" --limit "${LIMIT:-10}" -n "${TOKENS:-128}" --no-progress --out "$OUT/$NAME"
}

case "${1:-}" in
  pack)
    shift; pack "$@" ;;
  start)
    setup_env
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      .gpu/c1/*.whl || exit 1
    rm -rf "$LLAMA" /tmp/build.done && mkdir -p "$LLAMA"
    tar xzf .gpu/c1/llama-src.tgz -C "$LLAMA" && cp -r "$LLAMA/llama_cpp" "$SITE/" || exit 1
    stash .gpu/c1 >/dev/null
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
    # this GPU's architecture only: a fraction of the all-architectures build; shared libraries for
    # llama_cpp, and the two binaries the peers run
    ( cd "$LLAMA" && setsid nohup sh -c "start=\$(date +%s); \
        cmake -S src -B build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON \
          -DGGML_CUDA=${GPU_CHECK_CUDA:-ON} -DCMAKE_CUDA_ARCHITECTURES=native -DLLAMA_BUILD_TESTS=OFF \
          -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
          -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_IS_DEV=OFF \
        && cmake --build build -j $(nproc) --target llama llama-lookup llama-speculative-simple; \
        echo \$? > /tmp/build.rc; echo \$((\$(date +%s) - start)) > /tmp/build.seconds; \
        mv /tmp/build.rc /tmp/build.done" < /dev/null > /tmp/build.log 2>&1 & )
    echo "build started; stash the other folders now, back to back"
    ;;
  stash)
    stash "$2" ;;
  bench)
    SET="${2:?bench NAME: smol, qwen05 or qwen15}"
    known_set "$SET" || exit 2
    setup_env; wait_for_build; assemble
    EXTRA=("${@:3}")             # more bench flags, e.g. --round-size 4
    NAME="${LABEL:-$SET}"
    bench_set "$SET" > "$OUT/$NAME.log" 2>&1
    rc=$?
    tail -60 "$OUT/$NAME.log"
    cp "$OUT/$NAME.log" "$OUT/$NAME/" 2>/dev/null
    tar czf "$OUT/$NAME.tgz" -C "$OUT" "$NAME" && rm -rf "${OUT:?}/$NAME" "$OUT/$NAME.log"
    exit $rc
    ;;
  ab)
    # two settings side by side, runs in the order A B B A A B ...: each arm's speed-ups per set, mean
    # (lowest-highest), printed and written to $OUT/NAME-ab.md (scripts/ab_summary.py)
    SET="${2:?ab NAME REPEATS 'FLAGS A' 'FLAGS B' [COMMON FLAGS...]}"
    known_set "$SET" || exit 2
    setup_env; wait_for_build; assemble
    REPEATS="${3:-2}"
    read -ra ARM_A <<< "${4:-}"
    read -ra ARM_B <<< "${5:-}"
    COMMON=("${@:6}")
    RUNS=()
    AB_DEADLINE="${BENCH_DEADLINE:-}"
    todo=$((2 * REPEATS))
    for i in $(seq 1 "$REPEATS"); do
      order="a b"; [ $((i % 2)) -eq 0 ] && order="b a"
      for arm in $order; do
        NAME="${AB_LABEL:-$SET}-$arm$i"
        if [ "$arm" = a ]; then EXTRA=("${COMMON[@]}" "${ARM_A[@]}"); else EXTRA=("${COMMON[@]}" "${ARM_B[@]}"); fi
        # each run its share of the time left to the deadline: with one deadline for all, a late build
        # left the first run all of it and the second arm none (its log only: "no time left")
        [ -n "$AB_DEADLINE" ] && BENCH_DEADLINE=$(( $(date +%s) + (AB_DEADLINE - $(date +%s)) / todo ))
        todo=$((todo - 1))
        bench_set "$SET" > "$OUT/$NAME.log" 2>&1 || tail -5 "$OUT/$NAME.log"
        cp "$OUT/$NAME.log" "$OUT/$NAME/" 2>/dev/null
        RUNS+=("$NAME")
      done
    done
    AB="${AB_LABEL:-$SET}"
    echo "a: ${ARM_A[*]:-(defaults)}   b: ${ARM_B[*]:-(defaults)}   common: ${COMMON[*]:-}" | tee "$OUT/$AB-ab.md"
    DONE=(); LOGS=()   # a run cut by the deadline before its bench began left only its log
    for r in "${RUNS[@]}"; do
      if [ -f "$OUT/$r/results.json" ]; then DONE+=("$r"); else LOGS+=("$r.log"); echo "$r: no results ($(tail -1 "$OUT/$r.log"))" | tee -a "$OUT/$AB-ab.md"; fi
    done
    [ ${#DONE[@]} -gt 0 ] && $PY scripts/ab_summary.py "$OUT" "${DONE[@]}" | tee -a "$OUT/$AB-ab.md"
    # one archive for the runs and the logs of those without results: at most 8 files come back from a call
    ( cd "$OUT" && tar czf "$AB-runs.tgz" $(for r in "${RUNS[@]}"; do [ -e "$r" ] && echo "$r"; done) "${LOGS[@]}" ) \
      && for r in "${RUNS[@]}"; do rm -rf "${OUT:?}/$r"; done
    rm -f "$OUT"/"$AB"-[ab][0-9]*.log
    ;;
  next)
    # After the stashes, one call (timeout_s ~600, NEXT_SECONDS=560) of what docs/reports/h200-h left to
    # measure. There, in rounds of 4 (the CUDA default), the 1.5B's `auto` ran 0.90-0.94x on gsm8k and
    # humaneval against 0.98-0.99x in rounds of each draft's size (--round-size 0): with flash attention a
    # round of 4 cost 1.6-1.7 plain steps in the loop, and the round switch, sizing by the calibrated ratio,
    # kept rounds that wrote 1.6 tokens. Since 433a088 the switch times both sizes in the loop. So:
    # preflight, then rounds of 4 (default) against --round-size 0 for the 1.5B (gsm8k, humaneval, code
    # edits) and SmolLM2 (gsm8k, mt_bench), each ab printing the switch's timed and calibrated ratios,
    # then the full comparisons with the peers (the 1.5B's, then SmolLM2's), each interrupted at its
    # deadline (the prompts done are kept), then where auto's Python goes (if a minute is left). The
    # first ab's deadline leaves ~130 s for the build's end (it took 267-381 s from `start`).
    end=$(( $(date +%s) + ${NEXT_SECONDS:-525} ))
    FORCE=()
    "$0" preflight || { FORCE=(--round-size 4 --flash-attn auto); echo "preflight failed: benches run with ${FORCE[*]}"; }
    [ -n "${REHEARSE:-}" ] && FORCE+=(--overlap on)   # a GPU's llama_decode returns early: a CPU's does not
    S="$MODELS"
    BENCH_DEADLINE=$((end - 350)) AB_LABEL=q15-rs "$0" ab qwen15 1 '' '--round-size 0' \
      --prompts "$S/gsm8k.jsonl,$S/humaneval.jsonl,$S/codeedit.jsonl" --methods vanilla,prompt-lookup,auto \
      --peers '' "${FORCE[@]}"
    BENCH_DEADLINE=$((end - 300)) AB_LABEL=smol-rs "$0" ab smol 1 '' '--round-size 0' \
      --prompts "$S/gsm8k.jsonl,$S/mt_bench.jsonl" --methods vanilla,auto --peers '' "${FORCE[@]}"
    BENCH_DEADLINE=$((end - 100)) LABEL=q15 "$0" bench qwen15 "${FORCE[@]}"
    BENCH_DEADLINE=$((end - 15)) LABEL=smol "$0" bench smol "${FORCE[@]}"
    [ "$(date +%s)" -lt $((end - 60)) ] && PROFILE_FORCE="${FORCE[*]:+1}" "$0" profile > /dev/null
    ls "$OUT"
    ;;
  rehearse)
    # Here, before any device time, no GPU needed: `next` on this machine, as a GPU session would run it,
    # with what it can stand in for there: the catalogue's cached models, the prompt sets of BENCH_DIR,
    # llama.cpp's binaries from scripts/build_llama_cpp.sh (REHEARSE_LLAMA: its prefix), one prompt a set
    # and 8 tokens, and a CUDA GPU's defaults forced (rounds of 4 drafting while they decode, flash
    # attention auto). A flag the CLI no longer takes, or a method failing under those defaults, then
    # shows here and not in a session's 15 minutes: the forty-sixth session found `speculative` raising
    # on every request in rounds of 4 this way (fixed), which would have cost the 1.5B's whole bench.
    # ~9 minutes on 2 cores with the cost curves cached (528 s for the plan of 433a088), more from an
    # empty cache (they are measured first); fails, with the lines that say why, where any part of `next` failed.
    cache="${OUROBOROS_CACHE:-$HOME/.cache/ouroboros-local}"
    dir=$(mktemp -d)
    ln -s "$cache"/models/*.gguf "$dir"/ && ln -s "$(cd "${BENCH_DIR:-../shared/bench}" && pwd)"/*.jsonl "$dir"/ \
      || { echo "no models in $cache/models or prompt sets in ${BENCH_DIR:-../shared/bench}"; exit 1; }
    REHEARSE=1 GPU_CHECK_MODELS="$dir" GPU_CHECK_LLAMA="${REHEARSE_LLAMA:-$cache/llama.cpp-$SDIST_VERSION}" \
      OUT="$dir/out" LIMIT=1 TOKENS=8 NEXT_SECONDS=1200 "$0" next > "$dir/next.log" 2>&1
    for f in "$dir"/out/*.tgz; do tar xzf "$f" -C "$dir/out"; done
    if grep -rnE "Traceback|^error|rror:|unrecognized arguments|no time left|failed on|bench: skipping|errors\]" "$dir/next.log" "$dir/out" \
         --include=*.log --include=*.txt --include=*.md; then
      echo "rehearsal FAILED (logs in $dir)"; exit 1
    fi
    ls "$dir/out"; echo "rehearsal passed: every part of next ran (logs in $dir)"
    ;;
  preflight)
    # what a bench here will run with: llama.cpp's devices, and the engine's defaults on this GPU (rounds
    # of 4, flash attention auto); into $OUT/doctor.txt, failing where a default is not the GPU's
    setup_env; wait_for_build; assemble
    $PY -m ouroboros_local doctor -m "$MODELS/smollm2-135m-instruct.gguf" 2>&1 | tee "$OUT/doctor.txt" \
      | grep -E "^(device|rounds|flash|GPU)"
    grep -q "^rounds: 4 tokens each" "$OUT/doctor.txt" && grep -q "^flash attention: auto" "$OUT/doctor.txt"
    ;;
  profile)
    # Where auto's Python goes on this GPU, SmolLM2 under the defaults (rounds of 4 on CUDA): on the
    # H200's mt_bench (docs/reports/h200-f, smol-b1) auto spent 0.458 ms of Python a round against
    # vanilla's 0.114, where this CPU's stub (scripts/round_overhead.py --idle --round-size 4 --overlap)
    # finds ~55 µs in the open. `bench smol` reports both methods' time split already: here vanilla on
    # LIMIT prompts as this process's reference, then auto under cProfile on the same (its first answers
    # to them: nothing of them to copy yet).
    setup_env; wait_for_build; assemble
    $PY - "$MODELS" "${LIMIT:-10}" "${TOKENS:-128}" "${GPU_LAYERS:-all}" "${PROFILE_FORCE:-}" <<'EOF' 2>&1 \
      | tee "$OUT/profile.txt"
import cProfile, collections, json, pstats, sys
from ouroboros_local.engine import Engine
models, limit, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
layers = -1 if sys.argv[4] == "all" else int(sys.argv[4])
forced = {"round_size": 4, "flash_attn": "auto"} if sys.argv[5] else {}   # next's flags, where preflight failed
eng = Engine.load(f"{models}/smollm2-135m-instruct.gguf", progress=False, gpu_layers=layers, **forced)
eng.prepare("auto")   # the cost curve measured here, not inside the profile
print("round size", eng.round_size)
with open(f"{models}/mt_bench.jsonl") as f:
    prompts = [eng.apply_chat_template([{"role": "user", "content": json.loads(line)["turns"][0]}])
               for line in f][:limit]
def run(method):
    parts, passes, written, python = collections.Counter(), 0, 0, 0.0
    for p in prompts:
        st = eng.generate(p, max_tokens=tokens, method=method).stats
        passes, written = passes + st.target_passes, written + st.tokens
        python += (st.extra.get("python_ms_per_round") or 0.0) * st.target_passes   # None: no round
        for part, (_, sec) in st.extra["time_split"].items():
            parts[part] += sec
    print(f"{method}: {passes * 100 / written:.1f} passes per 100 tokens, py {python / passes:.3f} ms/round, "
          "µs a round: " + ", ".join(f"{k} {v * 1e6 / passes:.0f}" for k, v in parts.items() if v))
run("vanilla")
profiler = cProfile.Profile()
profiler.enable()
run("auto")
profiler.disable()
pstats.Stats(profiler).sort_stats("tottime").print_stats(40)
pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
EOF
    ;;
  test)
    setup_env; wait_for_build
    $PY -c "import llama_cpp, ouroboros_local.llama as l; print(llama_cpp.__version__, l.supports_gpu_offload())"
    $PY -c "from ouroboros_local.testing import write_tiny_model as w; w('$MODELS/tiny.gguf')"
    $PY -m ouroboros_local doctor -m "$MODELS/tiny.gguf" 2>&1 | tee "$OUT/doctor.txt"
    $PY -m pytest -q -m "not slow" -x -p no:cacheprovider 2>&1 | tee "$OUT/pytest.txt" | tail -25
    ;;
  measure)
    setup_env; wait_for_build
    $PY - <<'EOF' 2>&1 | tee "$OUT/costs.txt"
# Cost curves of a Qwen2.5-1.5B-shaped model (random weights, Q4_K_M): only shapes matter for speed.
import json, os
from ouroboros_local.testing import write_tiny_model
from ouroboros_local.llama import quantize
from ouroboros_local.engine import Engine, EngineConfig
from ouroboros_local.llama import Model
from ouroboros_local.calibration import measure_costs
os.makedirs("/tmp/gpu-models", exist_ok=True)
f16, q4 = "/tmp/gpu-models/qwen-shaped-f16.gguf", "/tmp/gpu-models/qwen-shaped-q4_k_m.gguf"
if not os.path.exists(q4):
    write_tiny_model(f16, n_layer=28, n_embd=1536, n_head=12, n_head_kv=2, n_ff=8960, dtype="f16")
    quantize(f16, q4, 15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
sizes = (*range(1, 18), 24, 32, 64)   # every draft size: kernels may take rows 4 or 8 at a time
rows = {}
for label, layers, threads in (("gpu", -1, 16), ("cpu-16t", 0, 16), ("cpu-2t", 0, 2)):
    cfg = EngineConfig(n_ctx=1024, n_batch=128, n_seq_max=8, threads=threads, gpu_layers=layers)
    with Engine(Model(q4, n_gpu_layers=layers), None, cfg) as eng:
        c = measure_costs(eng.kv, sizes=sizes, repeats=3)
    rows[label] = c.seconds
    print(label, " ".join(f"c({n})={s*1e3:.2f}ms({s/c.seconds[0]:.2f}x)" for n, s in zip(c.sizes, c.seconds)))
json.dump({"sizes": list(sizes), "seconds": rows}, open(os.environ.get("OUT", "/tmp") + "/costs.json", "w"))
EOF
    ;;
  *)
    sed -n '2,/^# On an H200/p' "$0" | sed '$d'; exit 2 ;;   # the usage above
esac
