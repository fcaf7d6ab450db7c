/*
 * test_wait.c -- spinning, the spin policy and a client's wait for its answers (ring/wait.h).
 */
#include "harness.h"

/* Yielding spins (SHM_SPIN_YIELD): a client's wait and the evaluator's
 * collect look between sched_yield() calls while the budget lasts, then
 * sleep as before; the bit is a flag, not part of the budget (taken as a
 * budget it would spin for centuries: the waiter below never sleeps and
 * collect overruns its CPU bound).  A plain spin yields too, once every
 * SHM_SPIN_LOOKS looks: here the waiter and the thread that answers it
 * share one CPU (as a futex wake-up can leave a client and its evaluator),
 * and the answer comes only once the spin has given the CPU away. */
static void answer_all(shm_seg *s, uint32_t n) {
    char batch[4 * 336], res[4 * 32] = {0};
    shm_taken taken[4];
    uint32_t cursor = 0;
    CHECK_EQ(t_collect(s, batch, taken, 4, &cursor, 0, 0, 100 * MS), (int)n);
    CHECK_EQU(shm_complete(s, taken, n, res, 1), n);
}

static void test_yield(void) {
    start_test("yield", 60);
    const shm_params P = mkparams(336, 32, 4, 1, 4);
    test_seg ts;
    shm_seg *s = serving_seg(&ts, &P);
    register_clients(s, P.max_clients, 32000);
    /* answered within the budget by a thread on the waiter's CPU: both
     * spins give the CPU away (the answering thread sees a yield), and
     * both return the answer without sleeping */
    cpu_set_t all, one;
    CHECK_EQ(pthread_getaffinity_np(pthread_self(), sizeof all, &all), 0);
    CPU_ZERO(&one);
    CPU_SET(sched_getcpu(), &one);
    for (int yield = 0; yield < 2; yield++) {
        bell_arg a = {s, 0, 10000 * MS, 0, 0, 0, NULL, 0,
                      (500 * MS) | (yield ? SHM_SPIN_YIELD : 0)};
        pthread_t tid;
        CHECK_EQ(t_begin(s, 0, 0), SHM_OK);
        t_publish(s, 0, 0);
        unsigned long y0 = atomic_load(&g_yields);
        /* the waiter inherits this thread's one CPU */
        CHECK_EQ(pthread_setaffinity_np(pthread_self(), sizeof one, &one), 0);
        CHECK_EQ(pthread_create(&tid, NULL, bell_sleeper, &a), 0);
        uint64_t t0 = shm_now_ns();
        /* this thread runs while the waiter spins only if the spin yields */
        while (atomic_load(&g_yields) == y0) {
            CHECK_MSG(shm_now_ns() - t0 < PROMPT_NS,
                      "a %s spin of 500 ms never gave its CPU away",
                      yield ? "yielding" : "plain");
            sched_yield();
        }
        answer_all(s, 1);
        CHECK_EQ(pthread_join(tid, NULL), 0);
        CHECK_EQ(pthread_setaffinity_np(pthread_self(), sizeof all, &all), 0);
        CHECK_EQ(a.rc, SLOT_DONE);
        CHECK_MSG(!(word_of(s, 0, 0) & SLOT_WAITER),
                  "a %s spin of 500 ms slept before its answer",
                  yield ? "yielding" : "plain");
        CHECK_EQ(t_release(s, 0, 0), SHM_OK);
    }
    /* not answered within a 10 ms budget: the waiter goes to sleep (it
     * announces WAITER) and its answer still wakes it */
    {
        bell_arg a = {s, 1, 10000 * MS, 0, 0, 0, NULL, 0,
                      (10 * MS) | SHM_SPIN_YIELD};
        pthread_t tid;
        CHECK_EQ(t_begin(s, 1, 0), SHM_OK);
        t_publish(s, 1, 0);
        CHECK_EQ(pthread_create(&tid, NULL, bell_sleeper, &a), 0);
        uint64_t t0 = shm_now_ns();
        while (!(word_of(s, 1, 0) & SLOT_WAITER)) {
            CHECK_MSG(shm_now_ns() - t0 < PROMPT_NS,
                      "a yielding spin of 10 ms was still spinning after %.1f s",
                      secs(PROMPT_NS));
            sleep_ns(1 * MS);
        }
        CHECK(!atomic_load(&a.returned));
        answer_all(s, 1);
        t0 = shm_now_ns();
        while (!atomic_load(&a.returned))
            CHECK_MSG(shm_now_ns() - t0 < PROMPT_NS, "the answer did not wake it");
        CHECK_EQ(pthread_join(tid, NULL), 0);
        CHECK_EQ(a.rc, SLOT_DONE);
        CHECK_EQ(t_release(s, 1, 0), SHM_OK);
    }
    /* the evaluator: a spin of 10 ms (yielding, or plain), then a sleep
     * until its 300 ms timeout; it yields, and uses far less CPU than
     * 300 ms */
    for (int yield = 0; yield < 2; yield++) {
        char batch[4 * 336];
        shm_taken taken[4];
        uint32_t cursor = 0;
        unsigned long y0 = atomic_load(&g_yields);
        uint64_t c0 = thread_cpu_ns();
        CHECK_EQ(t_collect(s, batch, taken, 4, &cursor,
                             (10 * MS) | (yield ? SHM_SPIN_YIELD : 0), 0,
                             300 * MS), 0);
        uint64_t cpu = thread_cpu_ns() - c0;
        CHECK_MSG(atomic_load(&g_yields) > y0, "a %s collect never yielded",
                  yield ? "yielding" : "plain");
        CHECK_MSG(cpu < 150 * MS, "collect used %.1f ms of CPU in 300 ms",
                  (double)cpu / 1e6);
    }
    printf("  yield: yielding spins yield, answer, and sleep after their "
           "budget\n");
    seg_free(&ts);
}

/* The spin policy, case by case: a plain spin while every process has a
 * CPU, a yielding one with one process more, none beyond; the evaluator
 * counts itself with its clients, a client counts at least the crowding
 * the evaluator published. */
static void test_spin_policy(void) {
    start_test("spin_policy", 10);
    const uint64_t S = 50 * US, Y = SHM_SPIN_YIELD;
    struct {
        uint32_t processes, ncpu;
        uint64_t want;
    } cases[] = {
        {1, 1, S},     {1, 2, S},     {2, 2, S},     {3, 2, S | Y},
        {4, 2, 0},     {16, 2, 0},    {2, 1, S | Y}, {3, 1, 0},
        {8, 8, S},     {9, 8, S | Y}, {10, 8, 0},    {0, 4, S},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        CHECK_EQU(shm_spin_policy(S, cases[i].processes, cases[i].ncpu),
                  cases[i].want);
        /* no budget, no spin, whatever the machine */
        CHECK_EQU(shm_spin_policy(0, cases[i].processes, cases[i].ncpu), 0);
    }
    /* the evaluator: its clients and itself */
    CHECK_EQU(shm_evaluator_spin(S, 1, 2), S);
    CHECK_EQU(shm_evaluator_spin(S, 2, 2), S | Y);
    CHECK_EQU(shm_evaluator_spin(S, 3, 2), 0);
    CHECK_EQU(shm_evaluator_spin(S, 0, 1), S);
    /* a client: the attached clients and the evaluator, raised to the
     * processes the crowding stands for (never lowered by it) */
    CHECK_EQU(shm_client_spin(S, 1, SHM_CROWD_NONE, 2), S);
    CHECK_EQU(shm_client_spin(S, 2, SHM_CROWD_NONE, 2), S | Y);
    CHECK_EQU(shm_client_spin(S, 1, SHM_CROWD_YIELD, 2), S | Y);
    CHECK_EQU(shm_client_spin(S, 1, SHM_CROWD_SLEEP, 2), 0);
    CHECK_EQU(shm_client_spin(S, 7, SHM_CROWD_YIELD, 4), 0);
    CHECK_EQU(shm_client_spin(S, 3, SHM_CROWD_YIELD, 4), S | Y);
    CHECK_EQU(shm_client_spin(0, 1, SHM_CROWD_NONE, 8), 0);
}

/* A waiter held after setting WAITER and before reading its doorbell. */
typedef struct {
    shm_seg *s;
    hook_t hook;
    uint32_t gen;
    int rc;
    uint64_t ret_ns;
} reread_arg;

static void *held_waiter(void *arg) {
    reread_arg *a = arg;
    hook_arm(&a->hook, "wait_before_bell", 1);
    a->rc = shm_slot_wait(a->s, 0, 0, a->gen, 0, g_sleep_ns);
    a->ret_ns = shm_now_ns();
    return NULL;
}

/* The client's re-read of its state word after reading its doorbell: the
 * answer and its ring come between the waiter's WAITER CAS and its read of
 * the doorbell, so the value it reads already includes the ring.  It must
 * see the answer then, not sleep on that value until its timeout. */
static void test_reread(void) {
    start_test("reread", 60);
    const shm_params P = mkparams(64, 32, 1, 1, 8);
    test_seg t;
    shm_seg *s = serving_seg(&t, &P);
    CHECK_EQ(shm_client_register(s, 201, 1, 0), 0);
    reread_arg a;
    memset(&a, 0, sizeof a);
    a.s = s;
    a.gen = submit_one(s, 0, 0, 201, 0x11);
    pthread_t tw;
    CHECK_EQ(pthread_create(&tw, NULL, held_waiter, &a), 0);
    hook_wait_parked(&a.hook);
    CHECK(shm_slot_peek(s, 0, 0) & SLOT_WAITER);
    CHECK_EQ(answer_ready(s, 0x22), 1); /* DONE, and the doorbell rung */
    uint64_t t0 = shm_now_ns();
    hook_release(&a.hook);
    CHECK_EQ(pthread_join(tw, NULL), 0);
    CHECK_EQ(a.rc, SLOT_DONE);
    CHECK_MSG(a.ret_ns - t0 < PROMPT_NS,
              "the waiter slept %.3f s on a doorbell already rung for it",
              secs(a.ret_ns - t0));
    CHECK_EQ(shm_slot_release(s, 0, 0, a.gen), SHM_OK);
    seg_free(&t);
}

/* A pipelined waiter: shm_slots_wait_any over n slots of client 0. */
typedef struct {
    shm_seg *s;
    hook_t hook;
    const char *park;            /* hook point, or NULL */
    uint32_t ks[4], gens[4], n, which;
    int rc;
    _Atomic pid_t tid;
    uint64_t ret_ns;
} any_arg;

static void *any_waiter(void *arg) {
    any_arg *a = arg;
    if (a->park) hook_arm(&a->hook, a->park, 1);
    atomic_store(&a->tid, (pid_t)syscall(SYS_gettid));
    a->rc = shm_slots_wait_any(a->s, 0, a->ks, a->gens, a->n, 0, g_sleep_ns,
                               NULL, &a->which);
    a->ret_ns = shm_now_ns();
    return NULL;
}

/* Completes the one request of `taken` (n of them) that sits in slot k. */
static void complete_slot(shm_seg *s, shm_taken *taken, int n, uint32_t k) {
    char res[32];
    memset(res, 0x5A, sizeof res);
    for (int i = 0; i < n; i++)
        if (taken[i].slot == k) {
            CHECK_EQU(shm_complete(s, &taken[i], 1, res, 1), 1u);
            return;
        }
    FAIL("slot %u is not in the batch", k);
}

/* Waiting for any of several slots (pipelined requests): every pending
 * slot carries WAITER, so an answer to any of them, not just the first,
 * wakes the one sleep; an answer that lands between the WAITER CAS and the
 * doorbell read is seen by the re-read; a reclaimed slot and a timeout end
 * the wait with their own codes. */
static void test_wait_any(void) {
    start_test("wait_any", 60);
    const shm_params P = mkparams(64, 32, 1, 4, 8);
    test_seg t;
    shm_seg *s = serving_seg(&t, &P);
    CHECK_EQ(shm_client_register(s, 301, 1, 0), 0);
    uint32_t gens[3];
    for (uint32_t k = 0; k < 3; k++) gens[k] = submit_one(s, 0, k, 301, 0x30 + k);
    char batch[8 * 64];
    shm_taken taken[8];
    uint32_t cursor = 0;
    CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 1000 * MS), 3);

    /* 1. answered between the WAITER CAS and the doorbell read */
    any_arg a;
    memset(&a, 0, sizeof a);
    a.s = s;
    a.park = "wait_before_bell";
    a.n = 3;
    for (uint32_t i = 0; i < 3; i++) {
        a.ks[i] = i;
        a.gens[i] = gens[i];
    }
    pthread_t tw;
    CHECK_EQ(pthread_create(&tw, NULL, any_waiter, &a), 0);
    hook_wait_parked(&a.hook);
    for (uint32_t k = 0; k < 3; k++)
        CHECK_MSG(shm_slot_peek(s, 0, k) & SLOT_WAITER,
                  "slot %u has no WAITER bit while its client sleeps", k);
    complete_slot(s, taken, 3, 2);
    uint64_t t0 = shm_now_ns();
    hook_release(&a.hook);
    CHECK_EQ(pthread_join(tw, NULL), 0);
    CHECK_EQ(a.rc, SLOT_DONE);
    CHECK_EQU(a.which, 2u);
    CHECK_MSG(a.ret_ns - t0 < PROMPT_NS,
              "wait_any slept %.3f s on a doorbell already rung for it",
              secs(a.ret_ns - t0));
    CHECK_EQ(shm_slot_release(s, 0, 2, gens[2]), SHM_OK);

    /* 2. asleep over slots 0 and 1: the answer to slot 1 wakes it */
    memset(&a, 0, sizeof a);
    a.s = s;
    a.n = 2;
    a.ks[0] = 0, a.ks[1] = 1;
    a.gens[0] = gens[0], a.gens[1] = gens[1];
    CHECK_EQ(pthread_create(&tw, NULL, any_waiter, &a), 0);
    wait_asleep(&a.tid);
    t0 = shm_now_ns();
    complete_slot(s, taken, 3, 1);
    CHECK_EQ(pthread_join(tw, NULL), 0);
    CHECK_EQ(a.rc, SLOT_DONE);
    CHECK_EQU(a.which, 1u);
    CHECK_MSG(a.ret_ns - t0 < PROMPT_NS,
              "the answer to the second slot left its waiter asleep %.3f s",
              secs(a.ret_ns - t0));
    CHECK_EQ(shm_slot_release(s, 0, 1, gens[1]), SHM_OK);

    /* 3. a slot of another generation (reclaimed): SHM_STALE, its index */
    uint32_t ks[2] = {0, 1}, gg[2] = {gens[0], gens[1]}, which = 9;
    CHECK_EQ(shm_slots_wait_any(s, 0, ks, gg, 2, 0, 10 * MS, NULL, &which),
             SHM_STALE);
    CHECK_EQU(which, 1u);
    /* 4. nothing answered: a timeout, and which = n */
    CHECK_EQ(shm_slots_wait_any(s, 0, ks, gg, 1, 0, 20 * MS, NULL, &which),
             SHM_TIMEOUT);
    CHECK_EQU(which, 1u);
    complete_slot(s, taken, 3, 0);
    CHECK_EQ(shm_slots_wait_any(s, 0, ks, gg, 1, 0, 20 * MS, NULL, &which),
             SLOT_DONE);
    CHECK_EQU(which, 0u);
    CHECK_EQ(shm_slot_release(s, 0, 0, gens[0]), SHM_OK);
    seg_free(&t);
}

const test_case wait_tests[] = {
    {"yield", test_yield},
    {"spin_policy", test_spin_policy},
    {"reread", test_reread},
    {"wait_any", test_wait_any},
    {NULL, NULL},
};
