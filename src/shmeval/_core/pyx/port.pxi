# Included by shmeval/_ring.pyx: ClientPort, the request path of one process, and the client entry points.

cdef inline int _publish_and_wait(shm_seg *s, uint32_t c, uint32_t k, uint32_t gen,
                                  uint64_t spin_ns, uint64_t timeout_ns,
                                  shm_ticker *t) noexcept nogil:
    """Hands slot (c, k) to the evaluator and waits for its answer."""
    if shm_slot_publish(s, c, k, gen) != SHM_OK:
        return SHM_STALE
    shm_notify_evaluator(s, 1)
    return shm_slot_wait_ticked(s, c, k, gen, spin_ns, timeout_ns, t)


cdef class ClientPort:
    """The hot path of ``Client.evaluate`` for one process: checks, slot
    allocation, copy in, publish, wait, copy out and the result dict in one
    call, so that a round trip runs a few hundred bytecodes fewer (which
    matters most when processes outnumber cores and every wake-up starts
    with cold caches).  Anything unusual returns to the Python slow path.

    ``free`` is the process's list of free slot indices, shared with the
    Python ``Client`` (single list operations are atomic under the GIL);
    ``waiters`` counts threads waiting for a slot, which ``notify`` wakes.
    """

    def __cinit__(self, Segment seg, uint32_t c, list free, object in_dtype, tuple in_shape,
                  uint64_t spin_ns, uint64_t timeout_ns, uint32_t ncpu, object notify,
                  uint64_t spin_long_ns=0):
        cdef int i
        self.seg = seg
        self.arms = SpinArms(spin_ns, spin_long_ns)
        self.c = c
        self.pid = _current_pid
        self.free = free
        self.in_dtype = in_dtype
        self.in_nd = len(in_shape)
        # Outputs of a native built-in dtype are created with PyArray_EMPTY;
        # any other declared output keeps this port on the slow path.
        self.fast = seg.out_native and seg.n_out > 0 and self.in_nd <= 32
        for i in range(min(self.in_nd, 32)):
            self.in_dims[i] = in_shape[i]
        self.spin_ns = spin_ns
        self.timeout_ns = timeout_ns
        self.ncpu = ncpu
        self.notify = notify
        self.abandoned = []
        self.spares = []

    def owners(self):
        """The Pendings with requests in flight on this entry (each once)."""
        cdef uint32_t k
        cdef list out = []
        cdef set seen = set()
        for k in range(SHM_MAX_SLOTS_PER_CLIENT):
            if self.owner[k] != NULL and <object>self.owner[k] not in seen:
                seen.add(<object>self.owner[k])
                out.append(<object>self.owner[k])
        return out

    cpdef give_back(self, uint32_t k):
        self.free.append(k)
        if self.waiters:
            self.notify()

    def evaluate(self, object state, object key=None):
        """Returns the result dict; the error text (str) when the batch
        failed; a tuple (status, slot, generation, outputs) when the wait
        timed out, the evaluator closed (the slot is still in flight) or the
        slot was reclaimed (status STALE); or None when the fast path does
        not apply (the caller takes the general path), which includes a call
        from a forked child of the registering process.  key: the state's
        cache key (the caller's), or None to hash its bytes."""
        return self._evaluate(state, False, key)

    def evaluate_versioned(self, object state, object key=None):
        """As evaluate, but a result comes as (dict, model version)."""
        return self._evaluate(state, True, key)

    cdef object _evaluate(self, object state, bint versioned, object key):
        cdef cnp.ndarray a
        cdef uint32_t k, j, gen
        cdef int rc, i
        cdef uint64_t spin, t0, k1 = 0, k2 = 0, cached_version = 0
        cdef shm_ticker *t
        cdef list outs
        cdef dict result
        cdef bint reuse
        cdef object r
        if type(state) is not cnp.ndarray or not self.fast or self.pid != _current_pid:
            return None
        a = <cnp.ndarray>state
        if not cnp.PyArray_IS_C_CONTIGUOUS(a) or cnp.PyArray_NDIM(a) != self.in_nd:
            return None
        for i in range(self.in_nd):
            if cnp.PyArray_DIM(a, i) != self.in_dims[i]:
                return None
        if <PyObject *>cnp.PyArray_DESCR(a) != <PyObject *>self.in_dtype and \
                a.dtype != self.in_dtype:
            return None
        if shm_ev_state(&self.seg.seg) >= EV_CLOSING or self.retired:
            return None
        # A cached result is taken out of the port while in use, so that
        # another thread of this process cannot take it too.
        reuse = True
        if self._unreferenced(0):
            result, outs = self.last, self.last_outs
            self.last = self.last_outs = None
        elif self._unreferenced(1):
            result, outs = self.prev, self.prev_outs
            self.prev = self.prev_outs = None
        else:
            reuse = False
            outs = []
            for j in range(self.seg.n_out):
                outs.append(cnp.PyArray_EMPTY(self.seg.out_nd[j], self.seg._out_dims(j),
                                              self.seg.out_type[j], 0))
        if self.seg.seg.p.cache_log2 and self.seg._cache_get(
                self.c, <const char *>cnp.PyArray_DATA(a), key, outs, 0, &k1, &k2,
                &cached_version):
            r = cached_version  # answered here, without a round trip
        else:
            if not self.free:
                return None
            k = self.free.pop()
            if self.retired:  # closed meanwhile (Client.close waits for popped slots)
                self.free.append(k)
                return None
            try:
                gen = self.seg._begin(self.c, k)
            except BaseException:
                self.free.append(k)
                raise
            shm_copy(shm_slot_in(&self.seg.seg, self.c, k),
                     <const char *>cnp.PyArray_DATA(a), self.seg.seg.p.in_bytes)
            self.seg._cache_as(self.c, k, k1, k2, key is None)
            spin = self.seg._spin(self.arms.pick(), self.ncpu)
            t = self.seg._ticker_for(self.c, self.timeout_ns)
            # The clock only where the arms judge the wait: "auto", spinning allowed.
            t0 = shm_now_ns() if spin and self.arms.long_ns else 0
            if shm_only_python_thread():
                # The process's only Python thread: no one else wants the GIL,
                # and releasing and taking it back was about 5% of a worker's
                # CPU time with 16 workers on 2 cores (docs/performance.md).
                rc = _publish_and_wait(&self.seg.seg, self.c, k, gen, spin, self.timeout_ns,
                                       t)
            else:
                with nogil:
                    rc = _publish_and_wait(&self.seg.seg, self.c, k, gen, spin,
                                           self.timeout_ns, t)
            if rc < 0:
                return (rc, k, gen, outs)
            if t0:  # spinning was allowed: the wait is the arm's to judge
                self.arms.saw(shm_now_ns() - t0)
            r = self.seg._fetch(self.c, k, gen, outs, 0, True)
            if type(r) is int and r < 0:  # the slot was reclaimed: not ours any more
                return (r, k, gen, outs)
            self.give_back(k)
            if type(r) is str:
                return r
        if not reuse:
            result = {}
            for j in range(self.seg.n_out):
                result[self.seg.out_names[j]] = outs[j]
        if self.last is not None:  # not reused: it becomes the older one
            self.prev, self.prev_outs = self.last, self.last_outs
        self.last = result
        self.last_outs = outs
        if versioned:
            return (result, r)
        return result

    cdef object _evaluate_many(self, object states, bint versioned, object keys):
        """The common case of ``Client.evaluate_many``: a C-contiguous batch
        of the declared dtype and shape with as many rows as this process has
        free slots.  Rows the evaluation cache holds are answered here (by
        keys[i], the caller's keys, or by the hashes of their bytes), the
        others sent in one round.  Returns the result dict (with
        ``versioned``, the pair (dict, versions)); the error text (str) when
        a row's batch failed; a tuple (status, rows, slots, outs, versions,
        exception, error) when a wait timed out, the evaluator closed, a
        slot was reclaimed or something raised after the rows were posted
        (``rows`` and ``slots``, its (slot, generation) pairs, are the
        requests still in flight; ``error`` the text of an earlier row's
        failed batch, or None); or None before anything was posted when the
        fast path does not apply.  One call instead of the Python of
        ``Client._roundtrip`` around a post and a wait per row: that Python
        was about 20 us of CPU per call with 8 workers on 2 cores
        (docs/performance.md)."""
        cdef cnp.ndarray a
        cdef Py_ssize_t n, m, i, j, d
        cdef uint32_t ks[SHM_MAX_SLOTS_PER_CLIENT]
        cdef uint32_t gens[SHM_MAX_SLOTS_PER_CLIENT]
        cdef Py_ssize_t rows[SHM_MAX_SLOTS_PER_CLIENT]  # the rows sent
        cdef uint64_t k1s[SHM_MAX_SLOTS_PER_CLIENT]
        cdef uint64_t k2s[SHM_MAX_SLOTS_PER_CLIENT]
        cdef uint32_t k
        cdef int rc
        cdef cnp.npy_intp dims[1]
        cdef list outs
        cdef object versions = None
        cdef object r
        cdef object error = None
        cdef dict result
        n = self._batch_rows(states, keys)
        if n < 1:
            return None
        a = <cnp.ndarray>states
        outs = self._new_outs(n)
        if versioned:
            dims[0] = n
            versions = cnp.PyArray_ZEROS(1, dims, cnp.NPY_INT64, 0)
        m = self._lookup(a, n, keys, outs, versions, rows, k1s, k2s)
        if m < 0 or (m and not self._post(a, m, rows, k1s, k2s, keys is None, ks, gens)):
            return None
        i = 0
        try:
            while i < m:
                k = ks[i]
                rc = self._wait_one(k, gens[i], self.timeout_ns)
                if rc < 0:
                    return (rc, [rows[d] for d in range(i, m)],
                            [(ks[d], gens[d]) for d in range(i, m)], outs, versions, None,
                            error)
                r = self.seg._fetch(self.c, k, gens[i], outs, rows[i], True)
                if type(r) is int and <int>r < 0:  # reclaimed: not ours any more
                    return (r, [rows[d] for d in range(i, m)],
                            [(ks[d], gens[d]) for d in range(i, m)], outs, versions, None,
                            error)
                self.give_back(k)
                if type(r) is str:
                    error = r  # the last failed row's, as in Client._answer_posted
                elif versioned:
                    (<int64_t *>cnp.PyArray_DATA(versions))[rows[i]] = <int64_t>r
                i += 1
        except BaseException as e:
            return (SHM_E_STATE, [rows[d] for d in range(i, m)],
                    [(ks[d], gens[d]) for d in range(i, m)], outs, versions, e, error)
        if error is not None:
            return error
        result = {}
        for j in range(self.seg.n_out):
            result[self.seg.out_names[j]] = outs[j]
        if versioned:
            return (result, versions)
        return result

    cdef Py_ssize_t _batch_rows(self, object states, object keys):
        """The rows of states when the batch fast paths apply: a C-contiguous
        array of the declared dtype and input shape with 1 to len(free)
        rows, keys None or one per row, this process's open entry; else 0."""
        cdef cnp.ndarray a
        cdef Py_ssize_t n, i
        if type(states) is not cnp.ndarray or not self.fast or self.pid != _current_pid:
            return 0
        a = <cnp.ndarray>states
        if not cnp.PyArray_IS_C_CONTIGUOUS(a) or cnp.PyArray_NDIM(a) != self.in_nd + 1:
            return 0
        n = cnp.PyArray_DIM(a, 0)
        if n < 1 or n > len(self.free):
            return 0
        for i in range(self.in_nd):
            if cnp.PyArray_DIM(a, i + 1) != self.in_dims[i]:
                return 0
        if <PyObject *>cnp.PyArray_DESCR(a) != <PyObject *>self.in_dtype and \
                a.dtype != self.in_dtype:
            return 0
        if keys is not None and len(keys) != n:
            return 0  # the general path says what is wrong
        if shm_ev_state(&self.seg.seg) >= EV_CLOSING or self.retired:
            return 0
        return n

    cdef list _spare_outs(self, Py_ssize_t n):
        """Output arrays of n rows that a freed Pending left (spares) and
        nothing references any more, unchanged; else new ones.  Allocating
        them is a good part of what a submit costs the worker."""
        cdef Py_ssize_t i, j
        cdef list outs
        cdef PyObject *x
        for i in range(len(self.spares) - 1, -1, -1):
            outs = <list>PyList_GET_ITEM(self.spares, i)
            # References: the spares list, and `outs` here.
            if Py_REFCNT(<PyObject *>outs) != 2 or len(outs) != self.seg.n_out:
                continue
            for j in range(self.seg.n_out):
                x = PyList_GET_ITEM(outs, j)
                # One reference from the list: nobody else.
                if Py_REFCNT(x) != 1 or not self._is_output(<cnp.ndarray>x, j, n):
                    break
            else:
                del self.spares[i]
                return outs
        return self._new_outs(n)

    cdef bint _is_output(self, cnp.ndarray arr, Py_ssize_t j, Py_ssize_t rows):
        """arr is still what output j was made as: C-contiguous, writeable,
        of its type and shape, with a first axis of rows (rows < 0: none)."""
        cdef Py_ssize_t d, lead = 0 if rows < 0 else 1
        cdef cnp.npy_intp *dims = cnp.PyArray_DIMS(arr)
        cdef cnp.npy_intp *want = self.seg._out_dims(j)
        if not cnp.PyArray_IS_C_CONTIGUOUS(arr) or not cnp.PyArray_ISWRITEABLE(arr) or \
                cnp.PyArray_TYPE(arr) != self.seg.out_type[j] or \
                cnp.PyArray_NDIM(arr) != self.seg.out_nd[j] + lead or \
                (lead and dims[0] != rows):
            return False
        for d in range(self.seg.out_nd[j]):
            if dims[d + lead] != want[d]:
                return False
        return True

    cdef void _keep_spare(self, list outs) noexcept:
        """A freed Pending's output arrays, for a later submit: the newest
        few are kept (the caller may still hold the last results)."""
        try:
            if len(self.spares) >= 4:
                del self.spares[0]
            self.spares.append(outs)
        except BaseException:  # pragma: no cover - out of memory
            pass

    cdef list _new_outs(self, Py_ssize_t n):
        """Empty output arrays of n rows (self.fast: native dtypes)."""
        cdef cnp.npy_intp dims[33]  # rows, then up to 32
        cdef cnp.npy_intp *od
        cdef Py_ssize_t j, d
        cdef list outs = []
        dims[0] = n
        for j in range(self.seg.n_out):
            od = self.seg._out_dims(j)
            for d in range(self.seg.out_nd[j]):
                dims[d + 1] = od[d]
            outs.append(cnp.PyArray_EMPTY(self.seg.out_nd[j] + 1, dims,
                                          self.seg.out_type[j], 0))
        return outs

    cdef Py_ssize_t _lookup(self, cnp.ndarray a, Py_ssize_t n, object keys, list outs,
                            object versions, Py_ssize_t *rows, uint64_t *k1s,
                            uint64_t *k2s) except -2:
        """Answers the rows of a that the evaluation cache holds (by keys[i],
        or by the hashes of their bytes) into outs (and versions); the others
        go to rows, their cache keys to k1s, k2s.  Returns how many are left
        to send, or -1 when a key is not an int (the general path says so)."""
        cdef Py_ssize_t i, m = 0
        cdef uint64_t v = 0
        cdef uint64_t inb = self.seg.seg.p.in_bytes
        cdef const char *src = <const char *>cnp.PyArray_DATA(a)
        if not self.seg.seg.p.cache_log2:
            for i in range(n):
                rows[i] = i
            return n
        try:
            for i in range(n):
                if self.seg._cache_get(self.c, src + i * inb, None if keys is None else keys[i],
                                       outs, i, &k1s[m], &k2s[m], &v):
                    if versions is not None:
                        (<int64_t *>cnp.PyArray_DATA(versions))[i] = <int64_t>v
                else:
                    rows[m] = i
                    m += 1
        except TypeError:
            return -1
        return m

    cdef bint _post(self, cnp.ndarray a, Py_ssize_t m, Py_ssize_t *rows, uint64_t *k1s,
                    uint64_t *k2s, bint hashed, uint32_t *ks, uint32_t *gens) except -1:
        """Sends rows[0:m] of a: takes m free slots (ks), begins them (gens),
        copies the states in, publishes them and rings the evaluator once.
        False, with nothing taken, when the free slots are too few now or the
        entry was closed meanwhile."""
        cdef Py_ssize_t i
        cdef bint cache = self.seg.seg.p.cache_log2 != 0
        cdef uint64_t inb = self.seg.seg.p.in_bytes
        cdef const char *src = <const char *>cnp.PyArray_DATA(a)
        if m > len(self.free):  # another thread took slots meanwhile
            return False
        for i in range(m):
            ks[i] = self.free.pop()
        if self.retired:  # closed meanwhile (Client.close waits for popped slots)
            for i in range(m):
                self.free.append(ks[i])
            return False
        try:
            self.seg._begin_all(self.c, ks, m, gens)
        except BaseException:
            for i in range(m):
                self.free.append(ks[i])
            raise
        for i in range(m):
            shm_copy(shm_slot_in(&self.seg.seg, self.c, ks[i]), src + rows[i] * inb, inb)
            if cache:
                self.seg._cache_as(self.c, ks[i], k1s[i], k2s[i], hashed)
        # Publish in a tight loop after all the copies, then one doorbell.
        # (A slot reclaimed meanwhile is not published; its wait says so.)
        for i in range(m):
            shm_slot_publish(&self.seg.seg, self.c, ks[i], gens[i])
        shm_notify_evaluator(&self.seg.seg, <uint32_t>m)
        return True

    cdef int _wait_one(self, uint32_t k, uint32_t gen, uint64_t timeout_ns):
        """Segment._wait for slot k of this entry with the spin budget of
        the arms (SpinArms), which get the wait's ns when it ends answered
        and spinning was allowed."""
        cdef uint64_t budget = self.arms.pick()
        cdef uint64_t t0 = (shm_now_ns() if self.arms.long_ns and self.seg._spin(budget, self.ncpu)
                            else 0)
        cdef int rc = self.seg._wait(self.c, k, gen, budget, timeout_ns, self.ncpu)
        if t0 and rc >= 0:
            self.arms.saw(shm_now_ns() - t0)
        return rc

    @property
    def spin(self):
        """The spin arms' report (SpinArms.report)."""
        return self.arms.report()

    cdef object _submit(self, object states, bint versioned, object keys):
        """The common case of ``Client.submit`` (the batch as for
        ``_evaluate_many``, and this entry's pipeline lane made): posts the
        rows the cache does not answer and returns their Pending; None,
        with nothing posted, when the fast path does not apply."""
        cdef Py_ssize_t n, m, i
        cdef Pending p
        cdef Py_ssize_t rows[SHM_MAX_SLOTS_PER_CLIENT]
        cdef uint64_t k1s[SHM_MAX_SLOTS_PER_CLIENT]
        cdef uint64_t k2s[SHM_MAX_SLOTS_PER_CLIENT]
        if self.lane is None:
            return None
        n = self._batch_rows(states, keys)
        if n < 1:
            return None
        p = Pending.__new__(Pending)
        p._setup(self.lane, self, n, versioned)
        m = self._lookup(<cnp.ndarray>states, n, keys, p._outs, p._versions, rows, k1s, k2s)
        if m < 0 or (m and not self._post(<cnp.ndarray>states, m, rows, k1s, k2s, keys is None,
                                          p.ks, p.gens)):
            return None
        for i in range(m):
            p.rows[i] = <int32_t>rows[i]
        p._armed(m)
        return p

    cdef bint _unreferenced(self, int older):
        """True when a cached result (the last, or with older the one before;
        its dict and arrays) is referenced by
        nothing but this port, unchanged: then it can hold the next result.
        Allocating the arrays and the dict was a third of a round trip's
        cost with 16 workers on 2 cores (docs/performance.md).  Any reference
        the caller keeps -- to the dict, an array, a view or a buffer of it --
        shows in the reference counts and makes this allocate afresh.  Two
        results are cached, the last and the one before, because a loop
        `out = ev.evaluate(s)` still holds the last one during the call."""
        cdef Py_ssize_t j
        cdef PyObject *x
        # Borrowed pointers: a Python-level reference here would itself
        # show in the counts.
        cdef PyObject *cached = <PyObject *>(self.prev if older else self.last)
        cdef PyObject *cached_outs = <PyObject *>(self.prev_outs if older else self.last_outs)
        if cached == <PyObject *>None or Py_REFCNT(cached) != 1 or \
                PyDict_Size(<object>cached) != self.seg.n_out:
            return False
        for j in range(self.seg.n_out):
            x = PyList_GET_ITEM(<object>cached_outs, j)
            # One reference from the cached list, one from the dict: nobody else.
            if Py_REFCNT(x) != 2 or PyDict_GetItem(<object>cached, self.seg.out_names[j]) != x:
                return False
            # Unchanged in place too (a caller may set .shape or resize).
            if not self._is_output(<cnp.ndarray>x, j, -1):
                return False
        return True


@cython.binding(True)
def client_submit(self, object states, *, bint block=True, bint return_version=False,
                  object keys=None):
    """``Client.submit``: the common case in ClientPort._submit (no Python
    frame); anything else goes to ``Client._submit_slow``."""
    port = (<ClientBase?>self)._port
    cdef object p
    if port is not None:
        p = (<ClientPort?>port)._submit(states, return_version, keys)
        if p is not None:
            return p
    return self._submit_slow(states, block, return_version, keys)


cdef inline bint _answered(object r, bint versioned):
    """r, from a ClientPort fast path, is the caller's result: the dict, or
    with versioned the pair (dict, version(s)); not None, an error text or a
    hand-over tuple for the Python path."""
    if versioned:
        return type(r) is tuple and len(<tuple>r) == 2
    return type(r) is dict


cdef class ClientBase:
    """The base of ``shmeval.Client``: its process's port in a C field, which
    ``client_evaluate`` reads without an attribute lookup.  As an attribute
    of a Python instance it was a dict lookup on every call, about 2% of the
    machine's CPU with 16 workers on 2 cores (docs/performance.md)."""


@cython.binding(True)
def client_evaluate(self, object state, bint return_version=False, object key=None):
    """Evaluates one state; returns ``{name: array of the output's shape}``,
    or ``(outputs, model_version)`` with ``return_version=True``: the
    version of the weights that computed it (0 for the model the
    evaluator started with, then as set by ``Evaluator.set_weights``).
    With an evaluation cache (``cache_entries``), ``key`` is the state's
    cache key (any int, e.g. a Zobrist hash; taken modulo 2**64) instead of
    a hash of its bytes; without one it is ignored.

    (``Client.evaluate``: written here so that the common case -- the
    process's port exists and ``ClientPort`` answers -- runs no Python
    frame; anything else goes to ``Client._evaluate_slow``.)"""
    port = (<ClientBase?>self)._port
    cdef object r = None
    if port is not None:
        r = (<ClientPort?>port)._evaluate(state, return_version, key)
        if _answered(r, return_version):
            return r
    return self._evaluate_slow(state, r, port, return_version, key)


@cython.binding(True)
def client_evaluate_many(self, object states, bint return_version=False, object keys=None):
    """``Client.evaluate_many``: the common case in ClientPort (no Python
    frame); anything else goes to ``Client._evaluate_many_slow``."""
    port = (<ClientBase?>self)._port
    cdef object r = None
    if port is not None:
        r = (<ClientPort?>port)._evaluate_many(states, return_version, keys)
        if _answered(r, return_version):
            return r
    return self._evaluate_many_slow(states, r, port, return_version, keys)
