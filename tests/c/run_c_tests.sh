#!/usr/bin/env bash
# Builds the C tests of the core (tests/c/*.c: one program, ring_test, of
# the core's headers, ring.h and ring/) three ways, or a fourth on request,
# and runs each build; exits nonzero if any build or run fails.
#
#   plain   -O2 -Wall -Wextra -Werror -std=c11 -D_GNU_SOURCE -DSHM_DEBUG
#   tsan    -fsanitize=thread -O1 -g               (ThreadSanitizer)
#   asan    -fsanitize=address,undefined -fno-sanitize-recover=all -O0 -g
#           (-O0: the same checks, compiled in a fifth of -O1's time)
#   arm64   plain's flags, -O2 -static, for aarch64 (not in the default set:
#           RING_TEST_BUILDS=arm64).  On another host it is cross-compiled
#           with aarch64-linux-gnu-gcc and run under QEMU's user-mode
#           emulation with SHM_TEST_SLOW=1 (ring_test's slow-run settings);
#           on an aarch64 host it is built with CC and run natively.
#           Static, so that QEMU needs no aarch64 sysroot (QEMU_LD_PREFIX).
#           QEMU on an x86 host runs the program under x86's stronger
#           ordering: this checks that ring.h builds and works on aarch64
#           and exercises its portable paths, not aarch64's weaker memory
#           model (docs/protocol.md, Memory orders on AArch64).
#
# Requirements (Debian 12 "bookworm", gcc 12): the packages `gcc` and
# `libc6-dev`.  The sanitizer runtimes come with gcc's own dependency
# `libgcc-12-dev`, which pulls in `libtsan2` (ThreadSanitizer), `libasan8`
# (AddressSanitizer) and `libubsan1` (UBSan); on a minimal image:
#     apt-get install -y gcc libc6-dev libgcc-12-dev libtsan2 libasan8 libubsan1
# (other gcc majors: libgcc-N-dev; runtime sonames libtsan2/libasan8 for gcc
# 12-13, libasan6/libtsan0 for gcc 10.)  The script probes each sanitizer
# first and names the missing package when a probe fails.
#
# The arm64 build on Debian 12: `gcc-aarch64-linux-gnu` (the cross gcc),
# `libc6-dev-arm64-cross` (its libc; only recommended by the former) and
# `qemu-user-static` (or `qemu-user`: qemu-aarch64-static or qemu-aarch64):
#     apt-get install -y --no-install-recommends gcc-aarch64-linux-gnu \
#         libc6-dev-arm64-cross qemu-user-static
#
# ThreadSanitizer and ASLR: on some newer kernels (large vm.mmap_rnd_bits)
# TSan dies with "FATAL: ThreadSanitizer: unexpected memory mapping".  The
# script probes for that and then runs the TSan build under
# `setarch "$(uname -m)" -R` (ASLR off for that process only).
#
# Environment:
#   CC              compiler (default gcc)
#   ARM64_CC        the arm64 build's compiler (default aarch64-linux-gnu-gcc,
#                   or CC on an aarch64 host)
#   QEMU_AARCH64    the emulator that runs it (default qemu-aarch64-static,
#                   else qemu-aarch64; none on an aarch64 host)
#   RING_H_DIR      directory holding the core to test, ring.h and ring/
#                   (default src/shmeval/_core); e.g. a deliberately
#                   broken copy
#   RING_TEST_ARGS  test names to run (default: all)
#   RING_TEST_BUILDS  builds to run (default: "plain tsan asan")
#   RUN_TIMEOUT     seconds per run (default 150)
#   BUILD_JOBS      compilers each build runs at once (default: the CPUs)
#   RING_TEST_PLAIN_OPT  the plain build's optimisation (default -O2; the
#                   mutation tests use -O1, which compiles in half the time)
#   SHM_TEST_*      passed through to ring_test (see the top of
#                   tests/c/main.c)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
srcs=("$here"/*.c)
ring_dir="${RING_H_DIR:-$root/src/shmeval/_core}"
cc="${CC:-gcc}"
host_arch="$(uname -m)"
if [[ $host_arch == aarch64 ]]; then
    arm64_cc="${ARM64_CC:-$cc}"
else
    arm64_cc="${ARM64_CC:-aarch64-linux-gnu-gcc}"
fi
builds="${RING_TEST_BUILDS:-plain tsan asan}"
run_timeout="${RUN_TIMEOUT:-150}"
jobs="${BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}"
read -r -a test_args <<<"${RING_TEST_ARGS:-}"

die() { echo "run_c_tests: error: $*" >&2; exit 1; }

arm64_pkgs="gcc-aarch64-linux-gnu libc6-dev-arm64-cross"
native=0
for b in $builds; do
    [[ $b == arm64 ]] || native=1
done
if (( native )); then
    command -v "$cc" >/dev/null 2>&1 ||
        die "C compiler '$cc' not found (Debian: apt-get install -y gcc libc6-dev)"
fi
if [[ " $builds " == *" arm64 "* ]]; then
    command -v "$arm64_cc" >/dev/null 2>&1 ||
        die "aarch64 C compiler '$arm64_cc' not found (Debian: apt-get install -y $arm64_pkgs)"
fi
[[ -f "$here/main.c" ]] || die "missing $here/main.c"
[[ -f "$ring_dir/ring.h" && -d "$ring_dir/ring" ]] || die "missing $ring_dir/ring.h or $ring_dir/ring/"
have_timeout=1
command -v timeout >/dev/null 2>&1 || have_timeout=0

tmp="$(mktemp -d "${TMPDIR:-/tmp}/ring_test.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

if (( native )); then
    echo "run_c_tests: $("$cc" --version | head -n1); kernel $(uname -r) $host_arch"
fi
echo "run_c_tests: testing $ring_dir/ring.h"

common=(-std=c11 -D_GNU_SOURCE -DSHM_DEBUG -Wall -Wextra -pthread -I "$ring_dir")
declare -A flags=(
    [plain]="${RING_TEST_PLAIN_OPT:--O2} -Werror"
    [tsan]="-fsanitize=thread -O1 -g"
    [asan]="-fsanitize=address,undefined -fno-sanitize-recover=all -O0 -g"
    [arm64]="-O2 -Werror -static"
)
declare -A compiler=([plain]="$cc" [tsan]="$cc" [asan]="$cc" [arm64]="$arm64_cc")
declare -A pkgs=(
    [tsan]="libtsan2 (gcc 12; comes with libgcc-12-dev)"
    [asan]="libasan8 and libubsan1 (gcc 12; come with libgcc-12-dev)"
)

# --- probe the sanitizer toolchains -------------------------------------
printf 'int main(void) { return 0; }\n' >"$tmp/probe.c"
tsan_prefix=()
for b in tsan asan; do
    [[ " $builds " == *" $b "* ]] || continue
    # shellcheck disable=SC2086
    if ! "$cc" ${flags[$b]} "$tmp/probe.c" -o "$tmp/probe_$b" >"$tmp/probe_$b.log" 2>&1; then
        cat "$tmp/probe_$b.log" >&2
        die "cannot link a $b program: install ${pkgs[$b]}"
    fi
done
if [[ " $builds " == *" tsan "* ]]; then
    if ! "$tmp/probe_tsan" >"$tmp/probe_run.log" 2>&1; then
        if grep -q "unexpected memory mapping" "$tmp/probe_run.log" &&
            setarch "$(uname -m)" -R "$tmp/probe_tsan" >/dev/null 2>&1; then
            tsan_prefix=(setarch "$(uname -m)" -R)
            echo "run_c_tests: TSan needs ASLR off on this kernel: using ${tsan_prefix[*]}"
        else
            cat "$tmp/probe_run.log" >&2
            die "ThreadSanitizer programs do not run here (see above)"
        fi
    fi
fi

# --- probe the arm64 toolchain and its emulator -------------------------
arm64_prefix=()
if [[ " $builds " == *" arm64 "* ]]; then
    echo "run_c_tests: arm64: $("$arm64_cc" --version | head -n1)"
    # shellcheck disable=SC2086
    if ! "$arm64_cc" ${flags[arm64]} -pthread "$tmp/probe.c" -o "$tmp/probe_arm64" \
        >"$tmp/probe_arm64.log" 2>&1; then
        cat "$tmp/probe_arm64.log" >&2
        die "cannot link a static aarch64 program with $arm64_cc: install $arm64_pkgs"
    fi
    if [[ $host_arch != aarch64 ]]; then
        qemu="${QEMU_AARCH64:-}"
        if [[ -z $qemu ]]; then
            for q in qemu-aarch64-static qemu-aarch64; do
                if command -v "$q" >/dev/null 2>&1; then qemu="$q"; break; fi
            done
        fi
        [[ -n $qemu ]] && command -v "$qemu" >/dev/null 2>&1 ||
            die "aarch64 emulator ${qemu:-qemu-aarch64-static or qemu-aarch64} not" \
                "found (Debian: apt-get install -y qemu-user-static, or qemu-user)"
        "$qemu" "$tmp/probe_arm64" >"$tmp/probe_arm64_run.log" 2>&1 || {
            cat "$tmp/probe_arm64_run.log" >&2
            die "$qemu cannot run an aarch64 program (see above)"
        }
        echo "run_c_tests: arm64: run under $("$qemu" --version | head -n1)" \
            "with SHM_TEST_SLOW=${SHM_TEST_SLOW:-1}"
        arm64_prefix=(env "SHM_TEST_SLOW=${SHM_TEST_SLOW:-1}" "$qemu")
    fi
fi

# --- build: the builds at once, each compiling its files in parallel ----
for b in $builds; do
    [[ -n "${flags[$b]:-}" ]] || die "unknown build '$b'"
done

# Build $1: every source to an object, $jobs compilers at a time, then the
# link.  Returns nonzero if a compile or the link failed.
build() {
    local b=$1 obj="$tmp/obj_$1" f rc=0
    local -a pids=()
    mkdir -p "$obj"
    for f in "${srcs[@]}"; do
        # shellcheck disable=SC2086
        "${compiler[$b]}" "${common[@]}" ${flags[$b]} -c "$f" \
            -o "$obj/$(basename "$f" .c).o" &
        pids+=("$!")
        if (( ${#pids[@]} >= jobs )); then
            wait "${pids[0]}" || rc=1
            pids=("${pids[@]:1}")
        fi
    done
    for f in "${pids[@]}"; do wait "$f" || rc=1; done
    (( rc == 0 )) || return 1
    # shellcheck disable=SC2086
    "${compiler[$b]}" "${common[@]}" ${flags[$b]} "$obj"/*.o -o "$tmp/ring_test_$b"
}

declare -A build_pid
for b in $builds; do
    (
        t0=$(date +%s.%N)
        rc=0
        build "$b" >"$tmp/build_$b.log" 2>&1 || rc=$?
        awk -v t0="$t0" -v t1="$(date +%s.%N)" 'BEGIN { printf "%.1f", t1 - t0 }' \
            >"$tmp/build_$b.s"
        exit "$rc"
    ) &
    build_pid[$b]=$!
done

# --- run, one build after the other -------------------------------------
export TSAN_OPTIONS="${TSAN_OPTIONS:+$TSAN_OPTIONS:}halt_on_error=1:exitcode=66:second_deadlock_stack=1"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:+$UBSAN_OPTIONS:}halt_on_error=1:print_stacktrace=1"
asan_base="${ASAN_OPTIONS:+$ASAN_OPTIONS:}halt_on_error=1:detect_stack_use_after_return=1:strict_string_checks=1"

failed=()
summary=()
for b in $builds; do
    exe="$tmp/ring_test_$b"
    built=1
    wait "${build_pid[$b]}" || built=0
    cat "$tmp/build_$b.log" >&2
    if (( ! built )); then
        failed+=("$b (build)")
        summary+=("$(printf '%-6s BUILD FAILED' "$b")")
        continue
    fi
    build_s="$(cat "$tmp/build_$b.s")"
    t1=$(date +%s.%N)
    prefix=()
    [[ $b == tsan ]] && prefix=("${tsan_prefix[@]}")
    [[ $b == arm64 ]] && prefix=("${arm64_prefix[@]}")
    (( have_timeout )) && prefix=(timeout -k 10 "$run_timeout" "${prefix[@]}")
    echo "===== $b: ${flags[$b]}"
    run() {
        set +e
        ASAN_OPTIONS="$asan_base:detect_leaks=$1" "${prefix[@]}" "$exe" \
            "${test_args[@]}" 2>&1 | tee "$tmp/out_$b.log"
        rc=${PIPESTATUS[0]}
        set -e
    }
    run 1
    if [[ $b == asan && $rc -ne 0 ]] &&
        grep -q "LeakSanitizer has encountered a fatal error" "$tmp/out_$b.log"; then
        # LSan needs ptrace-like access that some containers deny
        echo "run_c_tests: LeakSanitizer cannot run here; rerunning without leak checks"
        run 0
    fi
    t2=$(date +%s.%N)
    status=ok
    if [[ $rc -ne 0 ]]; then
        status="FAILED (exit $rc)"
        if [[ $rc -eq 124 || $rc -eq 137 ]]; then status="FAILED (timed out)"; fi
        failed+=("$b")
    fi
    summary+=("$(awk -v b="$b" -v s="$status" -v bs="$build_s" -v t1="$t1" -v t2="$t2" \
        'BEGIN { printf "%-6s %-28s build %5.1f s  run %6.1f s", b, s, bs, t2 - t1 }')")
done

echo "===== summary"
printf '%s\n' "${summary[@]}"
if (( ${#failed[@]} )); then
    echo "run_c_tests: FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "run_c_tests: all builds passed"
