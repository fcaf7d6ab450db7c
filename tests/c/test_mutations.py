"""The C tests catch what they guard: each case below puts one known bug
back into a copy of the C core (a protocol step removed, or a memory order
weakened, in one of the headers under src/shmeval/_core/ring/) and runs the
C test that guards against it, which must then fail.

On x86 a weakened memory order changes no machine code, so ThreadSanitizer
is the only guard against those; the cases marked "tsan" show that it is one.
Each case runs one test of one build (tests/c/run_c_tests.sh), a few seconds.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest

from external import require_sanitizers

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "src" / "shmeval" / "_core"
SCRIPT = ROOT / "tests" / "c" / "run_c_tests.sh"


class Mutation(NamedTuple):
    name: str
    test: str          # the C test (tests/c/test_*.c) that must fail
    build: str         # plain, tsan or asan
    file: str          # the header the edits apply to, in _core/ring/
    edits: tuple[tuple[str, str], ...]  # (exact text of that header, replacement)


HWM_RAISE = """        uint32_t hwm =
            atomic_load_explicit(&h->clients_hwm, memory_order_relaxed);
        /* MO: release CAS; pairs with the acquire load of clients_hwm in
         * shm_clients_hwm (the evaluator's scans and housekeeping). */
        while (hwm < c + 1 &&
               !atomic_compare_exchange_weak_explicit(
                   &h->clients_hwm, &hwm, c + 1, memory_order_release,
                   memory_order_relaxed)) {
        }
"""

# The one wait core (shm_slots_wait_core) without its re-read of the slot
# words after the doorbell's load: both the wait of one slot and the wait
# for any of several sleep through an answer.
NO_REREAD = ((
    """        uint32_t seq = atomic_load_explicit(bell, memory_order_acquire);
        if ((*which = shm_slots_first(s, c, ks, gens, n, &rc)) < n) return rc;
""",
    "        uint32_t seq = atomic_load_explicit(bell, memory_order_acquire);\n"),)

MUTATIONS = [
    Mutation("client clears the evaluator's sleep flag", "lost_wakeup", "plain", "slot.h", ((
        "    if (sleeping) shm_futex_wake(&h->submit_seq, 1);",
        "    if (sleeping && atomic_exchange_explicit(&h->ev_sleeping, 0,\n"
        "                                             memory_order_seq_cst))\n"
        "        shm_futex_wake(&h->submit_seq, 1);"),)),
    Mutation("no re-read of the state word after the doorbell", "reread", "plain", "wait.h",
             NO_REREAD),
    Mutation("release ignores the generation", "release_race", "plain", "slot.h", ((
        """    /* MO: acquire fence; see above. */
    atomic_thread_fence(memory_order_acquire);
    /* MO: relaxed; the CAS below decides. */
    uint32_t cur = atomic_load_explicit(w, memory_order_relaxed);""",
        """    (void)gen;
    uint32_t old = atomic_load_explicit(w, memory_order_acquire);
    if (!shm_state_is_final(shm_word_state(old))) return SHM_E_STATE;
    atomic_store_explicit(w, shm_slot_word(SLOT_FREE, shm_word_gen(old) + 1),
                          memory_order_release);
    return SHM_OK;
    uint32_t cur = 0;"""),)),
    Mutation("begin by load and store", "begin_race", "plain", "slot.h", ((
        """    if (!atomic_compare_exchange_strong_explicit(
            w, &old, writing, memory_order_relaxed, memory_order_relaxed))
        return SHM_E_STATE;""",
        """    atomic_store_explicit(w, writing, memory_order_relaxed);"""),)),
    Mutation("high-water mark raised after the claim", "hwm_first", "plain", "clients.h", (
        (HWM_RAISE, ""),
        ('            SHM_HOOK("register_claimed");\n',
         '            SHM_HOOK("register_claimed");\n' + HWM_RAISE))),
    Mutation("the collect lock lets everyone in", "replicas", "plain", "replicas.h", ((
        """    _Atomic uint32_t *lock = &shm_hdr(s)->collect_lock;
    uint32_t me = v + 1, cur = 0;
""",
        """    _Atomic uint32_t *lock = &shm_hdr(s)->collect_lock;
    uint32_t me = v + 1, cur = 0;
    if (me) return SHM_OK;
"""),)),
    Mutation("a dead replica's batch is not put back", "replicas", "plain", "replicas.h", ((
        """    uint32_t n = atomic_load_explicit(&head->n, memory_order_acquire);
    uint32_t back = 0;""",
        """    uint32_t n = 0;
    uint32_t back = 0;"""),)),
    Mutation("reclaim hands the entry over relaxed", "handover", "tsan", "clients.h", ((
        "    atomic_store_explicit(&e->owner_pid, 0, memory_order_release);",
        "    atomic_store_explicit(&e->owner_pid, 0, memory_order_relaxed);"),)),
    Mutation("register claims the entry relaxed", "handover", "tsan", "clients.h", ((
        """                &e->owner_pid, &expected, pid, memory_order_acq_rel,
                memory_order_relaxed)) {""",
        """                &e->owner_pid, &expected, pid, memory_order_relaxed,
                memory_order_relaxed)) {"""),)),
    Mutation("detach relaxed", "handover", "tsan", "clients.h", ((
        """    atomic_store_explicit(&shm_client_at(s, c)->detached, 1,
                          memory_order_release);""",
        """    atomic_store_explicit(&shm_client_at(s, c)->detached, 1,
                          memory_order_relaxed);"""),)),
    Mutation("publish relaxed", "concurrency", "tsan", "slot.h", ((
        """            w, &cur, shm_slot_word(SLOT_READY, gen), memory_order_release,
            memory_order_relaxed))""",
        """            w, &cur, shm_slot_word(SLOT_READY, gen), memory_order_relaxed,
            memory_order_relaxed))"""),)),
    Mutation("publish by a plain store", "abort", "plain", "slot.h", ((
        """    if (!atomic_compare_exchange_strong_explicit(
            w, &cur, shm_slot_word(SLOT_READY, gen), memory_order_release,
            memory_order_relaxed))
        return SHM_STALE;""",
        """    (void)cur;
    atomic_store_explicit(w, shm_slot_word(SLOT_READY, gen),
                          memory_order_release);"""),)),
    Mutation("the take is a blind fetch_add", "take_race", "plain", "collect.h", ((
        """            while ((cur & ~SLOT_WAITER) == shm_slot_word(SLOT_READY, gen)) {
                if (atomic_compare_exchange_weak_explicit(
                        w, &cur, cur + (SLOT_TAKEN - SLOT_READY),
                        memory_order_relaxed, memory_order_relaxed)) {
                    took = 1;
                    break;
                }
            }""",
        """            atomic_fetch_add_explicit(w, SLOT_TAKEN - SLOT_READY,
                                      memory_order_relaxed);
            took = 1;"""),)),
    Mutation("the scan lists a slot after taking it", "listed_first", "plain", "collect.h", (
        ("""            copy[n] = t;
            atomic_store_explicit(&head->n, n + 1, memory_order_release);
            SHM_HOOK("scan_listed");""", ""),
        ("""            SHM_HOOK("scan_taken");""",
         """            SHM_HOOK("scan_taken");
            copy[n] = t;
            atomic_store_explicit(&head->n, n + 1, memory_order_release);"""))),
    Mutation("a put-back leaves the table as it was", "requeue_once", "plain", "replicas.h", ((
        """    atomic_store_explicit(&head->n, 0, memory_order_relaxed);
    return back;""",
        """    return back;"""),)),
    Mutation("a put-back without the collect lock", "requeue_once", "plain", "replicas.h", ((
        """    if (r >= s->p.replicas || cur != v + 1) return 0;""",
        """    if (r >= s->p.replicas) return 0;
    (void)cur, (void)v;"""),)),
    Mutation("a put-back of a replica serving again", "restart", "plain", "replicas.h", ((
        """    if (atomic_load_explicit(&shm_replica_at(s, r)->state,
                             memory_order_relaxed) == REPLICA_SERVING)
        return 0;""", ""),)),
    Mutation("a finder stops the restarted process", "restart", "plain", "lifecycle.h", ((
        """    if (pid && atomic_load_explicit(&shm_replica_at(s, r)->pid,
                                    memory_order_relaxed) != pid)
        return -1;""", "    (void)pid;"),)),
    Mutation("a restart leaves the dead process's lock", "restart", "plain", "replicas.h", ((
        """    if (id > r * per && id <= (r + 1) * per &&
        atomic_compare_exchange_strong_explicit(lock, &cur, 0,""",
        """    if (0 && id > r * per && id <= (r + 1) * per &&
        atomic_compare_exchange_strong_explicit(lock, &cur, 0,"""),)),
    Mutation("the put-back drops the waiter bit", "requeue_words", "plain", "replicas.h", ((
        """                    shm_slot_word(SLOT_READY, taken[i].gen) |
                        (cur & SLOT_WAITER),""",
        """                    shm_slot_word(SLOT_READY, taken[i].gen),"""),)),
    Mutation("the put-back ignores the generation", "requeue_words", "plain", "replicas.h", ((
        """             (cur & ~SLOT_WAITER) == want && tries < SHM_CAS_TRIES; tries++) {""",
        """             shm_word_state(cur) == SLOT_TAKEN && want + 1 && tries < SHM_CAS_TRIES;
             tries++) {"""),)),
    Mutation("the put-back trusts the table's indexes", "requeue_words", "asan", "replicas.h", ((
        """        if (taken[i].client >= s->p.max_clients ||
            taken[i].slot >= s->p.slots_per_client)
            continue;""", ""),)),
    Mutation("unlocking the collect lock wakes nobody", "lock_wake", "plain", "replicas.h", ((
        """    if (atomic_exchange_explicit(lock, 0, memory_order_release) &
        SHM_LOCK_WAITERS)
        shm_futex_wake(lock, 1);""",
        """    atomic_exchange_explicit(lock, 0, memory_order_release);"""),)),
    Mutation("no fair share between replicas", "fair_share", "plain", "collect.h", ((
        """        n = shm_scan(s, v, own, batch, n, &cap, s->p.replicas > 1 && max_wait_ns == 0,
                   cursor, now);""",
        """        n = shm_scan(s, v, own, batch, n, &cap, 0, cursor, now);"""),)),
    Mutation("the fair share cuts a waiting replica's batch", "waiting_cap", "plain",
             "collect.h", ((
                 """        n = shm_scan(s, v, own, batch, n, &cap, s->p.replicas > 1 && max_wait_ns == 0,
                   cursor, now);""",
                 """        n = shm_scan(s, v, own, batch, n, &cap, s->p.replicas > 1, cursor, now);"""),)),
    Mutation("the weights floor never comes down", "version_floor", "plain", "replicas.h", ((
        """    /* Nobody serves the floor: bring it down to us (unless it moved). */
    return atomic_compare_exchange_strong_explicit(
        floor, &cur, version, memory_order_relaxed, memory_order_relaxed);""",
        """    return 0;"""),)),
    Mutation("begin does not check its owner again", "begin_owner", "plain", "slot.h", ((
        """    if (atomic_load_explicit(&shm_client_at(s, c)->owner_pid,
                             memory_order_relaxed) != pid) {
        uint32_t cur = writing;""",
        """    if (0) {
        uint32_t cur = writing;"""),)),
    Mutation("completion CAS relaxed", "concurrency", "tsan", "collect.h", ((
        """                    w, &cur, shm_slot_word(final_state, taken[i].gen),
                    memory_order_release, memory_order_relaxed)) {""",
        """                    w, &cur, shm_slot_word(final_state, taken[i].gen),
                    memory_order_relaxed, memory_order_relaxed)) {"""),)),
    Mutation("wait_any marks only the first slot", "wait_any", "plain", "wait.h", ((
        """        for (uint32_t i = 0; i < n; i++) {
            _Atomic uint32_t *w = shm_slot_word_at(s, c, ks[i]);""",
        """        for (uint32_t i = 0; i < 1; i++) {
            _Atomic uint32_t *w = shm_slot_word_at(s, c, ks[i]);"""),)),
    Mutation("wait_any does not re-read after the doorbell", "wait_any", "plain", "wait.h",
             NO_REREAD),
    Mutation("the cache reader does not verify the check word", "cache_torn", "plain", "cache.h", ((
        """        if (atomic_load_explicit(&e->key, memory_order_relaxed) != key ||
            shm_cache_check(key, key2, v, out, nw) != chk)
            continue;""",
        """        (void)chk, (void)key2;
        if (atomic_load_explicit(&e->key, memory_order_relaxed) != key)
            continue;"""),)),
    Mutation("the cache's check word leaves out the data", "cache_torn", "plain", "cache.h", ((
        """    uint64_t i = 0;
    for (; i + 2 <= nw; i += 2) h = shm_check_step(h, data[i], data[i + 1]);""",
        """    uint64_t i = nw;
    for (; i + 2 <= nw; i += 2) h = shm_check_step(h, data[i], data[i + 1]);"""),)),
    Mutation("a put-back does not ring for completed slots", "requeue_rings", "plain", "replicas.h", ((
        """        if (shm_state_is_final(shm_word_state(cur)) &&
            shm_word_gen(cur) == taken[i].gen)
            shm_ring_word""",
        """        if (0)
            shm_ring_word"""),)),
    Mutation("a reclaim wakes nobody", "reclaim_wakes", "plain", "clients.h", ((
        """    shm_ring_word(&h->done_seq[c / 32u], 1u << (c % 32u));\n""", ""),)),
    Mutation("one word can zero the cache check's history", "cache_check", "plain", "cache.h", ((
        """    return shm_mum(h ^ x ^ 0xA0761D6478BD642Full, h ^ y ^ 0xE7037ED1A0B428DBull) ^ h;""",
        """    return shm_mum(h ^ x ^ 0xA0761D6478BD642Full, y ^ 0xE7037ED1A0B428DBull);"""),)),
    Mutation("the cache accepts answers of older weights", "cache", "plain", "cache.h", ((
        """        if (v < min_version) {
            old = 1;""",
        """        if (min_version == UINT64_MAX) {
            old = 1;"""),)),
    Mutation("the cache's data words written by plain stores", "cache_threads", "tsan", "cache.h", ((
        """        atomic_store_explicit(&d[i], data[i], memory_order_relaxed);
    }""",
        """        ((uint64_t *)d)[i] = data[i];
    }"""),)),
    Mutation("the cache forgets which entries were hit", "cache", "plain", "cache.h", ((
        "        uint64_t stamp = SHM_CACHE_HIT_BIT | shm_cache_now();",
        "        uint64_t stamp = shm_cache_now();"),)),
    Mutation("the report writer leaves the sequence number even", "report", "plain", "lifecycle.h", ((
        "    atomic_store_explicit(&rep->report_seq, seq + 1, memory_order_relaxed);\n",
        ""),)),
]


def copy_core(dest: Path) -> None:
    """The C core (ring.h and the headers it includes) into dest."""
    shutil.copy(CORE / "ring.h", dest / "ring.h")
    shutil.copytree(CORE / "ring", dest / "ring")


def mutate(dest: Path, m: Mutation) -> None:
    copy_core(dest)
    header = dest / "ring" / m.file
    text = header.read_text()
    for old, new in m.edits:
        assert text.count(old) == 1, f"{m.name}: the text to mutate is not in ring/{m.file} " \
                                     f"exactly once (it changed? update this case):\n{old}"
        text = text.replace(old, new)
    header.write_text(text)


#: The sanitizer each build of run_c_tests.sh links with.
BUILD_SANITIZERS = {"plain": (), "tsan": ("thread",), "asan": ("address,undefined",)}


def run_c_test(ring_dir: Path, test: str, build: str) -> subprocess.CompletedProcess[str]:
    require_sanitizers(*BUILD_SANITIZERS[build])
    env = dict(os.environ, RING_H_DIR=str(ring_dir), RING_TEST_ARGS=test,
               RING_TEST_BUILDS=build, RUN_TIMEOUT="60", RING_TEST_PLAIN_OPT="-O1",
               # a short concurrency run is enough for TSan to see a race
               SHM_TEST_CLIENTS="2", SHM_TEST_REQUESTS="300",
               # a lost wake-up then costs 3 s instead of 10
               SHM_TEST_SLEEP_MS="3000")
    bash = shutil.which("bash")
    assert bash is not None, "bash is needed to run tests/c/run_c_tests.sh"
    return subprocess.run([bash, str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("m", MUTATIONS, ids=[m.name.replace(" ", "-") for m in MUTATIONS])
def test_broken_ring_fails_its_test(m: Mutation, tmp_path: Path) -> None:
    mutate(tmp_path, m)
    r = run_c_test(tmp_path, m.test, m.build)
    out = r.stdout + r.stderr
    assert r.returncode != 0, f"ring_test {m.test} ({m.build}) passed with '{m.name}':\n{out}"
    # It failed where it should: a failed check, or a reported race, not a
    # build error.
    assert "BUILD FAILED" not in out, out
    assert ("FAIL [" in out or "ThreadSanitizer: data race" in out
            or "TIMEOUT [" in out or "ERROR: AddressSanitizer" in out), out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("build", sorted({m.build for m in MUTATIONS}))
def test_unbroken_ring_passes(build: str, tmp_path: Path) -> None:
    """The same runs pass on the real headers (so the failures above are the
    mutations')."""
    copy_core(tmp_path)
    tests = " ".join(sorted({m.test for m in MUTATIONS if m.build == build}))
    r = run_c_test(tmp_path, tests, build)
    assert r.returncode == 0, r.stdout + r.stderr
