# Included by shmeval/_ring.pyx: ClientPort, the request path of one process.


cdef class ClientPort:
    """One process's client entry, as the request path uses it: the one
    place where states are posted into slots and their answers collected.

    ``evaluate``, ``evaluate_many`` and ``submit`` each check their input
    (``_input``), then post through ``_post`` (cache lookup, slots taken,
    begin, copy, publish, one doorbell), which returns a ``Pending``, the
    typed record of what is in flight; ``Pending._collect`` waits for and
    copies out every answer (wait, fetch, release).  The failure handling
    of each step is written once: slots not begun go back to the free list
    (``_post``), requests in flight that nobody will collect to the
    abandoned list (``_release``, for the blocking calls).  What only
    Python can judge -- a wait that ended without an answer (timed out,
    closed, reclaimed), or too few free slots -- goes to the process's
    ``shmeval.entry.ProcessEntry`` (``entry``).

    ``free`` is the entry's list of free slot indices (single list
    operations are atomic under the GIL); ``waiters`` counts threads waiting
    for a free slot, which ``give_back`` wakes.
    """

    def __cinit__(self, Segment seg, uint32_t c, object entry):
        cdef int i
        spec = entry.spec
        self.seg = seg
        self.spec = spec
        self.c = c
        self.entry = entry
        self.pid = _current_pid
        self.slots = spec.slots_per_client
        self.free = list(range(self.slots))
        self.abandoned = []
        self.spares = []
        # The only method's Layout, when there is one; its one unnamed
        # input is taken as the caller's array (plain), named inputs are
        # packed into request rows (_pack).
        self.lay0 = seg.layouts[0] if len(seg.layouts) == 1 else None
        self.plain = self.lay0 is not None and not self.lay0.method.named
        if self.plain:
            self.in_dtype = spec.input_dtype
            self.in_shape = tuple(spec.input_shape)
            self.in_nd = len(self.in_shape)
            for i in range(min(self.in_nd, 32)):
                self.in_dims[i] = self.in_shape[i]
        # Outputs of native built-in dtypes are made in C (PyArray_EMPTY),
        # and a result nobody holds any more is reused (one method only);
        # any other declared output is made by NumPy.
        self.fast = self.lay0 is not None and self.lay0.out_native and self.lay0.n_out > 0
        self.arms = SpinArms(entry.spin_ns, entry.spin_long_ns)
        self.timeout_ns = entry.timeout_ns
        self.ncpu = entry.ncpu

    # ------------------------------------------------------------ public
    cpdef object evaluate(self, object state, bint versioned=False, object key=None,
                          object method=None):
        """One state (a dict of named inputs where they are named):
        ``{name: array of the output's shape}``; with versioned the pair
        (outputs, model version).  key: the state's evaluation-cache key,
        or None to hash its bytes; method: the method's name (None: the
        only one)."""
        cdef Layout lay = self._layout(method)
        cdef cnp.ndarray a = self._rows(state, lay, True)
        cdef dict result = None
        cdef list outs
        cdef Pending p
        cdef Py_ssize_t j
        cdef object error
        cdef int64_t version
        # A result nobody references is reused; it is taken out of the
        # port while in use, so that another thread cannot take it too.
        if self.fast and self._unreferenced(0):
            result, outs = self.last, self.last_outs
            self.last = self.last_outs = None
        elif self.fast and self._unreferenced(1):
            result, outs = self.prev, self.prev_outs
            self.prev = self.prev_outs = None
        else:
            outs = self._new_outs(-1, lay)
        p = self._sync_pending()
        try:
            self._post(p, lay, a, 0, 1, None if key is None else (key,), outs, None, True, False)
            p._collect(0.0, None)
            error = p.error
            version = p.version
        finally:
            self._release(p)
        if error is not None:
            raise ModelError(error)
        if result is None:
            result = {}
            for j in range(len(outs)):
                result[lay.out_names[j]] = outs[j]
        if self.fast:
            if self.last is not None:  # not reused: it becomes the older one
                self.prev, self.prev_outs = self.last, self.last_outs
            self.last, self.last_outs = result, outs
        if versioned:
            return (result, version)
        return result

    cpdef object evaluate_many(self, object states, bint versioned=False, object keys=None,
                               object method=None):
        """A batch ``[n, *input_shape]`` (a dict of such arrays where the
        inputs are named): arrays with a leading dimension n (with
        versioned, also an int64 array of n model versions).  More rows
        than the entry's slots are sent in rounds of a slot each.  Raises
        ModelError (the last failed row's) once every row is in."""
        cdef Layout lay = self._layout(method)
        cdef cnp.ndarray a = self._rows(states, lay, False)
        cdef Py_ssize_t n = cnp.PyArray_DIM(a, 0), start = 0, m, j
        cdef cnp.npy_intp dims[1]
        cdef list outs = self._new_outs(n, lay)
        cdef object versions = None
        cdef object error = None
        cdef dict result = {}
        cdef Pending p
        keys = self._keys(keys, n)
        if versioned:
            dims[0] = n
            versions = cnp.PyArray_ZEROS(1, dims, cnp.NPY_INT64, 0)
        p = self._sync_pending()
        try:
            while start < n:
                m = min(n - start, <Py_ssize_t>self.slots)
                self._post(p, lay, a, start, m, keys, outs, versions, True, False)
                p._collect(0.0, None)
                if p.error is not None:
                    error = p.error
                start += m
        finally:
            self._release(p)
        if error is not None:
            raise ModelError(error)
        for j in range(len(outs)):
            result[lay.out_names[j]] = outs[j]
        if versioned:
            return (result, versions)
        return result

    cpdef Pending submit(self, object states, bint block=True, bint versioned=False,
                         object keys=None, object method=None):
        """Posts a batch of at most ``slots`` states and returns its
        Pending at once.  With too few free slots: waits for this process's
        other requests to be answered, or with block False raises
        NoFreeSlots."""
        cdef Layout lay = self._layout(method)
        cdef cnp.ndarray a = self._rows(states, lay, False)
        cdef Py_ssize_t n = cnp.PyArray_DIM(a, 0)
        cdef cnp.npy_intp dims[1]
        cdef object versions = None
        if n > self.slots:
            raise ValueError(f"submit takes at most slots_per_client ({self.slots}) states at "
                             f"once, got {n} (evaluate_many sends more in rounds)")
        keys = self._keys(keys, n)
        if versioned:
            dims[0] = n
            versions = cnp.PyArray_ZEROS(1, dims, cnp.NPY_INT64, 0)
        return self._post(Pending.__new__(Pending), lay, a, 0, n, keys, self._spare_outs(n, lay),
                          versions, block, True)

    def give_back(self, uint32_t k):
        """Slot k is free again (its answer was copied out)."""
        self._give_back(k)

    cdef inline int _give_back(self, uint32_t k) except -1:
        self.free.append(k)
        if self.waiters:
            self.entry.notify_waiters()
        return 0

    def owners(self):
        """The Pendings of submit with requests in flight on this entry
        (each once)."""
        cdef uint32_t k
        cdef list out = []
        cdef set seen = set()
        for k in range(SHM_MAX_SLOTS_PER_CLIENT):
            if self.owner[k] != NULL and <object>self.owner[k] not in seen:
                seen.add(<object>self.owner[k])
                out.append(<object>self.owner[k])
        return out

    @property
    def spin(self):
        """The spin arms' report (SpinArms.report)."""
        return self.arms.report()

    # ------------------------------------------------------------ post
    cdef Pending _post(self, Pending p, Layout lay, cnp.ndarray a, Py_ssize_t start,
                       Py_ssize_t n, object keys, list outs, object versions, bint block,
                       bint own):
        """The post, for every caller: rows start..start+n of a (request
        rows of lay's method, in_bytes each) are answered into the same
        rows of outs (and versions) -- from the evaluation cache where it
        holds them, the others through the evaluator -- and their Pending
        returned with those in flight.  own: a submit's Pending, which the
        entry's harvests may collect (port.owner).  p: a new Pending, or the
        blocking calls' (_sync_pending): with nothing in flight and no
        exception recorded (_release), set up afresh here."""
        cdef Py_ssize_t m, i
        cdef int rc
        cdef Py_ssize_t rows[SHM_MAX_SLOTS_PER_CLIENT]
        cdef uint64_t k1s[SHM_MAX_SLOTS_PER_CLIENT]
        cdef uint64_t k2s[SHM_MAX_SLOTS_PER_CLIENT]
        cdef Segment seg = self.seg
        cdef uint64_t inb = seg.seg.p.in_bytes
        cdef bint cache = seg.seg.p.cache_log2 != 0
        cdef const char *src = <const char *>cnp.PyArray_DATA(a)
        if p.port is None:  # a new one
            p.port = self
            p.seg = seg
        if p.lay is not lay:
            p.lay = lay
        p._n = n
        p._m = p.fetched = p.unclaimed = 0
        p._outs = outs
        p._versions = versions
        if p.error is not None:  # a round of evaluate_many before this one
            p.error = None
        p.version = 0
        if shm_ev_state(&seg.seg) >= EV_CLOSING:
            self.entry.check_state()  # raises: closed, or died
        if cache:
            m = self._lookup(a, start, n, keys, p, rows, k1s, k2s)
        else:
            m = n
            for i in range(n):
                rows[i] = start + i
        if m:
            self._take(m, block, p.ks)
            rc = seg._begin_all(self.c, p.ks, m, p.gens)
            if rc < 0:
                self._put_back(p.ks, m)
                _begin_failed(rc)
            for i in range(m):
                shm_copy(shm_slot_in(&seg.seg, self.c, p.ks[i]), src + rows[i] * inb, inb)
                if cache:
                    seg._cache_as(self.c, p.ks[i], k1s[i], k2s[i], keys is None)
                p.rows[i] = <int32_t>rows[i]
            # Publish in a tight loop after all the copies, so that an
            # evaluator scanning meanwhile rarely splits the rows over two
            # batches; then one doorbell.  (A slot reclaimed meanwhile is
            # not published; its wait says so.)
            for i in range(m):
                shm_slot_publish(&seg.seg, self.c, p.ks[i], p.gens[i])
            shm_notify_evaluator(&seg.seg, <uint32_t>m)
        p._armed(m, own)
        return p

    cdef inline Py_ssize_t _lookup(self, cnp.ndarray a, Py_ssize_t start, Py_ssize_t n, object keys,
                            Pending p, Py_ssize_t *rows, uint64_t *k1s,
                            uint64_t *k2s) except -1:
        """Answers the rows start..start+n of a that the evaluation cache (a
        segment with one) holds (by keys[i], or by the hashes of their
        bytes) into p; the others go to rows, their cache keys to k1s, k2s.
        Returns how many are left to send."""
        cdef Py_ssize_t i, m = 0
        cdef uint64_t v = 0
        cdef uint64_t inb = self.seg.seg.p.in_bytes
        cdef const char *src = <const char *>cnp.PyArray_DATA(a)
        try:
            for i in range(start, start + n):
                if self.seg._cache_get(p.lay, self.c, src + i * inb,
                                       None if keys is None else keys[i], p._outs, i, &k1s[m],
                                       &k2s[m], &v):
                    p.version = <int64_t>v
                    if p._versions is not None:
                        (<int64_t *>cnp.PyArray_DATA(p._versions))[i] = <int64_t>v
                else:
                    rows[m] = i
                    m += 1
        except TypeError:
            _check_keys(keys, len(keys))  # says which key is wrong
            raise
        return m

    cdef inline int _take(self, Py_ssize_t m, bint block, uint32_t *ks) except -1:
        """m free slots into ks: from the free list when it holds them (no
        Python frame), else from the entry, which waits for them (block) or
        raises NoFreeSlots.  A port closed meanwhile raises EvaluatorClosed
        with nothing taken."""
        cdef Py_ssize_t i
        cdef list slots
        if not self.retired and len(self.free) >= m:
            for i in range(m):
                ks[i] = self.free.pop()
        else:
            slots = self.entry.take(m, block)
            for i in range(m):
                ks[i] = slots[i]
        if self.retired:  # closed meanwhile (Client.close waits for taken slots)
            self._put_back(ks, m)
            self.entry.check_port()  # raises
        return 0

    cdef int _put_back(self, const uint32_t *ks, Py_ssize_t m) except -1:
        """Slots ks[0:m], taken and not begun (or aborted), are free again."""
        cdef Py_ssize_t i
        for i in range(m):
            self.free.append(ks[i])
        if self.waiters:
            self.entry.notify_waiters()
        return 0

    # ------------------------------------------------------------ collect
    cdef inline Pending _sync_pending(self):
        """The Pending of a blocking call: the port's own when no other
        thread is using it (a blocking call's Pending never outlives the
        call, so one per port serves, instead of one allocated and zeroed
        per request), else a new one.  _release gives it back."""
        if self.sync is not None and not self.sync_busy:
            self.sync_busy = True
            return self.sync
        p = Pending.__new__(Pending)
        if self.sync is None:
            self.sync, self.sync_busy = p, True
        return p

    cdef inline void _release(self, Pending p) noexcept:
        """A blocking call is over with p, answered or not.  Requests it
        left in flight (an exception, an evaluator that closed or died) go
        to the abandoned list, whose slots come back once answered.  The
        port's own Pending lets go of the caller's arrays (a result the port
        keeps must be referenced only by the caller and the port), forgets
        the call's outcome and is free again."""
        if p.unclaimed:
            p._abandon()
        if p is self.sync:
            p._outs = p._versions = None
            if p.exc is not None:
                p.exc = None
            p._m = p.fetched = 0
            self.sync_busy = False

    cdef inline int _wait_one(self, uint32_t k, uint32_t gen, uint64_t timeout_ns) noexcept:
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

    # ------------------------------------------------------------ inputs
    cdef inline Layout _layout(self, object method):
        """The Layout of the method called `method` (None: the only one)."""
        cdef Layout lay
        if method is None and self.lay0 is not None:
            return self.lay0
        if method is not None:
            for lay in self.seg.layouts:
                if lay.method.name == method:
                    return lay
        return self.seg.layouts[self.spec.method(method).index]  # raises, naming them

    cdef inline cnp.ndarray _rows(self, object x, Layout lay, bint single):
        """The request rows of x for lay's method: the caller's array itself
        where it is one unnamed input of the right dtype and shape (_input),
        else packed (_pack)."""
        if self.pid != _current_pid:
            raise ShmevalError("this port belongs to another process (a fork's parent); "
                               "call through the Client")
        if self.plain:
            return self._input(x, single)
        rows = self._pack_fast(x, lay, single)
        if rows is not None:
            return <cnp.ndarray>rows
        return _pack(x, lay.method, self.seg.seg.p.in_bytes, self.spec.header_bytes, single)

    cdef object _pack_fast(self, object x, Layout lay, bint single):
        """The request rows of named inputs x in the common case (_named)
        packed in C: a zeroed row per state, the method's index first
        where there are several, each input's bytes at its offset.  One
        state's row is the layout's own (pack_one), reused while nothing
        else holds it: its gaps and header are written once.  None
        otherwise (_pack converts, or says what is wrong)."""
        cdef Py_ssize_t i, j
        cdef uint64_t inb = self.seg.seg.p.in_bytes
        cdef uint32_t header = len(self.seg.layouts) > 1
        cdef cnp.ndarray rows
        cdef cnp.npy_intp dims[2]
        cdef char *dst
        cdef PyObject *src[32]         # the inputs, held by x while packing
        cdef char scalar[32]           # input j is a NumPy scalar (one state)
        cdef Py_ssize_t n = self._named(x, lay, single, src, scalar)
        if n < 0:
            return None
        # The layout's row is free when it alone references it (a caller
        # that packed it holds it until its copy into the slots is done).
        cdef bint fresh = not single or lay.pack_one is None or \
            Py_REFCNT(<PyObject *>lay.pack_one) != 1
        if fresh:
            dims[0] = n
            dims[1] = <cnp.npy_intp>inb
            rows = cnp.PyArray_EMPTY(2, dims, cnp.NPY_UINT8, 0)
            if single and lay.pack_one is None:
                lay.pack_one = rows
        else:
            rows = <cnp.ndarray>lay.pack_one
        dst = <char *>cnp.PyArray_DATA(rows)
        for i in range(n):
            if fresh:
                # Zeros where no input lies (the header's padding, the gaps
                # before aligned inputs, the tail up to the largest method's
                # row): a row's bytes, hashed by the cache, are its
                # request's.  Only the inputs write a reused row.
                lay._zero_gaps(dst + i * inb, inb)
                if header:
                    (<uint32_t *>(dst + i * inb))[0] = lay.index
            for j in range(lay.n_in):
                if scalar[j]:
                    cnp.PyArray_ScalarAsCtype(<object>src[j], dst + lay.in_off[j])
                else:
                    memcpy(dst + i * inb + lay.in_off[j],
                           <char *>cnp.PyArray_DATA(<cnp.ndarray>src[j])
                           + i * lay.in_nbytes[j], lay.in_nbytes[j])
        return rows

    cdef Py_ssize_t _named(self, object x, Layout lay, bint single, PyObject **src,
                           char *scalar) except -2:
        """The states in named inputs x in the common case -- a dict holding
        exactly the method's inputs, each a C-contiguous array of its dtype
        and shape (with one leading axis of the same length unless single;
        a NumPy scalar of exactly its type for a 0-d input of one state) --
        with each input in src (borrowed: x holds them) and whether it is
        a scalar in scalar; -1 otherwise."""
        cdef Py_ssize_t j, d, n = 1, lead = 0 if single else 1
        cdef cnp.ndarray a
        cdef PyObject *item
        if type(x) is not dict or PyDict_Size(x) != lay.n_in or lay.n_in > 32 or \
                not lay.in_native:
            return -1
        for j in range(lay.n_in):
            item = PyDict_GetItem(x, lay.in_names[j])
            if item == NULL:
                return -1
            src[j] = item
            scalar[j] = False
            if type(<object>item) is not cnp.ndarray:
                # Anything else (a subclass, a Python number) goes to _pack.
                scalar[j] = single and lay.in_nd[j] == 0 and \
                    type(<object>item) is lay.in_scalars[j]
                if not scalar[j]:
                    return -1
                continue
            a = <cnp.ndarray>item
            # The type number, not the dtype object: an array that came
            # through pickle has a dtype equal to the declared one but not
            # the same object.
            if not cnp.PyArray_IS_C_CONTIGUOUS(a) or \
                    cnp.PyArray_NDIM(a) != lay.in_nd[j] + lead or \
                    cnp.PyArray_TYPE(a) != lay.in_type[j] or not cnp.PyArray_ISNOTSWAPPED(a):
                return -1
            for d in range(lay.in_nd[j]):
                if cnp.PyArray_DIM(a, d + lead) != lay.in_shape[lay.in_at[j] + d]:
                    return -1
            if lead:
                if j == 0:
                    n = cnp.PyArray_DIM(a, 0)
                elif cnp.PyArray_DIM(a, 0) != n:
                    return -1
        return n

    cdef inline cnp.ndarray _input(self, object x, bint single):
        """x as a C-contiguous array of the declared dtype: one state
        (single) or a batch with a leading axis.  The common case, an array
        that is that already, is taken as it is; anything else is converted
        or refused with a message naming what is wrong (_as_input)."""
        cdef cnp.ndarray a
        cdef int i, lead = 0 if single else 1
        if type(x) is cnp.ndarray and self.in_nd <= 32:
            a = <cnp.ndarray>x
            if cnp.PyArray_IS_C_CONTIGUOUS(a) and cnp.PyArray_NDIM(a) == self.in_nd + lead and (
                    <PyObject *>cnp.PyArray_DESCR(a) == <PyObject *>self.in_dtype or
                    a.dtype == self.in_dtype):
                for i in range(self.in_nd):
                    if cnp.PyArray_DIM(a, i + lead) != self.in_dims[i]:
                        break
                else:
                    return a
        return _as_input(x, self.in_dtype, self.in_shape, single)

    cdef inline object _keys(self, object keys, Py_ssize_t n):
        """The caller's cache keys for n states: None, or as many as states
        (their type is checked by the lookup that reads them)."""
        if keys is not None and len(keys) != n:
            _check_keys(keys, n)  # raises
        return keys

    # ------------------------------------------------------------ outputs
    cdef list _new_outs(self, Py_ssize_t n, Layout lay):
        """Empty output arrays of lay's method, of n rows (n < 0: of one
        state, no leading axis)."""
        cdef cnp.npy_intp dims[33]  # rows, then up to 32
        cdef cnp.npy_intp *od
        cdef Py_ssize_t j, d, lead = 0 if n < 0 else 1
        cdef list outs = []
        if not lay.out_native:
            return [np.empty(((n,) if lead else ()) + o.shape, o.dtype)
                    for o in lay.method.outputs]
        dims[0] = n
        for j in range(lay.n_out):
            od = lay._out_dims(j)
            for d in range(lay.out_nd[j]):
                dims[d + lead] = od[d]
            outs.append(cnp.PyArray_EMPTY(lay.out_nd[j] + lead, dims, lay.out_type[j], 0))
        return outs

    cdef list _spare_outs(self, Py_ssize_t n, Layout lay):
        """Output arrays of n rows that a freed Pending left (spares) and
        nothing references any more, unchanged; else new ones.  Allocating
        them is a good part of what a submit costs the worker."""
        cdef Py_ssize_t i, j
        cdef list outs
        cdef PyObject *x
        if not self.fast:
            return self._new_outs(n, lay)
        for i in range(len(self.spares) - 1, -1, -1):
            outs = <list>PyList_GET_ITEM(self.spares, i)
            # References: the spares list, and `outs` here.
            if Py_REFCNT(<PyObject *>outs) != 2 or len(outs) != lay.n_out:
                continue
            for j in range(lay.n_out):
                x = PyList_GET_ITEM(outs, j)
                # One reference from the list: nobody else.
                if Py_REFCNT(x) != 1 or not self._is_output(x, j, n):
                    break
            else:
                del self.spares[i]
                return outs
        return self._new_outs(n, lay)

    cdef inline bint _is_output(self, PyObject *arr, Py_ssize_t j, Py_ssize_t rows) noexcept:
        """arr (an ndarray, borrowed) is still what output j was made as:
        C-contiguous, writeable, of its type and shape, with a first axis of
        rows (rows < 0: none)."""
        cdef Layout lay = self.lay0  # (fast: the only method's)
        return _is_array_of(arr, lay.out_type[j], lay.out_nd[j], lay._out_dims(j), rows)

    cdef void _keep_spare(self, list outs) noexcept:
        """A freed Pending's output arrays, for a later submit: the newest
        few are kept (the caller may still hold the last results)."""
        try:
            if len(self.spares) >= 4:
                del self.spares[0]
            self.spares.append(outs)
        except BaseException:  # pragma: no cover - out of memory
            pass

    cdef bint _unreferenced(self, int older) noexcept:
        """True when a cached result (the last, or with older the one before;
        its dict and arrays) is referenced by nothing but this port,
        unchanged: then it can hold the next result.  Allocating the arrays
        and the dict was a third of a round trip's cost with 16 workers on
        2 cores (docs/performance.md).  Any reference the caller keeps -- to
        the dict, an array, a view or a buffer of it -- shows in the
        reference counts and makes this allocate afresh.  Two results are
        cached, the last and the one before, because a loop
        `out = ev.evaluate(s)` still holds the last one during the call."""
        cdef Py_ssize_t j, pos = 0
        cdef PyObject *x
        cdef PyObject *name
        cdef PyObject *value
        cdef Layout lay = self.lay0
        # Borrowed pointers: a Python-level reference here would itself
        # show in the counts.
        cdef PyObject *cached = <PyObject *>(self.prev if older else self.last)
        cdef PyObject *cached_outs = <PyObject *>(self.prev_outs if older else self.last_outs)
        if cached == <PyObject *>None or Py_REFCNT(cached) != 1 or \
                _dict_size(cached) != lay.n_out:
            return False
        for j in range(lay.n_out):
            x = _list_item(cached_outs, j)
            # The dict's entries in the order they were made (each output's
            # name, to its array; a caller's change to the dict shows here)
            # and referenced from the cached list and the dict: nobody else.
            if not _dict_next(cached, &pos, &name, &value) or value != x or \
                    name != _tuple_item(<PyObject *>lay.out_names, j) or Py_REFCNT(x) != 2:
                return False
            # Unchanged in place too (a caller may set .shape or resize).
            if not _is_array_of(x, lay.out_type[j], lay.out_nd[j], lay._out_dims(j), -1):
                return False
        return True


cdef object _as_input(object x, object dtype, tuple shape, bint single, str what=None):
    """x as a C-contiguous array of dtype: of shape `shape` (single), or
    (n, *shape); TypeError when its dtype cannot be cast under 'same_kind'
    casting, ValueError for a wrong shape (checked before any cast, so a
    wrong-shaped array is never copied).  what: how errors name x."""
    if what is None:
        what = "state" if single else "states"
    a = x if type(x) is np.ndarray else np.asarray(x)
    if a.dtype != dtype and (a.dtype.hasobject or not np.can_cast(a.dtype, dtype, "same_kind")):
        raise TypeError(f"{what} has dtype {a.dtype}, which cannot be cast to the expected "
                        f"{dtype} under 'same_kind' casting")
    if single:
        if a.shape != shape:
            raise ValueError(f"{what} has shape {a.shape}, expected {shape}")
    elif a.ndim != len(shape) + 1 or a.shape[1:] != shape:
        raise ValueError(f"{what} has shape {a.shape}, expected (n, {', '.join(map(str, shape))}"
                         f"{',' if len(shape) == 1 else ''})")
    if a.dtype != dtype:
        a = a.astype(dtype)
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    return a


cdef cnp.ndarray _pack(object x, object method, uint64_t in_bytes, uint64_t header,
                       bint single):
    """The request rows (uint8, n x in_bytes) of named inputs x, a dict
    {name: array} of one state (single) or of n each: the method's index
    first where there are several (header), then each input's bytes at its
    offset.  Every input is checked by name (the right names, each one's
    dtype and shape, the same number of states in each) and errors name the
    method and the input, before anything is sent."""
    where = f" of method {method.name!r}" if method.name else ""
    names = method.input_names
    if not isinstance(x, dict):
        raise TypeError(f"the inputs{where} are named {list(names)}: pass a dict "
                        f"{{name: array}}, not {type(x).__name__}")
    missing = [k for k in names if k not in x]
    extra = [k for k in x if k not in names]
    if missing or extra:
        raise ValueError(f"the inputs{where} are {list(names)}: "
                         + "; ".join(w for w in (f"missing {missing}" if missing else "",
                                                 f"not declared {extra}" if extra else "")
                                     if w))
    arrays = []
    n = 1
    for i, f in enumerate(method.inputs):
        a = _as_input(x[f.name], f.dtype, f.shape, single, f"input {f.name!r}{where}")
        if not single:
            if i and a.shape[0] != n:
                raise ValueError(f"the inputs{where} hold different numbers of states: "
                                 f"{names[0]!r} {n}, {f.name!r} {a.shape[0]}")
            n = a.shape[0]
        arrays.append(a)
    rows = np.zeros((n, in_bytes), np.uint8)
    if header:
        rows[:, :4].view(np.uint32)[:, 0] = method.index
    for f, a in zip(method.inputs, arrays):
        rows[:, f.offset:f.offset + f.nbytes] = a.reshape(n, -1).view(np.uint8)
    return rows


cdef int _check_keys(object keys, Py_ssize_t n) except -1:
    """Raises what is wrong with the caller's cache keys for n states (n
    ints: an integer array or a sequence of ints); 0 when nothing is."""
    if isinstance(keys, np.ndarray):
        if keys.dtype.kind not in "iu":
            raise TypeError(f"keys must be integers, got an array of {keys.dtype}")
        if keys.shape != (n,):
            raise ValueError(f"keys has shape {keys.shape}; {n} states need ({n},)")
        return 0
    keys = list(keys)
    if len(keys) != n:
        raise ValueError(f"{len(keys)} keys for {n} states")
    for k in keys:
        if isinstance(k, (bool, np.bool_)) or not hasattr(k, "__index__"):
            raise TypeError(f"keys must be integers, got {type(k).__name__}")
    return 0


cdef class ClientBase:
    """The base of ``shmeval.Client``: its process's port in a C field, which
    ``port_of`` reads without an attribute lookup.  As an attribute of a
    Python instance it was a dict lookup on every call, about 2% of the
    machine's CPU with 16 workers on 2 cores (docs/performance.md)."""


def port_of(ClientBase client):
    """The calling process's ClientPort of client: registered on first use
    in each process (``Client._register``), and again after a close."""
    return _port_of(client)


cdef inline ClientPort _port_of(ClientBase client):
    cdef object port = client._port
    if port is not None and (<ClientPort>port).pid == _current_pid:
        return <ClientPort>port
    return <ClientPort?>client._register()


# Client.evaluate, evaluate_many and submit: each one line, the call of its
# port's method, bound to Client as they are (no Python frame around a
# request: Client's comment says what it cost).
@cython.binding(True)
def client_evaluate(ClientBase self, object state, bint return_version=False, object key=None,
                    object method=None):
    return _port_of(self).evaluate(state, return_version, key, method)


@cython.binding(True)
def client_evaluate_many(ClientBase self, object states, bint return_version=False,
                         object keys=None, object method=None):
    return _port_of(self).evaluate_many(states, return_version, keys, method)


@cython.binding(True)
def client_submit(ClientBase self, object states, *, bint block=True, bint return_version=False,
                  object keys=None, object method=None):
    return _port_of(self).submit(states, block, return_version, keys, method)
