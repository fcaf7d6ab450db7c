# Included by shmeval/_ring.pyx: ServeGroup and Server, the evaluator's side.

cdef class ServeGroup:
    """The Servers of one segment that serve from several threads of the
    evaluator (pipelined serving): one at a time collects (the scan, the
    gather and the doorbell sleep are single-consumer: the lock), while the
    others' model calls and finishing overlap with it.  in_flight counts the
    members holding a batch; the thread that holds the lock and sees it at 0
    may do work that needs no batch outstanding (reclaiming clients, weight
    updates, closing).  version stamps every batch served from now on; stop
    makes every member's serve() return SERVE_CLOSED.  All fields are read
    and written with the GIL held."""

    def __cinit__(self):
        self.lock = PyThread_allocate_lock()
        if self.lock == NULL:
            raise MemoryError()

    def __dealloc__(self):
        if self.lock != NULL:
            PyThread_free_lock(self.lock)

    cdef inline void _acquire(self) noexcept:
        with nogil:
            PyThread_acquire_lock(self.lock, WAIT_LOCK)

    def quiesce(self):
        """Waits (GIL released between checks) until no member holds a
        batch, and returns True.  Returns False instead once stop is set
        while batches are still in flight (a member that failed stops the
        group; its batch may never finish): the caller must then only stop,
        doing nothing that needs quiet, such as reclaiming a client entry
        (whose slots a batch in flight may still complete) or a weight
        update.  Call holding the lock, with no batch of your own."""
        while self.in_flight:
            if self.stop:
                return False
            with nogil:
                usleep(20)
        return True


cdef class Server:
    """The evaluator's side: collect a batch, then complete or fail it.

    batch is a preallocated C-contiguous array of at least max_batch rows of
    in_bytes; collect gathers the inputs of the requests it takes into rows
    0..n-1.  complete copies row i of each output array into the slot that
    request i came from.  Servers sharing a ServeGroup serve one segment
    from several threads (see serve()).

    With several methods a batch collected holds requests of any of them:
    it is served a method at a time, each method's requests a group of
    their own (_group), and complete, fail and fail_rows act on the group
    outstanding (``method``, ``pending``); the next group is served before
    anything new is collected, so no method waits behind another's next
    batch.
    """

    def __cinit__(self, Segment seg, cnp.ndarray batch, ServeGroup group=None,
                  uint32_t server=0, uint32_t replica=0):
        import os
        if server >= seg.seg.p.servers or replica >= seg.seg.p.replicas:
            raise IndexError(f"server {server} of replica {replica}: the segment has "
                             f"{seg.seg.p.servers} servers, {seg.seg.p.replicas} replicas")
        self.seg = seg
        self.v = server
        self.replica = replica
        # Several replicas take turns collecting under the segment's lock.
        self.shared = seg.seg.p.replicas > 1
        # CPUs this evaluator may run on, when its serving loop starts (after
        # the model factory, which may have pinned it).
        self.ncpu = len(os.sched_getaffinity(0))
        self.group = ServeGroup() if group is None else group
        self.cap = seg.seg.p.max_batch
        if not cnp.PyArray_IS_C_CONTIGUOUS(batch):
            raise ValueError("batch must be C-contiguous")
        if <uint64_t>cnp.PyArray_NBYTES(batch) < self.cap * seg.seg.p.in_bytes:
            raise ValueError("batch buffer smaller than max_batch rows")
        if not seg.layouts:
            raise ValueError("segment spec not set (Segment.set_spec)")
        self.lay = seg.layouts[0]
        nout = max(len(lay.method.outputs) for lay in seg.layouts)
        # Named inputs: the model's input is made from the request rows;
        # several methods: grouped by method first, into rows of their own
        # (twice the batch's rows: a group's padding may run past the end).
        self.multi = len(seg.layouts) > 1
        self.packed = self.multi or self.lay.method.named
        if self.multi:
            self._rows = np.zeros((2 * cnp.PyArray_DIM(batch, 0), seg.seg.p.in_bytes), np.uint8)
        elif self.packed:
            self._rows = batch.view(np.uint8).reshape(cnp.PyArray_DIM(batch, 0), -1)
        # The batch table the completion reads is this process's; the
        # segment has a copy, so that if this replica dies another can put
        # its requests back (shm_requeue).
        if shm_server_replica(&seg.seg, server) != replica:
            raise IndexError(f"server {server} belongs to replica "
                             f"{shm_server_replica(&seg.seg, server)}, not {replica}")
        shm_server_init(&seg.seg, server, replica)
        self.taken_all = <shm_taken *>malloc(sizeof(shm_taken) * self.cap)
        self.taken = self.taken_all
        self.fields = <const char **>malloc(sizeof(char *) * nout)
        self.strides = <int64_t *>malloc(sizeof(int64_t) * nout)
        if self.taken_all == NULL or self.fields == NULL or self.strides == NULL:
            raise MemoryError()
        self.batch = <char *>cnp.PyArray_DATA(batch)
        self._keep = batch
        self.views = [None] * (cnp.PyArray_DIM(batch, 0) + 1)  # batch[:rows], made once

    def __dealloc__(self):
        if self.seg_locked:
            shm_collect_unlock(&self.seg.seg)
        if self.locked:
            PyThread_release_lock(self.group.lock)
        free(self.taken_all)
        free(self.fields)
        free(self.strides)
        free(self.calls)
        free(self.buckets)

    def configure(self, object config, uint64_t idle_ns):
        """Takes what serve() reads from ``config`` (a
        shmeval.config.ServeConfig, as fitted to the model) into C fields,
        once: whether non-finite float outputs fail their rows, the sizes
        batches are padded to, and the batch cap, spin budget and wait for
        a fuller batch the settings fix (the tuner's come through tune()).
        serve() returns IDLE after ``idle_ns`` without a request."""
        cdef uint32_t *b = NULL
        cdef Py_ssize_t i, nb
        policy = config.policy
        sizes = policy.buckets or ()
        nb = len(sizes)
        if nb and sizes[nb - 1] >= len(self.views):
            raise ValueError(f"bucket {sizes[nb - 1]} is larger than the batch buffer "
                             f"({len(self.views) - 1} rows)")
        fixed = policy.overrides()
        self.tune(policy.max_batch, fixed.spin_ns or 0, fixed.max_wait_ns or 0)
        if nb:
            b = <uint32_t *>malloc(sizeof(uint32_t) * nb)
            if b == NULL:
                raise MemoryError()
            for i in range(nb):
                b[i] = sizes[i]
        free(self.buckets)
        self.buckets, self.n_buckets = b, <uint32_t>nb
        self.reject_nonfinite = config.reject_nonfinite
        self.idle_ns = idle_ns

    def tune(self, uint32_t max_batch, uint64_t spin_ns, uint64_t max_wait_ns):
        """Sets the batch cap, the idle spin budget and the wait for a
        fuller batch serve() uses from its next collect (the tuner's
        decision, or the fixed settings: configure())."""
        if max_batch == 0:
            raise ValueError("max_batch must be >= 1")
        self.max_batch, self.spin_ns, self.max_wait_ns = max_batch, spin_ns, max_wait_ns

    cdef inline void _collected(self, uint32_t n) noexcept:
        """A batch of n requests was collected: they are outstanding (the
        ServeGroup's in_flight count, the segment's batch table)."""
        self.taken = self.taken_all
        self.n = self.left = n
        self.ng = self.gi = 0
        self.group.in_flight += 1
        shm_server_set_n(&self.seg.seg, self.v, n)

    cdef inline void _finished(self, uint32_t k) noexcept:
        """k requests of the batch were answered or failed.  The segment's
        table keeps listing the whole batch until none is left (a put-back
        skips the slots no longer TAKEN), so that every request still
        outstanding, of any group, is found there should this replica die."""
        self.left -= k
        if self.left == 0:
            self.group.in_flight -= 1
            shm_server_set_n(&self.seg.seg, self.v, 0)

    cdef uint32_t _group(self, uint32_t n) except? 0xffffffff:
        """Several methods: orders the batch's requests by method (stable),
        each method's a group of rows of their own (self._rows), fails the
        requests whose header names no method, and makes the first group
        outstanding.  Returns its size (0: nothing left)."""
        cdef uint32_t i, m, nm = len(self.seg.layouts), at = 0, bad = 0
        cdef uint64_t inb = self.seg.seg.p.in_bytes
        cdef uint32_t counts[16]
        cdef uint32_t nxt[16]
        cdef shm_taken *tmp = <shm_taken *>malloc(sizeof(shm_taken) * max(n, 1))
        cdef shm_taken *badt = <shm_taken *>malloc(sizeof(shm_taken) * max(n, 1))
        cdef char *dst = <char *>cnp.PyArray_DATA(<cnp.ndarray>self._rows)
        cdef bytes text = b"ModelError: the request names no method of this evaluator"
        cdef const char *tp = text
        cdef uint32_t tl = len(text)
        if tmp == NULL or badt == NULL:
            free(tmp)
            free(badt)
            raise MemoryError()
        memset(counts, 0, sizeof(counts))
        for i in range(n):
            m = (<uint32_t *>(self.batch + i * inb))[0]
            if m < nm:
                counts[m] += 1
        for m in range(nm):
            nxt[m] = at
            self.gstart[m] = at
            at += counts[m]
        memcpy(tmp, self.taken_all, sizeof(shm_taken) * n)
        for i in range(n):
            m = (<uint32_t *>(self.batch + i * inb))[0]
            if m < nm:
                memcpy(dst + nxt[m] * inb, self.batch + i * inb, inb)
                self.taken_all[nxt[m]] = tmp[i]
                nxt[m] += 1
            else:
                badt[bad] = tmp[i]
                bad += 1
        free(tmp)
        if bad:
            with nogil:
                shm_fail(&self.seg.seg, badt, bad, tp, tl)
            shm_stat_inc(&self.seg.seg, STAT_INDEX["failed_requests"], bad)
            self._finished(bad)
        free(badt)
        self.ng = 0
        for m in range(nm):
            if counts[m]:
                self.gmethod[self.ng] = m
                self.gcount[self.ng] = counts[m]
                self.ng += 1
        self.gi = -1
        return self._next_group()

    cdef uint32_t _next_group(self) noexcept:
        """Makes the batch's next group outstanding; its size (0: none)."""
        cdef uint32_t m
        self.gi += 1
        if self.gi >= self.ng:
            self.n = 0
            return 0
        m = self.gmethod[self.gi]
        self.lay = self.seg.layouts[m]
        self.taken = self.taken_all + self.gstart[m]
        self.n = self.gcount[self.gi]
        return self.n

    cdef object _model_input(self, uint32_t rows):
        """The outstanding group's input for the model, padded to rows: a
        view of the batch (one unnamed input), or {input name: array} made
        from its request rows."""
        cdef uint32_t start = self.gstart[self.lay.index] if self.multi else 0
        cdef uint64_t inb = self.seg.seg.p.in_bytes
        if not self.packed:
            view = self.views[rows]
            if view is None:
                view = self.views[rows] = self._keep[:rows]
            return view
        if self.lay.in_native:
            return self.lay._unpack(<const char *>cnp.PyArray_DATA(<cnp.ndarray>self._rows)
                                    + start * inb, inb, rows)
        return self.lay.method.unpack(self._rows[start:start + rows])

    def request_rows(self):
        """The outstanding group's request rows (uint8, pending x
        in_bytes), for the serving loop's row isolation."""
        cdef uint32_t start = self.gstart[self.lay.index] if self.multi else 0
        if not self.packed:
            return self._keep[:self.n]
        return self._rows[start:start + self.n]

    @property
    def method(self):
        """The index of the outstanding group's method (spec.methods)."""
        return self.lay.index

    cdef inline void _seg_unlock(self) noexcept:
        if self.seg_locked:
            self.seg_locked = False
            shm_collect_unlock(&self.seg.seg)

    def record_calls(self, Py_ssize_t cap):
        """Makes serve() record the start (CLOCK_MONOTONIC ns), duration (ns),
        rows (padded to a bucket) and requests of each model call that
        returns, up to ``cap`` calls between two take_calls() (the calls
        past that run unrecorded); 0 stops recording.  serve() times every
        call anyway, so the record costs a few stores, and no Python frame
        around the model."""
        cdef int64_t *buf = NULL
        if cap < 0:
            raise ValueError("cap must be >= 0")
        if cap:
            buf = <int64_t *>malloc(sizeof(int64_t) * 4 * cap)
            if buf == NULL:
                raise MemoryError()
        free(self.calls)
        self.calls, self.calls_cap, self.n_calls = buf, cap, 0

    def take_calls(self):
        """The calls recorded since the last take, as an int64 array of
        shape (n, 4) (start, duration, rows, requests); empties the record."""
        out = np.empty((self.n_calls, 4), dtype=np.int64)
        if self.n_calls:
            memcpy(cnp.PyArray_DATA(out), self.calls, sizeof(int64_t) * 4 * self.n_calls)
        self.n_calls = 0
        return out

    def unlock(self):
        """Releases the collect locks (the segment's, then the group's) if
        serve() returned holding them."""
        self._seg_unlock()
        if self.locked:
            self.locked = False
            PyThread_release_lock(self.group.lock)

    def take_over_lock(self, int holder):
        """Takes the segment's collect lock over from server `holder` (after
        serve() returned LOCKED_OUT), only if `holder`'s replica was marked
        dead (Segment.replica_stop(r, "dead")), or if `holder` names no
        server (the lock word was scribbled on): a live holder may simply
        be slow or waiting for requests, and taking the lock from it would
        let two scans run at once.  Having taken it from a dead replica,
        puts that replica's batches back before anything is scanned
        (shm_requeue_replica: a slot the dead one listed but had not taken
        is still READY then, and stays so).  Returns True
        when this server holds the lock now (unlock() releases it)."""
        cdef uint32_t state, r = 0
        cdef uint64_t starttime, version
        if not self.shared or self.seg_locked or holder < 0:
            return False
        if <uint32_t>holder < self.seg.seg.p.servers:
            r = shm_server_replica(&self.seg.seg, <uint32_t>holder)
            shm_replica_info(&self.seg.seg, r, &starttime, &state, &version)
            if state != REPLICA_DEAD:
                return False
        if shm_collect_steal(&self.seg.seg, self.v, <uint32_t>holder) != SHM_OK:
            return False
        self.seg_locked = True
        if <uint32_t>holder < self.seg.seg.p.servers:
            shm_requeue_replica(&self.seg.seg, self.v, r)
        return True

    def requeue_replica(self, uint32_t r):
        """Puts back the batches of replica r, whose process is gone, for
        the replicas left to serve (their requests return to READY, and the
        evaluator's doorbell rings).  Only while this server holds the
        segment's collect lock (between batches, after serve() returned
        IDLE holding it, or after take_over_lock): see shm_requeue_replica.
        Returns how many requests went back (0 without the lock)."""
        if r >= self.seg.seg.p.replicas:
            raise IndexError(f"replica {r} of {self.seg.seg.p.replicas}")
        return shm_requeue_replica(&self.seg.seg, self.v, r)

    @property
    def server(self):
        return self.v

    cpdef int collect(self, uint32_t max_batch, uint64_t spin_ns, uint64_t max_wait_ns,
                      uint64_t timeout_ns) except? -1000:
        """Returns n > 0 requests gathered, 0 on timeout, CLOSED, CONTROL
        (a control request is pending; nothing was taken), or BEHIND
        (several replicas: the weights floor is past this replica's
        version; nothing was taken).  (cpdef,
        as finish_fast and complete: serve() calls them without a Python
        call each, on the evaluator's path between batches.)"""
        cdef int rc
        if self.left:
            raise ShmevalError("collect() while a batch is outstanding")
        max_batch = min(max_batch, self.cap)
        self.end_busy()
        spin_ns = shm_evaluator_spin(spin_ns, shm_n_attached(&self.seg.seg), self.ncpu)
        with nogil:
            rc = shm_collect(&self.seg.seg, self.v, self.taken_all, self.batch, max_batch,
                             &self.group.cursor, spin_ns, max_wait_ns, timeout_ns)
        if rc > 0:
            self._collected(rc)
            self.busy_since = shm_now_ns()
        return rc

    cpdef end_busy(self):
        """Ends the busy period of the last batch (its time counts in
        busy_ns); call before work between batches that is not serving."""
        if self.busy_since:
            shm_stat_inc(&self.seg.seg, ST_BUSY_NS, shm_now_ns() - self.busy_since)
            self.busy_since = 0

    def serve(self, object model, uint64_t until_ns):
        """The serving loop's common path without Python bytecode between
        batches: collect -> model(batch[:rows]) -> finish_fast, repeated until
        something needs the Python layer, with the settings configure() and
        tune() set.  Returns (kind, n, rows, detail, model_ns) with kind:
          IDLE    nothing arrived within the idle timeout (detail True: the
                  clients paused), or until_ns (CLOCK_MONOTONIC) passed
                  (detail None): time for housekeeping
          CLOSED  close requested, or the group's stop flag is set
          SLOW    the outputs (detail) need conversion or an explanation
          RAISED  the model raised (detail is the exception)
          CONTROL a control request is pending (no batch outstanding)
          LOCKED_OUT (several replicas) the segment's collect lock stayed
                  taken for the idle timeout: detail is the holding server,
                  whose replica may have died (take_over_lock)
          BEHIND  (several replicas) another replica collects with newer
                  weights: this one must apply them first
        Each batch is padded to the next bucket size; batches are stamped
        with the group's version.

        Each collect happens under the group's lock and, with several
        replicas, the segment's collect lock, both released before the model
        call, so that another thread or replica can collect the next batch
        meanwhile.  IDLE (with both locks, so housekeeping may reclaim),
        CLOSED, CONTROL, LOCKED_OUT and BEHIND return holding the group's
        lock (so nobody in this replica starts a batch; group.quiesce() then
        waits out the batches in flight): call unlock() after the work they
        call for.  SLOW and RAISED return without it, the batch outstanding."""
        cdef int rc
        cdef uint32_t n
        cdef ServeGroup g = self.group
        if self.max_batch == 0:
            raise ShmevalError("serve() before configure()")
        if self.locked:
            raise ShmevalError("serve() while holding the collect lock: call unlock() first")
        while True:
            if self.left:  # the next method's group of the batch collected
                n = self._next_group()
                if n:
                    rc = self._serve_group(model, n)
                    if rc:
                        return self._returned
                    continue
            g._acquire()
            self.locked = True
            if g.stop:
                return (SERVE_CLOSED, 0, 0, None, 0)
            if self.shared:
                with nogil:
                    rc = shm_collect_lock(&self.seg.seg, self.v, self.idle_ns)
                if rc == SHM_TIMEOUT:
                    return (SERVE_LOCKED_OUT, 0, 0, shm_collect_holder(&self.seg.seg), 0)
                self.seg_locked = True
                if not shm_version_ok(&self.seg.seg, g.version):
                    self._seg_unlock()
                    return (SERVE_BEHIND, 0, 0, None, 0)
            if until_ns and shm_now_ns() >= until_ns:
                return (SERVE_IDLE, 0, 0, None, 0)
            rc = self.collect(self.max_batch, self.spin_ns, self.max_wait_ns, self.idle_ns)
            if rc == 0:
                return (SERVE_IDLE, 0, 0, True, 0)
            self._seg_unlock()
            if rc == SHM_CLOSED:
                return (SERVE_CLOSED, 0, 0, None, 0)
            if rc == SHM_CONTROL:
                return (SERVE_CONTROL, 0, 0, None, 0)
            if rc == SHM_BEHIND:
                return (SERVE_BEHIND, 0, 0, None, 0)
            self.locked = False
            PyThread_release_lock(g.lock)
            n = rc
            if self.multi:
                n = self._group(n)
                if n == 0:
                    continue
            if self._serve_group(model, n):
                return self._returned

    cdef int _serve_group(self, object model, uint32_t n) except -1:
        """Calls the model on the outstanding group of n requests (its
        method's function, with several: model[index]) and finishes it when
        the outputs are as declared.  Returns 0 when done; 1 with what
        serve() returns in _returned (SLOW, RAISED), the group outstanding."""
        cdef uint32_t rows = n, bi
        cdef uint64_t t0, model_ns
        for bi in range(self.n_buckets):
            if self.buckets[bi] >= n:
                rows = self.buckets[bi]
                break
        x = self._model_input(rows)
        f = model[self.lay.index] if self.multi else model
        t0 = shm_now_ns()
        try:
            out = f(x)
        except Exception as e:
            self._returned = (SERVE_RAISED, n, rows, e, shm_now_ns() - t0)
            return 1
        model_ns = shm_now_ns() - t0
        if self.n_calls < self.calls_cap:
            self.calls[4 * self.n_calls] = <int64_t>t0
            self.calls[4 * self.n_calls + 1] = <int64_t>model_ns
            self.calls[4 * self.n_calls + 2] = rows
            self.calls[4 * self.n_calls + 3] = n
            self.n_calls += 1
        if not self.finish_fast(out, rows, model_ns, self.group.version):
            self._returned = (SERVE_SLOW, n, rows, out, model_ns)
            return 1
        return 0

    cpdef bint finish_fast(self, object out, uint32_t rows, uint64_t model_ns,
                           uint64_t version) except -1:
        """Records and completes the outstanding batch if the model's outputs
        are already exactly as declared: arrays of the declared dtype (native
        order, C-contiguous) and shape (rows, *shape), and finite when
        configured to reject non-finite outputs (configure()).
        Returns False, having done nothing, otherwise: the caller then
        converts the outputs or explains what is wrong."""
        cdef list arrays
        cdef cnp.ndarray a
        cdef cnp.npy_intp *want
        cdef Layout lay = self.lay
        cdef Py_ssize_t j, i, nout = lay.n_out
        if not lay.out_native or self.n == 0:
            return False
        if type(out) is dict:
            if not self.extra_outputs_ok and PyDict_Size(out) != nout:
                return False  # the slow path warns about the undeclared ones, once
            arrays = []
            for name in lay.out_names:
                x = (<dict>out).get(name)
                if x is None:
                    return False
                arrays.append(x)
        elif type(out) is tuple or type(out) is list:
            if len(out) != nout:
                return False
            arrays = list(out)
        elif nout == 1:
            arrays = [out]
        else:
            return False
        for j in range(nout):
            x = arrays[j]
            if type(x) is not cnp.ndarray:
                return False
            a = <cnp.ndarray>x
            want = lay._out_dims(j)
            if not cnp.PyArray_ISNOTSWAPPED(a) or cnp.PyArray_TYPE(a) != lay.out_type[j] or \
                    cnp.PyArray_NDIM(a) != lay.out_nd[j] + 1 or cnp.PyArray_DIM(a, 0) != rows:
                return False
            for i in range(lay.out_nd[j]):
                if cnp.PyArray_DIM(a, i + 1) != want[i]:
                    return False
            if not _rows_ok(a, self.n, lay.out_nbytes[j]):
                return False
            if self.reject_nonfinite and lay.out_float[j] and _finite(a, self.n) != 1:
                return False
        shm_record_batch(&self.seg.seg, self.replica, self.n, rows, model_ns, 0)
        if self.multi:
            shm_record_method(&self.seg.seg, self.lay.index, self.n, model_ns)
        self.complete(arrays, version)
        return True

    @property
    def pending(self):
        return self.n

    cpdef uint32_t complete(self, list arrays, uint64_t model_version) except? 0xffffffff:
        """Scatters row i of each output array into request i's slot; marks
        DONE and wakes.  Each array needs at least n rows of exactly the
        declared row size, each row contiguous (axis 0 may be strided)."""
        cdef Layout lay = self.lay
        cdef uint32_t j, done, nf = lay.n_out
        if len(arrays) != nf:
            raise ValueError("expected %d output arrays" % nf)
        for j in range(nf):
            if not _rows_ok(arrays[j], self.n, lay.out_nbytes[j]):
                raise ValueError("output array %d: too few rows, wrong row size, or rows "
                                 "not contiguous" % j)
            self.fields[j] = <const char *>cnp.PyArray_DATA(<cnp.ndarray>arrays[j])
            self.strides[j] = cnp.PyArray_STRIDE(<cnp.ndarray>arrays[j], 0)
        with nogil:
            done = shm_complete_fields(&self.seg.seg, self.taken, self.n, nf, self.fields,
                                       lay.out_nbytes, self.strides, lay.out_off,
                                       model_version)
        self._finished(self.n)
        self.n = 0
        return done

    def fail_rows(self, object rows, str message):
        """Fails the requests at the given batch rows (sorted, distinct,
        < pending) with message, and removes them from the outstanding
        batch: the others keep their order, so complete() then takes arrays
        holding just their rows.  Returns how many were failed."""
        cdef Py_ssize_t i, j = 0, kept = 0, nb = len(rows)
        cdef uint32_t done
        cdef bytes b = message.encode("utf-8", "replace")
        cdef const char *p = b
        cdef uint32_t ln = len(b)
        cdef shm_taken *bad
        if nb == 0:
            return 0
        for i in range(nb):
            if not 0 <= rows[i] < self.n or (i and rows[i] <= rows[i - 1]):
                raise ValueError("rows must be sorted, distinct and < pending")
        bad = <shm_taken *>malloc(sizeof(shm_taken) * nb)
        if bad == NULL:
            raise MemoryError()
        try:
            for i in range(self.n):
                if j < nb and <Py_ssize_t>rows[j] == i:
                    bad[j] = self.taken[i]
                    j += 1
                else:
                    self.taken[kept] = self.taken[i]
                    kept += 1
            with nogil:
                done = shm_fail(&self.seg.seg, bad, <uint32_t>nb, p, ln)
            self.n = <uint32_t>kept
            self._finished(<uint32_t>nb)
        finally:
            free(bad)
        return done

    def fail(self, str message):
        """Fails every request of the outstanding batch with message."""
        cdef bytes b = message.encode("utf-8", "replace")
        cdef const char *p = b
        cdef uint32_t ln = len(b)
        cdef uint32_t done
        with nogil:
            done = shm_fail(&self.seg.seg, self.taken, self.n, p, ln)
        self._finished(self.n)
        self.n = 0
        return done

    def record(self, uint32_t n, uint32_t rows, uint64_t model_ns, bint failed):
        shm_record_batch(&self.seg.seg, self.replica, n, rows, model_ns, failed)
        if self.multi:
            shm_record_method(&self.seg.seg, self.lay.index, n, model_ns)
