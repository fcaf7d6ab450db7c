# Included by shmeval/_ring.pyx: Pending, the answers to one submit collected later.

# A Pending's requests: each is in flight and claimed by nobody, claimed by
# the thread waiting for it (or given up by a failure or a finalizer), or
# fetched.  Claims are plain stores made with the GIL held and no Python
# code between the look and the store, so that one thread waits for each
# request however many threads collect (a wait may release the GIL).  A
# request is fetched unclaimed: with the GIL held and no Python code from
# the look at its state to its record as fetched, so each is fetched once,
# and one whose fetch raises stays in flight.
cdef enum:
    REQ_LEFT = 0
    REQ_CLAIMED = 1
    REQ_FETCHED = 2


@cython.no_gc_clear  # __dealloc__ needs its port, also after a cycle's collection
@cython.auto_pickle(False)  # belongs to the process that submitted it
@cython.freelist(16)  # one per submission: a pipelined worker makes and frees them all the time
cdef class Pending:
    """The answers to one ``Client.submit``, collected later.

    ``result(timeout=None)`` returns what ``evaluate_many`` would have
    returned for the same states (and raises what it would have raised);
    ``done()`` says whether ``result()`` would return or raise without
    waiting.  Collect it in the process that submitted it.  Dropping it
    uncollected is allowed: its slots come back once the evaluator has
    answered them.

    A request is a state posted (one the evaluation cache did not answer at
    the submit): request i is output row ``rows[i]``, in slot ``ks[i]``
    begun with generation ``gens[i]``.  ``evaluate`` and ``evaluate_many``
    post and collect through a Pending too (ClientPort._post, then _collect);
    what is unusual (a timeout, a closed or dead evaluator, a reclaimed
    entry) is judged by the process's ``shmeval.entry.ProcessEntry``.
    """

    def __init__(self):
        raise TypeError("a Pending is made by Client.submit")

    cdef inline void _armed(self, Py_ssize_t m, bint own) noexcept:
        """Requests 0..m-1 (ks, gens, rows set) are in flight.  own: a
        submit's, each slot's owner on the port, which the entry's harvests
        and slot waits ask."""
        cdef Py_ssize_t i
        self._m = self.unclaimed = m
        self.own = own
        for i in range(m):
            self.state[i] = REQ_LEFT
            if own:
                self.port.owner[self.ks[i]] = <PyObject *>self

    def __len__(self):
        return self._n

    def __repr__(self):
        left = self._m - self.fetched
        what = ("failed" if self.exc is not None else
                f"{left} in flight" if left else "done")
        return f"<Pending {self._n} state(s), {what}>"

    @property
    def _entry(self):
        """The process entry it was posted through (shmeval.entry)."""
        return self.port.entry

    @property
    def _in_flight(self):
        """How many requests are in flight and claimed by nobody."""
        return self.unclaimed

    # -------------------------------------------------------- public
    def done(self):
        """True when :meth:`result` would return or raise without waiting.
        Copies out the answers already there (freeing their slots)."""
        if self.result_ is not None or self.exc is not None:
            return True
        self._check_process()
        self._harvest()
        if self.exc is not None or self.fetched == self._m:
            return True
        return self.port.detached or shm_ev_state(&self.seg.seg) >= EV_CLOSED

    def result(self, timeout=None):
        """The outputs, as ``evaluate_many`` returns them (with
        ``submit(..., return_version=True)``, the pair ``(outputs,
        versions)``).  Waits up to ``timeout`` seconds (None: as long as
        the evaluator lives), then raises ShmevalTimeout (a TimeoutError)
        with the request still in flight (call again to go on waiting).
        Raises ModelError, EvaluatorClosed and EvaluatorDied as
        evaluate_many does; a second call returns (or raises) the same."""
        if self.result_ is not None:
            return self.result_
        self._check_process()
        self._collect(0.0 if timeout is None else _monotonic() + timeout, timeout)
        return self._finish()

    # -------------------------------------------------------- internals
    def _check_process(self):
        if self.port.pid != _current_pid:
            raise ShmevalError("a Pending is collected in the process that submitted it")

    cdef int _collect(self, double deadline, object timeout) except -1:
        """Waits for and copies out every request in flight, claiming each
        for its wait, so that another thread collecting the same Pending
        never waits for it too.  A wait that ends without an answer goes to
        the entry's judgement (``ProcessEntry.judge``), which raises for a
        closed, dead or reclaimed entry and returns on a timeout of a
        healthy evaluator; with a deadline (CLOCK_MONOTONIC s, 0: none)
        ShmevalTimeout is raised once it passes, the requests still in
        flight."""
        cdef Py_ssize_t i
        cdef uint32_t k, gen
        cdef int rc
        cdef uint64_t wait_ns, version = 0
        cdef ClientPort port = self.port
        while True:
            if self.exc is not None:
                raise self.exc.with_traceback(None)
            if self.fetched == self._m:
                return 0
            i = self._claim()
            if i < 0:  # another thread is waiting for the last requests
                _sleep(0.001)
                continue
            k, gen = self.ks[i], self.gens[i]
            wait_ns = port.timeout_ns
            if deadline:
                wait_ns = <uint64_t>max(0.0, min(<double>wait_ns,
                                                 (deadline - _monotonic()) * 1e9))
            rc = port._wait_one(k, gen, wait_ns)
            # The GIL is held from here to the record (or the judgement).
            self._unclaim(i)
            if rc >= 0:
                rc = self.seg._fetch(self.lay, port.c, k, gen, self._outs, self.rows[i], True,
                                     &version)
            if rc < 0:
                if rc == SHM_STALE:  # not ours any more
                    self._claim_at(i)
                    self._give_up(i)
                try:
                    port.entry.judge(rc)
                except ShmevalError as e:
                    self._fail(e)
                    raise
                if deadline and _monotonic() >= deadline:
                    raise ShmevalTimeout(f"{self!r}: no answer within {timeout} s")
                continue
            self._record(i, rc, version)
            port._give_back(k)

    cdef inline Py_ssize_t _claim(self) noexcept:
        """Claims the oldest request nobody is waiting for; -1 if none."""
        cdef Py_ssize_t i
        if self.unclaimed:
            for i in range(self._m):
                if self.state[i] == REQ_LEFT:
                    self._claim_at(i)
                    return i
        return -1

    cdef inline void _claim_at(self, Py_ssize_t i) noexcept:
        self.state[i] = REQ_CLAIMED
        self.unclaimed -= 1

    cdef inline void _unclaim(self, Py_ssize_t i) noexcept:
        self.state[i] = REQ_LEFT
        self.unclaimed += 1

    cdef inline int _record(self, Py_ssize_t i, int rc, uint64_t version) except -1:
        """Request i, unclaimed, fetched: Segment._fetch's status rc, DONE
        with its model version, or FAILED with its batch's error text."""
        cdef Py_ssize_t row = self.rows[i]
        cdef object text
        if rc == SLOT_FAILED:
            text = self.seg._take_error()
            if self.error is None or row > self.error_row:  # the last failed row's
                self.error_row, self.error = row, text
        else:
            self.version = <int64_t>version
            if self._versions is not None:
                (<int64_t *>cnp.PyArray_DATA(self._versions))[row] = <int64_t>version
        self.state[i] = REQ_FETCHED
        self.unclaimed -= 1
        self.fetched += 1
        self._disown(i)
        return 0

    cdef int _give_up(self, Py_ssize_t i) except -1:
        """Request i, claimed, was reclaimed: not ours to fetch; its slot
        goes to the abandoned list (ProcessEntry.give_back)."""
        self._disown(i)
        self.port.entry.give_back([], [(self.ks[i], self.gens[i])])
        return 0

    cdef inline void _disown(self, Py_ssize_t i) noexcept:
        """Request i is no longer this Pending's to fetch (fetched, or given
        up): its slot's owner is cleared."""
        if self.port.owner[self.ks[i]] == <PyObject *>self:
            self.port.owner[self.ks[i]] = NULL

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.port is not None:
            if self.unclaimed and self.port.pid == _current_pid:
                self._abandon()
            for i in range(self._m):
                self._disown(i)
            # Its arrays may serve a later submit once nobody holds them
            # (ClientPort._spare_outs checks); a failed Pending's are left
            # to the allocator.
            if self.own and self.port.fast and self._n and self._outs is not None and \
                    self.fetched == self._m and self.port.pid == _current_pid:
                self.port._keep_spare(self._outs)

    cdef object _finish(self):
        cdef dict result
        cdef uint32_t j
        if self.error is not None:
            self.exc = ModelError(self.error)
            raise self.exc.with_traceback(None)
        result = {}
        for j in range(self.lay.n_out):
            result[self.lay.out_names[j]] = self._outs[j]
        self.result_ = result if self._versions is None else (result, self._versions)
        return self.result_

    def _rows_in_flight(self):
        """(slot, generation) of the requests nobody is fetching now."""
        cdef Py_ssize_t i
        return [(self.ks[i], self.gens[i]) for i in range(self._m)
                if self.state[i] == REQ_LEFT]

    def _harvest(self):
        """Fetches every request whose answer is there, without waiting;
        returns how many.  One found reclaimed fails the Pending as
        evaluate_many fails then."""
        cdef Py_ssize_t i, got = 0
        cdef uint32_t w, st, k, gen
        cdef int rc
        cdef uint64_t version = 0
        cdef ClientPort port = self.port
        if not self.unclaimed or port.pid != _current_pid:
            return 0
        for i in range(self._m):
            if self.state[i] != REQ_LEFT:
                continue
            k, gen = self.ks[i], self.gens[i]
            w = shm_slot_peek(&self.seg.seg, port.c, k)
            st = w & SLOT_STATE_MASK
            if w >> SLOT_GEN_SHIFT == gen and st != SLOT_DONE and st != SLOT_FAILED:
                continue  # not answered yet
            rc = (self.seg._fetch(self.lay, port.c, k, gen, self._outs, self.rows[i], True,
                                  &version)
                  if w >> SLOT_GEN_SHIFT == gen else SHM_STALE)
            if rc < 0:  # reclaimed: the slot is not ours any more
                self._claim_at(i)
                self._give_up(i)
                try:
                    port.entry.judge(SHM_STALE)
                except ShmevalError as e:
                    self._fail(e)
                return got
            self._record(i, rc, version)
            port._give_back(k)
            got += 1
        return got

    def _claim_all(self):
        """Claims every request nobody is fetching: (slot, generation) each."""
        cdef Py_ssize_t i
        cdef list out = []
        for i in range(self._m):
            if self.state[i] == REQ_LEFT:
                self.state[i] = REQ_CLAIMED
                self._disown(i)
                out.append((self.ks[i], self.gens[i]))
        self.unclaimed = 0
        return out

    def _fail(self, exc):
        """The request cannot be answered (closed, dead, reclaimed): result()
        raises exc; the requests still in flight are abandoned.  A
        submission whose every answer is already in is not failed."""
        if self.fetched == self._m:
            return
        if self.exc is None:
            self.exc = exc
        rows = self._claim_all()
        if rows:
            self.port.entry.give_back([], rows)

    cdef void _abandon(self) noexcept:
        """Requests nobody will collect (the Pending is being freed): their
        slots come back once answered (the entry's abandoned list).  Run
        from __dealloc__ rather than a finalizer, which every Pending would
        pay for."""
        try:
            rows = self._claim_all()
            if rows:
                self.port.entry.abandon(rows)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
