# Included by shmeval/_ring.pyx: SpinArms, a client's measured spin budget.

# SpinArms' constants (SPIN_BLOCK, SPIN_TRIM, SPIN_EXPLORE, SPIN_EXPLORE_MAX,
# SPIN_COVER_Q, SPIN_COVER_MAX) are an enum in _ring.pxd, where the arrays
# of SpinArms are sized by them.  The share of the way an arm's mean moves
# to each of its blocks' means:
cdef double SPIN_SMOOTH = 2.0


cdef class SpinArms:
    """How long a client spins before it sleeps, chosen by what its own
    waits measure (``spin_us="auto"``).

    Two budgets (arms): ``short_ns``, the measured cost of a sleep and a
    wake-up, which spinning can never make more than twice as costly as
    the better choice made in hindsight; and ``long_ns``, several of them,
    which catches an answer that comes a little later than that (a fast
    model, a short batch) without the sleep, the evaluator's wake-up call
    and the wake-up's latency.  Which pays depends on the model, the load
    and the machine, so the client measures it: each wait's ns (from the
    post to the answer) counts towards its arm's mean, the arm with the
    shorter mean serves, and the other one is tried again from time to
    time, so that a change of load is followed.  A spin that costs another
    process its CPU shows as longer waits and loses.

    The arms take turns by blocks of SPIN_BLOCK waits, not wait by wait:
    what a spin saves shows only while it lasts (a CPU that stays awake, an
    evaluator that finds its clients spinning), so one long wait among
    short ones measures the short arm's regime, not the long arm's; and a
    block's mean of 64 waits is steady where a mean smoothed over a few
    waits follows their tail.  The block's SPIN_TRIM longest waits are left
    out of its mean: a wait that the scheduler or the host preempted takes
    milliseconds under either arm, and a few of them in one block outweigh
    the microseconds per wait that the arms differ by.  A block of the
    worse arm comes after as many
    blocks of the better one as SPIN_EXPLORE times the ratio of their
    means, so that trying an arm five times as slow costs no more time
    than trying one a little slower.  ``long_ns`` 0: one fixed budget
    (``spin_us`` set by the caller).

    The long arm as given (``long_floor_ns``, ``waiting.SPIN_LONG_WAKES`` wake-ups)
    can be shorter than the answers: a model call of 200 µs outlasts 16
    wake-ups of 7 µs, and then both arms sleep, though the CPU the client
    would spin on is free (the spin policy lets it spin only then, or
    yielding) and a spin through the call served 9-11% more than a sleep
    (docs/performance.md, *The tuner*).  So the long arm stretches to
    cover most answers: the upper quartile of a short block's waits, plus
    a quarter.  The short arm's waits are the measure because they do not
    depend on the long arm (a long spin that slows the answers it waits
    for would otherwise lengthen itself); the stretch stops at
    SPIN_COVER_MAX times the long arm as given, beyond which a sleep costs
    too small a share of the wait to be worth a CPU spinning through it,
    and then the long arm is the one given.  A changed long arm is
    measured afresh."""

    def __cinit__(self, uint64_t short_ns, uint64_t long_ns=0):
        self.short_ns = short_ns
        self.long_ns = long_ns if long_ns > short_ns else 0
        self.long_floor_ns = self.long_ns
        self.explore_in = SPIN_EXPLORE
        self.best = -1

    cdef uint64_t pick(self) noexcept:
        """The budget of the next wait (before the spin policy)."""
        if self.long_ns == 0:
            return self.short_ns
        return self.long_ns if self.arm else self.short_ns

    cdef void saw(self, uint64_t ns) noexcept:
        """The wait that pick() budgeted took ns.  A wait longer than its
        budget slept, and the evaluator paid a system call to wake it: it
        counts one wake-up (``short_ns``) more, so that where the arms wait
        alike, the arm that leaves the evaluator's time to the other
        clients serves.  Counted up to twice the long arm (a longer wait
        slept under either arm), and kept in ``top`` while it is one of the
        block's SPIN_TRIM longest, which the block's mean leaves out.  The
        last wait of a block updates its arm's mean and chooses the next
        block's."""
        cdef double *m
        cdef double block
        cdef int best
        cdef uint32_t i
        if self.long_ns == 0:
            return
        if self.arm == 0:
            self.short_waits[self.waits] = ns
        if ns > (self.long_ns if self.arm else self.short_ns):
            ns += self.short_ns  # it slept, and its waker paid a wake-up
        ns = min(ns, 2 * self.long_ns)
        self.block_ns += <double>ns
        self.waits += 1
        if ns > self.top[self.top_min]:  # one of the block's longest so far
            self.top[self.top_min] = ns
            for i in range(SPIN_TRIM):
                if self.top[i] < self.top[self.top_min]:
                    self.top_min = i
        if self.waits < SPIN_BLOCK:
            return
        for i in range(SPIN_TRIM):
            self.block_ns -= <double>self.top[i]
            self.top[i] = 0
        block = self.block_ns / (self.waits - SPIN_TRIM)
        self.blocks[self.arm] += 1
        self.block_ns = 0
        self.waits = 0
        m = &self.mean_ns[self.arm]
        if m[0] == 0 or self.checking:
            m[0] = block  # a check measures the arm afresh
        else:
            m[0] += (block - m[0]) / SPIN_SMOOTH
        if self.arm == 0:
            self._cover()
        if self.mean_ns[0] == 0 or self.mean_ns[1] == 0:  # an arm not measured yet
            self.arm = 1 if self.mean_ns[1] == 0 else 0
            return
        best = 1 if self.mean_ns[1] < self.mean_ns[0] else 0
        if self.best != best and not self.checking and self.best >= 0:
            # The verdict changed: the arm that lost it serves one block
            # more, whose mean replaces its own, and that decides.  A block
            # that the host slowed (more than SPIN_TRIM preempted waits)
            # then costs one block of the worse arm, not the SPIN_EXPLORE
            # blocks until it would be tried again.
            self.best = best
            self.checking = True
            self.arm = 1 - best
            return
        self.best = best
        if self.checking:
            self.checking = False
            self.explore_in = SPIN_EXPLORE
        if self.explore_in > 0:
            self.explore_in -= 1
            self.arm = best
            return
        self.arm = 1 - best
        self.explore_in = <uint32_t>min(<double>SPIN_EXPLORE_MAX,
                                        SPIN_EXPLORE * self.mean_ns[1 - best] / self.mean_ns[best])

    cdef void _cover(self) noexcept:
        """After a short block: the long arm that covers its answers
        (the class's docstring)."""
        cdef uint64_t *w = self.short_waits
        cdef uint64_t x, want
        cdef int i, j
        for i in range(1, SPIN_BLOCK):  # insertion sort: 64 waits per block
            x = w[i]
            j = i - 1
            while j >= 0 and w[j] > x:
                w[j + 1] = w[j]
                j -= 1
            w[j + 1] = x
        want = w[SPIN_COVER_Q] + w[SPIN_COVER_Q] // 4
        if want <= self.long_floor_ns or want > SPIN_COVER_MAX * self.long_floor_ns:
            want = self.long_floor_ns
        if 4 * want >= 5 * self.long_ns or 5 * want <= 4 * self.long_ns:
            self.long_ns = want
            self.mean_ns[1] = 0  # not measured at this budget yet

    def next_budget(self):
        """pick(), for tests."""
        return self.pick()

    def record(self, uint64_t ns):
        """saw(ns), for tests."""
        self.saw(ns)

    def report(self):
        """The arms and each one's mean wait in µs (None: not measured yet)."""
        return {"short_us": self.short_ns / 1e3, "long_us": self.long_ns / 1e3,
                "long_given_us": self.long_floor_ns / 1e3,
                "short_wait_us": self.mean_ns[0] / 1e3 if self.mean_ns[0] else None,
                "long_wait_us": self.mean_ns[1] / 1e3 if self.mean_ns[1] else None,
                "arm": ("fixed" if self.long_ns == 0 else
                        "measuring" if not (self.mean_ns[0] and self.mean_ns[1]) else
                        "long" if self.mean_ns[1] < self.mean_ns[0] else "short"),
                "short_blocks": self.blocks[0], "long_blocks": self.blocks[1]}
