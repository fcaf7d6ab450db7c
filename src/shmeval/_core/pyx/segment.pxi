# Included by shmeval/_ring.pyx: Segment, one process's view of a segment.

cdef class Segment:
    """One mapping of a shared segment in this process.

    The mapping is released only when this object is garbage-collected, never
    by an explicit close: a thread may still be asleep on a futex word in it.
    """

    def __dealloc__(self):
        self._retire_ticker()
        if self.old_tickers is not None:
            for addr in self.old_tickers:
                free(<void *><size_t>addr)
        if self.addr != NULL:
            munmap(self.addr, self.size)
        free(self.cbuf)

    cdef uint32_t _begin(self, uint32_t c, uint32_t k) except? 0xffffffff:
        """FREE -> WRITING for this process; returns the slot's generation,
        which every later step of the request names (wait, fetch, release):
        a slot reclaimed meanwhile, and perhaps reused by another process,
        is then never read or released as this request's."""
        cdef uint32_t gen = 0
        cdef int rc = self._begin_all(c, &k, 1, &gen)
        if rc < 0:
            _begin_failed(rc)
        return gen

    cdef int _begin_all(self, uint32_t c, const uint32_t *ks, Py_ssize_t m,
                        uint32_t *gens) noexcept:
        """Begins slots ks[0:m] (their generations into gens), all or none:
        when one begin fails, the slots begun before it go back to FREE
        (shm_slot_abort) and its status is returned (_begin_failed raises
        it), so the caller can put every slot back on its free list and
        each can be begun again.  0 when all are begun."""
        cdef Py_ssize_t i, j
        cdef int rc
        for i in range(m):
            rc = shm_slot_begin(&self.seg, c, ks[i], _current_pid, &gens[i])
            if rc < 0:
                for j in range(i):
                    shm_slot_abort(&self.seg, c, ks[j], gens[j])
                return rc
            self.ck1[ks[i]] = 0  # not cached unless the caller sets its keys
        return 0

    cdef inline void _cache_as(self, uint32_t c, uint32_t k, uint64_t k1, uint64_t k2,
                               bint hashed) noexcept:
        """After the input was copied into slot k (still WRITING, so private
        to this process): its answer is to be cached under (k1, k2), the
        keys of its lookup; k1 == 0, not cached.  Keys that are hashes of
        the state's bytes (hashed) are computed again from the slot, so that
        an answer is cached under the bytes it was computed from, even if
        the caller's array changed between the lookup and the copy (another
        thread, or NumPy releasing the GIL during a large copy).  A caller's
        key is the caller's claim and is kept as it is."""
        if k1 and hashed:
            shm_hash_state(shm_slot_in(&self.seg, c, k), self.seg.p.in_bytes, &k1, &k2)
        self.ck1[k] = k1
        self.ck2[k] = k2

    cdef int _map(self, int fd, uint64_t size) except -1:
        cdef void *a
        if size == 0:
            _check(SHM_E_TOO_SMALL, "attach %s" % self.name)
        with nogil:
            a = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        if a == MAP_FAILED:
            raise SegmentError("mmap of %s (%d bytes) failed" % (self.name, size))
        self.addr = <char *>a
        self.size = size
        return 0

    @staticmethod
    def create(int fd, uint64_t size, in_bytes, out_bytes, max_clients, slots_per_client,
               max_batch, replicas, servers, bytes spec, int owner_pid, uint64_t pid_ns,
               uint64_t time_ns, name, cache_entries=0, uint64_t owner_starttime=0):
        """Maps a new zero-filled segment (fd) and formats it for the owner
        process (its /proc start time: owner_starttime, 0 unknown) in the
        given pid and time namespaces."""
        cdef Segment self = Segment.__new__(Segment)
        cdef shm_params p
        self.name = name
        _params(&p, in_bytes, out_bytes, max_clients, slots_per_client, max_batch, replicas,
                servers, cache_entries)
        if len(spec) > SHM_SPEC_MAX:
            raise ValueError("spec is %d bytes, the header holds %d" % (len(spec), SHM_SPEC_MAX))
        self._map(fd, size)
        _check(shm_init(&self.seg, self.addr, size, &p, spec, len(spec), owner_pid,
                        owner_starttime, pid_ns, time_ns), "create %s" % name)
        self._alloc_cache_buffer()
        return self

    @staticmethod
    def attach(int fd, uint64_t size, name):
        """Maps an existing segment and validates its header."""
        cdef Segment self = Segment.__new__(Segment)
        self.name = name
        if size < 4096:
            _check(SHM_E_TOO_SMALL, "attach %s" % name)
        self._map(fd, size)
        _check(shm_attach(&self.seg, self.addr, size), "attach %s" % name)
        self._alloc_cache_buffer()
        return self

    cdef int _alloc_cache_buffer(self) except -1:
        if self.seg.p.cache_log2:
            self.cbuf = <uint64_t *>calloc(self.seg.l.cache_words, 8)
            if self.cbuf == NULL:
                raise MemoryError()
        return 0

    def set_spec(self, object spec):
        """The spec's methods (spec.Spec), each as a Layout, in order:
        client and server read their outputs' places from these."""
        self.layouts = tuple(Layout(m, self.seg.p.out_bytes) for m in spec.methods)

    # ---------------------------------------------------------------- header
    @property
    def spec(self):
        cdef uint32_t n
        cdef const char *p = shm_spec(&self.seg, &n)
        return p[:n]

    @property
    def params(self):
        return dict(in_bytes=self.seg.p.in_bytes, out_bytes=self.seg.p.out_bytes,
                    max_clients=self.seg.p.max_clients,
                    slots_per_client=self.seg.p.slots_per_client,
                    max_batch=self.seg.p.max_batch, replicas=self.seg.p.replicas,
                    servers=self.seg.p.servers, cache_entries=shm_cache_entries(&self.seg))

    @property
    def nbytes(self):
        return self.size

    @property
    def error_bytes(self):
        """Bytes of error text a failed request can carry (its output area)."""
        return self.seg.l.out_area

    @property
    def owner_pid(self):
        return shm_owner_pid(&self.seg)

    @property
    def owner_starttime(self):
        """The creator's /proc start time (clock ticks since boot; 0 unknown)."""
        return shm_owner_starttime(&self.seg)

    @property
    def pid_ns(self):
        """The creator's pid namespace (inode of /proc/<pid>/ns/pid; 0 unknown)."""
        return shm_pid_ns(&self.seg)

    @property
    def time_ns(self):
        """The creator's time namespace (inode of /proc/<pid>/ns/time; 0 unknown)."""
        return shm_time_ns(&self.seg)

    def ev_state(self):
        return shm_ev_state(&self.seg)

    def replicas_serving(self):
        """How many replicas are serving now."""
        return shm_replicas_serving(&self.seg)

    def replicas(self):
        """One dict per replica: index, pid (0 before it serves), start
        time, state ("empty", "serving", "stopped", "dead"), device, weights
        version and its requests, batches and model time (ns)."""
        cdef uint32_t r, state
        cdef uint64_t st, version
        cdef uint64_t counts[3]
        cdef int32_t pid
        out = []
        for r in range(self.seg.p.replicas):
            pid = shm_replica_info(&self.seg, r, &st, &state, &version)
            shm_replica_stats(&self.seg, r, counts)
            out.append(dict(replica=r, pid=pid, starttime=st,
                            state=_REPLICA_STATES.get(state, "unknown"),
                            device=shm_replica_device(&self.seg, r).decode("utf-8", "replace"),
                            version=version, requests=counts[0], batches=counts[1],
                            model_ns=counts[2]))
        return out

    def set_report(self, uint32_t r, bytes text):
        """Replica r publishes text (its tuner's report) for every reader
        of the segment; longer than :data:`REPORT_BYTES` is cut.  Only
        replica r's process calls this."""
        self._replica(r)
        shm_report_write(&self.seg, r, text, len(text))

    def report(self, uint32_t r):
        """Replica r's last published text (bytes), or None before the
        first (or when every try overlapped a write)."""
        cdef char buf[8 * SHM_REPORT_WORDS]
        cdef int64_t n
        self._replica(r)
        n = shm_report_read(&self.seg, r, buf, sizeof(buf))
        return buf[:n] if n > 0 else None

    def replica_stop(self, uint32_t r, str state, int32_t pid=0):
        """Replica r leaves "serving" for "stopped" (by itself) or "dead"
        (found dead by another: ``pid``, the process found gone, so that
        one restarted meanwhile is not stopped).  Returns the replicas
        still serving, or -1 when r was not serving (someone else got there
        first) or is another process than ``pid`` now."""
        self._replica(r)
        return shm_replica_stop(&self.seg, r, REPLICA_STOPPED if state == "stopped"
                                else REPLICA_DEAD, pid)

    def replica_restart(self, uint32_t r, int32_t pid, uint64_t starttime):
        """Replica r's restarted process (pid, start time) takes its entry
        over: out of "serving" if the old process still held it, then named
        by the new process (shm_replica_restart).  Before its servers are
        set up: see replica_settled and requeue_restarted."""
        self._replica(r)
        return shm_replica_restart(&self.seg, r, pid, starttime)

    def replica_settled(self, uint32_t r):
        """True once replica r's batch tables are empty and the collect lock
        names none of its servers (the other replicas put back what its
        dead process held)."""
        self._replica(r)
        return bool(shm_replica_settled(&self.seg, r))

    def requeue_restarted(self, uint32_t r):
        """Restarted replica r puts back what its dead process held, itself:
        only when no other replica serves (shm_requeue_restarted).  Returns
        how many requests went back."""
        self._replica(r)
        return shm_requeue_restarted(&self.seg, r)

    def restarts_left(self):
        """How many restarts of a dead serving process the owner may still
        make (0: it does not heal)."""
        return shm_restarts_left(&self.seg)

    def set_restarts_left(self, uint32_t n):
        """Owner side: announces how many restarts it may still make."""
        shm_set_restarts_left(&self.seg, n)

    def raise_version_floor(self, uint64_t version):
        """No replica collects with weights older than `version` from now
        on, while one serves it (shm_version_ok)."""
        shm_raise_floor(&self.seg, version)

    def collect_holder(self):
        """The serving thread (server index) holding the collect lock, or
        -1 (server_replica() says whose it is)."""
        return shm_collect_holder(&self.seg)

    def server_replica(self, uint32_t v):
        """The replica serving thread (server) v belongs to."""
        if v >= self.seg.p.servers:
            raise IndexError("server index out of range")
        return shm_server_replica(&self.seg, v)

    def replica_version(self, uint32_t r, uint64_t version):
        """Replica r serves weights `version` now (statistics)."""
        self._replica(r)
        shm_replica_version(&self.seg, r, version)

    cdef inline int _replica(self, uint32_t r) except -1:
        if r >= self.seg.p.replicas:
            raise IndexError("replica index out of range")
        return 0

    def n_attached(self):
        return shm_n_attached(&self.seg)

    def crowding(self):
        """How crowded the evaluator's CPUs are (CROWD_NONE, CROWD_YIELD or
        CROWD_SLEEP), as its tuner last published."""
        return shm_crowding(&self.seg)

    def set_crowding(self, uint32_t c):
        """Publishes the crowding every client's spin rule reads (_spin)."""
        if c > SHM_CROWD_SLEEP:
            raise ValueError(f"crowding must be CROWD_NONE, CROWD_YIELD or CROWD_SLEEP, got {c}")
        shm_set_crowding(&self.seg, c)

    def request_close(self):
        with nogil:
            shm_request_close(&self.seg)

    def stat(self, name):
        return shm_stat_get(&self.seg, STAT_INDEX[name])

    def method_stats(self):
        """[(requests, model calls, model ns)] of each method, in order (an
        evaluator of several methods counts them; one method, zeros)."""
        cdef uint32_t m
        return [(shm_method_stat(&self.seg, m, 0), shm_method_stat(&self.seg, m, 1),
                 shm_method_stat(&self.seg, m, 2)) for m in range(len(self.layouts))]

    def raw_stats(self):
        """Counters and histograms, read with relaxed loads (a snapshot)."""
        cdef uint32_t i
        cdef cnp.ndarray[cnp.uint64_t, ndim=1] wait = cnp.PyArray_ZEROS(
            1, [SHM_HIST_BINS], cnp.NPY_UINT64, 0)
        cdef cnp.ndarray[cnp.uint64_t, ndim=1] model = cnp.PyArray_ZEROS(
            1, [SHM_HIST_BINS], cnp.NPY_UINT64, 0)
        cdef cnp.npy_intp nb = self.seg.p.max_batch + 1
        cdef cnp.ndarray[cnp.uint64_t, ndim=1] batch = cnp.PyArray_ZEROS(
            1, &nb, cnp.NPY_UINT64, 0)
        for i in range(SHM_HIST_BINS):
            wait[i] = shm_hist_wait(&self.seg, i)
            model[i] = shm_hist_model(&self.seg, i)
        for i in range(self.seg.p.max_batch + 1):
            batch[i] = shm_hist_batch(&self.seg, i)
        d = {name: shm_stat_get(&self.seg, i) for i, name in enumerate(STAT_NAMES)}
        d.update(hist_wait=wait, hist_model=model, batch_hist=batch,
                 clients=shm_n_attached(&self.seg), heartbeat_ns=shm_heartbeat(&self.seg),
                 now_ns=shm_now_ns(), ev_state=shm_ev_state(&self.seg))
        return d

    # ---------------------------------------------------------------- client
    def register(self, int32_t pid, uint64_t starttime, uint64_t pid_ns):
        """Claims a client-table entry for a process (its /proc start time
        and pid namespace, 0 when unknown); returns its index."""
        return _check(shm_client_register(&self.seg, pid, starttime, pid_ns),
                      "register client")

    def detach(self, uint32_t c):
        self._client(c)
        if self.ticker != NULL and self.ticker.c == c:
            # Before the entry can become another process's: a ticker rings
            # its client's doorbell bit.
            self._retire_ticker()
        shm_client_detach(&self.seg, c)

    # A ticker lets this process's waiters sleep without a timer (ring.h,
    # shm_ticker; docs/protocol.md, Waiting).
    def start_ticker(self, uint32_t c, uint64_t period_ns):
        """Starts a ticker thread for client c of this process, ticking every
        period_ns (any previous one is stopped first).  Waits of c with a
        timeout of at least period_ns then sleep without a timer and return
        TIMEOUT at the next tick.  Returns False when no thread could be
        started (waits then use timers)."""
        cdef shm_ticker *t
        cdef int rc
        self._client(c)
        self._retire_ticker()
        t = <shm_ticker *>calloc(1, sizeof(shm_ticker))
        if t == NULL:
            raise MemoryError()
        rc = shm_ticker_start(t, &self.seg, c, period_ns)
        if rc != 0:
            free(t)
            return False
        self.ticker = t
        self.ticker_pid = _current_pid
        return True

    def stop_ticker(self):
        """Stops this process's ticker, if any (waits then use timers)."""
        self._retire_ticker()

    def ticker_running(self, uint32_t c):
        """True when waits of client c with a timeout of at least the
        ticker's period go without a timer in this process."""
        return self._ticker_for(c, UINT64_MAX) != NULL

    cdef void _retire_ticker(self):
        # A stopped ticker is kept (not reused, not freed) until the segment
        # goes: a waiter that chose it may still read it.  A forked child
        # inherits the pointer but not the thread: it only forgets it.
        if self.ticker == NULL:
            return
        if self.ticker_pid == _current_pid:
            with nogil:
                shm_ticker_stop(self.ticker)
        if self.old_tickers is None:
            self.old_tickers = []
        self.old_tickers.append(<size_t>self.ticker)
        self.ticker = NULL

    cdef inline shm_ticker *_ticker_for(self, uint32_t c, uint64_t timeout_ns) noexcept nogil:
        cdef shm_ticker *t = self.ticker
        if t != NULL and self.ticker_pid == _current_pid and t.c == c and t.running and \
                timeout_ns >= t.period_ns:
            return t
        return NULL

    cdef inline int _client(self, uint32_t c) except -1:
        if c >= self.seg.p.max_clients:
            raise IndexError("client index out of range")
        return 0

    cdef inline int _slot(self, uint32_t c, uint32_t k) except -1:
        if c >= self.seg.p.max_clients or k >= self.seg.p.slots_per_client:
            raise IndexError("slot index out of range")
        return 0

    def post(self, uint32_t c, list slots, cnp.ndarray rows, object at, object k1=None,
             object k2=None, bint hashed=True):
        """Copies rows into slots[i] -- rows[at + i] when at is an int, rows[at[i]]
        when a list -- publishes them all, then rings the evaluator's
        doorbell once; returns the slots' generations.  rows must be
        C-contiguous with rows of in_bytes each (the client layer guarantees
        it).  k1, k2: uint64 arrays of every row's cache keys (cache_lookup),
        to cache the answers; None: not cached; hashed: they are hashes of
        the rows' bytes (not the caller's keys), hashed again from the
        slots (_cache_as)."""
        cdef uint64_t inb = self.seg.p.in_bytes
        cdef Py_ssize_t i, n = len(slots), r
        cdef Py_ssize_t nrows = cnp.PyArray_NBYTES(rows) // inb
        cdef Py_ssize_t idx[SHM_MAX_SLOTS_PER_CLIENT]
        cdef uint32_t ks[SHM_MAX_SLOTS_PER_CLIENT]
        cdef uint32_t gs[SHM_MAX_SLOTS_PER_CLIENT]
        cdef char *src = <char *>cnp.PyArray_DATA(rows)
        cdef list gens = []
        cdef bint cached = k1 is not None and self.seg.p.cache_log2 != 0
        cdef int rc
        if not cnp.PyArray_IS_C_CONTIGUOUS(rows):
            raise ValueError("rows buffer not C-contiguous")
        if n > SHM_MAX_SLOTS_PER_CLIENT:
            raise ValueError("more rows than a client has slots")
        for i in range(n):
            self._slot(c, slots[i])
            idx[i] = at + i if type(at) is int else at[i]
            if idx[i] < 0 or idx[i] >= nrows:
                raise ValueError("rows buffer too small")
        if cached and (len(k1) < nrows or len(k2) < nrows):
            raise ValueError("fewer cache keys than rows")
        for i in range(n):
            ks[i] = slots[i]
        rc = self._begin_all(c, ks, n, gs)
        if rc < 0:
            _begin_failed(rc)
        for i in range(n):
            gens.append(gs[i])
            shm_copy(shm_slot_in(&self.seg, c, ks[i]), src + idx[i] * inb, inb)
            if cached:
                self._cache_as(c, ks[i], k1[idx[i]], k2[idx[i]], hashed)
        # Copy everything first, then publish in a tight loop: an evaluator
        # scanning meanwhile then rarely splits the rows over two batches.
        # (A slot reclaimed meanwhile is not published; its wait says so.)
        for i in range(n):
            shm_slot_publish(&self.seg, c, ks[i], gs[i])
        with nogil:
            shm_notify_evaluator(&self.seg, <uint32_t>n)
        return gens

    def begin(self, uint32_t c, uint32_t k):
        """FREE -> WRITING for this process (post() begins, copies and
        publishes); returns the slot's generation.  For tests and tools."""
        self._slot(c, k)
        return self._begin(c, k)

    def abort(self, uint32_t c, uint32_t k, uint32_t gen):
        """WRITING -> FREE of a slot begun (generation gen) and never
        published; False when it was not (shm_slot_abort).  For tests and
        tools."""
        self._slot(c, k)
        return shm_slot_abort(&self.seg, c, k, gen) == SHM_OK

    def wait(self, uint32_t c, uint32_t k, uint32_t gen, uint64_t spin_ns, uint64_t timeout_ns,
             uint32_t ncpu):
        """Waits for slot (c, k), begun with generation gen, to finish,
        spinning first as the spin rule says (plain while the attached clients
        plus the evaluator fit on the cores, yielding when they are one
        more).  Returns DONE, FAILED, TIMEOUT, CLOSED or STALE."""
        self._slot(c, k)
        return self._wait(c, k, gen, spin_ns, timeout_ns, ncpu)

    def client_spin(self, uint64_t spin_ns, uint32_t ncpu):
        """_spin, the budget a client's wait uses now, for tests."""
        return self._spin(spin_ns, ncpu)

    cdef inline uint64_t _spin(self, uint64_t spin_ns, uint32_t ncpu) noexcept nogil:
        """The client spin budget now (ring/wait.h, shm_client_spin): none
        when the attached clients outnumber the CPUs, a yielding spin when
        the evaluator is the one process more than CPUs, counting at least
        as many processes as the crowding the evaluator's tuner published
        (docs/protocol.md, Waiting)."""
        return shm_client_spin(spin_ns, shm_n_attached(&self.seg), shm_crowding(&self.seg),
                               ncpu)

    cdef int _wait(self, uint32_t c, uint32_t k, uint32_t gen, uint64_t spin_ns,
                   uint64_t timeout_ns, uint32_t ncpu) noexcept:
        cdef int rc
        cdef shm_ticker *t = self._ticker_for(c, timeout_ns)
        spin_ns = self._spin(spin_ns, ncpu)
        if shm_only_python_thread():  # nobody else wants the GIL: keep it
            return shm_slot_wait_ticked(&self.seg, c, k, gen, spin_ns, timeout_ns, t)
        with nogil:
            rc = shm_slot_wait_ticked(&self.seg, c, k, gen, spin_ns, timeout_ns, t)
        return rc

    def wait_any(self, uint32_t c, object ks, object gens, uint64_t spin_ns,
                 uint64_t timeout_ns, uint32_t ncpu):
        """Waits until any of slots ks of client c (begun with generations
        gens) is answered or reclaimed: returns (i, DONE / FAILED / STALE)
        for the first such ks[i], or (len(ks), TIMEOUT / CLOSED).  Spins
        as wait() does; one sleep covers every slot."""
        cdef uint32_t kk[SHM_MAX_SLOTS_PER_CLIENT]
        cdef uint32_t gg[SHM_MAX_SLOTS_PER_CLIENT]
        cdef Py_ssize_t i, n = len(ks)
        cdef uint32_t which = 0
        cdef int rc
        cdef shm_ticker *t
        if n == 0 or n > SHM_MAX_SLOTS_PER_CLIENT or len(gens) != n:
            raise ValueError(f"wait_any: 1 to {SHM_MAX_SLOTS_PER_CLIENT} slots, "
                             "with one generation each")
        for i in range(n):
            kk[i] = ks[i]
            gg[i] = gens[i]
            self._slot(c, kk[i])
        t = self._ticker_for(c, timeout_ns)
        spin_ns = self._spin(spin_ns, ncpu)
        if shm_only_python_thread():
            rc = shm_slots_wait_any(&self.seg, c, kk, gg, <uint32_t>n, spin_ns, timeout_ns, t,
                                    &which)
        else:
            with nogil:
                rc = shm_slots_wait_any(&self.seg, c, kk, gg, <uint32_t>n, spin_ns, timeout_ns,
                                        t, &which)
        return which, rc

    def fetch(self, uint32_t c, uint32_t k, uint32_t gen, list dst, Py_ssize_t row,
              Py_ssize_t method=0):
        """Copies a finished slot's outputs (those of the request's method,
        by index) into dst[j][row] and frees the slot.  Returns the model
        version (DONE), the error text as str (FAILED), or STALE when the
        slot was reclaimed (nothing is delivered)."""
        cdef uint64_t version = 0
        self._slot(c, k)
        return self._fetched(self._fetch(self.layouts[method], c, k, gen, dst, row, False,
                                         &version), version)

    def answer(self, uint32_t c, uint32_t k, uint32_t gen, list dst, Py_ssize_t row,
               uint64_t spin_ns, uint64_t timeout_ns, uint32_t ncpu):
        """wait() then fetch() in one call (the hot path).  Returns the model
        version (>= 0), the error text (str), or TIMEOUT / CLOSED / STALE
        (< 0); after TIMEOUT and CLOSED the slot is still in flight."""
        cdef int rc
        cdef uint64_t version = 0
        self._slot(c, k)
        rc = self._wait(c, k, gen, spin_ns, timeout_ns, ncpu)
        if rc < 0:
            return rc
        return self._fetched(self._fetch(self.layouts[0], c, k, gen, dst, row, False, &version),
                             version)

    cdef object _fetched(self, int rc, uint64_t version):
        """What fetch() returns for _fetch's status rc."""
        if rc == SLOT_DONE:
            return version
        if rc == SLOT_FAILED:
            return self._take_error()
        return rc

    cdef int _fetch(self, Layout lay, uint32_t c, uint32_t k, uint32_t gen, list dst,
                    Py_ssize_t row, bint trusted, uint64_t *version) except -1000:
        """Copies out the answer of the request begun with generation gen and
        releases the slot.  Returns DONE (its model version in version),
        FAILED (its batch's error text for _take_error), or STALE, and
        nothing delivered, when the slot was reclaimed before or during the
        copy: the release validates the copy (shm_slot_release).  No boxed
        value per answer.  lay: the request's method; trusted: dst are
        arrays of its declared outputs (ClientPort made them), so their size
        needs no check."""
        cdef uint32_t st, w
        cdef int rc
        cdef shm_slot_meta *m
        cdef char *out
        w = shm_slot_peek(&self.seg, c, k)
        if w >> SLOT_GEN_SHIFT != gen:
            return SHM_STALE  # not worth a copy
        st = w & SLOT_STATE_MASK
        m = shm_slot_meta_at(&self.seg, c, k)
        out = shm_slot_out(&self.seg, c, k)
        if st == SLOT_DONE:
            if not trusted:
                self._check_dst(lay, dst, row)
            self._deliver(lay, out, dst, row)
            version[0] = m.model_version
        elif st == SLOT_FAILED:
            self.error_text = out[:min(m.err_len, self.seg.l.out_area)].decode("utf-8", "replace")
        else:
            _raise_status(SHM_E_STATE, "fetch")
        rc = shm_slot_release(&self.seg, c, k, gen)
        if rc < 0:
            self.error_text = None
            if rc == SHM_STALE:
                return SHM_STALE  # reclaimed during the copy: the copy is not ours
            _raise_status(rc, "fetch")
        if st == SLOT_DONE:
            # The copy is validated: ours, whole, and of this version.
            if version[0] > self.seen_version:
                self.seen_version = version[0]
            if self.ck1[k]:
                self._cache_put(lay, c, self.ck1[k], self.ck2[k], version[0], dst, row)
        return st

    cdef inline object _take_error(self):
        """The error text of the FAILED answer _fetch has just returned,
        taken: the caller reads it before any Python code runs."""
        cdef object text = self.error_text
        self.error_text = None
        return text

    def release(self, uint32_t c, uint32_t k, uint32_t gen):
        """Frees a finished slot begun with generation gen without reading
        it (abandoned requests).  Returns 0; STALE, the slot was reclaimed
        and is not ours any more; or E_STATE, still in flight."""
        self._slot(c, k)
        return shm_slot_release(&self.seg, c, k, gen)

    def slot_state(self, uint32_t c, uint32_t k):
        """(state, waiter bit, generation) of a slot, for tests and debugging."""
        self._slot(c, k)
        cdef uint32_t w = shm_slot_peek(&self.seg, c, k)
        return w & SLOT_STATE_MASK, bool(w & SLOT_WAITER), w >> 8

    # ------------------------------------------------------------- evaluator
    def set_serving(self, uint32_t r, int32_t pid, uint64_t starttime, str device=""):
        """Replica r (process pid, its start time, on `device`) serves;
        returns the evaluator's state."""
        self._replica(r)
        cdef bytes dev = device.encode("utf-8")[:SHM_DEVICE_MAX - 1]
        return shm_set_serving(&self.seg, r, pid, starttime, dev)

    def close_and_wake(self, uint32_t reason, int32_t detail=0):
        """Records why serving stopped (STOP_*; the first reason recorded
        wins), stores the final state it implies (CLOSED_STATE for
        STOP_CLOSED, else DIED) and wakes every waiting client."""
        with nogil:
            shm_close_and_wake(&self.seg, reason, detail)

    def stop_reason(self):
        """(STOP_*, detail): why the evaluator stopped, once ev_state() is
        final; detail is an exit code (or minus a signal) for STOP_EXITED."""
        cdef int32_t detail
        cdef uint32_t reason = shm_stop_reason(&self.seg, &detail)
        return reason, detail

    def clients(self):
        """[(index, pid, starttime, pid_ns, detached)] of every claimed entry."""
        cdef uint32_t c, det
        cdef uint64_t st, pid_ns
        cdef int32_t pid
        out = []
        for c in range(shm_clients_hwm(&self.seg)):
            pid = shm_client_info(&self.seg, c, &st, &pid_ns, &det)
            if pid != 0:
                out.append((c, pid, st, pid_ns, bool(det)))
        return out

    def client_requests(self):
        """{index: requests published so far} of every claimed entry
        (statistics: per-client request rates)."""
        cdef uint32_t c, det
        cdef uint64_t st, pid_ns
        out = {}
        for c in range(shm_clients_hwm(&self.seg)):
            if shm_client_info(&self.seg, c, &st, &pid_ns, &det) != 0:
                out[c] = shm_client_requests(&self.seg, c)
        return out

    # ------------------------------------------------------------ the cache
    @property
    def cache_entries(self):
        """Entries of the evaluation cache (0: none)."""
        return shm_cache_entries(&self.seg)

    def cache_keys(self, cnp.ndarray rows):
        """(key, key2): the cache keys of each row of rows (uint64 arrays),
        the two hashes of its bytes a client looks it up by."""
        cdef uint64_t inb = self.seg.p.in_bytes
        cdef Py_ssize_t i, n
        cdef const char *src
        if not cnp.PyArray_IS_C_CONTIGUOUS(rows) or cnp.PyArray_NBYTES(rows) % inb:
            raise ValueError("rows must be C-contiguous rows of in_bytes each")
        n = cnp.PyArray_NBYTES(rows) // inb
        k1 = np.empty(n, np.uint64)
        k2 = np.empty(n, np.uint64)
        cdef uint64_t[::1] a = k1
        cdef uint64_t[::1] b = k2
        src = <const char *>cnp.PyArray_DATA(rows)
        for i in range(n):
            shm_hash_state(src + i * inb, inb, &a[i], &b[i])
        return k1, k2

    def set_key_scheme(self, bytes scheme):
        """The caller's cache keys of this process (key=, keys=) are of the
        scheme these bytes name: a hit needs the same scheme as the store
        (it is hashed into the entry's second key word).  b"": the default
        scheme, shared by every process that names none."""
        cdef uint64_t k1 = 0, k2 = 0
        if scheme:
            shm_hash_state(scheme, len(scheme), &k1, &k2)
        self.key_tag = k1

    def cache_lookup(self, uint32_t c, cnp.ndarray rows, object keys, list dst,
                     object versions):
        """Looks every row of rows up in the cache for client c (by keys[i],
        the caller's key, or by the hashes of its bytes when keys is None).
        A hit's outputs go to row i of the arrays dst (and its model version
        to versions[i] when versions is not None).  Returns (misses, k1, k2):
        the rows not answered, and every row's cache keys (uint64 arrays),
        for post() to cache their answers."""
        cdef uint64_t inb = self.seg.p.in_bytes
        cdef Py_ssize_t i, n
        cdef uint64_t v = 0
        cdef const char *src
        cdef Layout lay = self.layouts[0]
        self._client(c)
        self._check_dst(lay, dst, 0)
        if not cnp.PyArray_IS_C_CONTIGUOUS(rows) or cnp.PyArray_NBYTES(rows) % inb:
            raise ValueError("rows must be C-contiguous rows of in_bytes each")
        n = cnp.PyArray_NBYTES(rows) // inb
        if n:
            self._check_dst(lay, dst, n - 1)
        if keys is not None and len(keys) != n:
            raise ValueError(f"{len(keys)} keys for {n} states")
        k1 = np.zeros(n, np.uint64)
        k2 = np.zeros(n, np.uint64)
        cdef uint64_t[::1] a = k1
        cdef uint64_t[::1] b = k2
        misses = []
        if not self.seg.p.cache_log2:
            return list(range(n)), k1, k2
        src = <const char *>cnp.PyArray_DATA(rows)
        for i in range(n):
            if self._cache_get(lay, c, src + i * inb, None if keys is None else keys[i], dst,
                               i, &a[i], &b[i], &v):
                if versions is not None:
                    versions[i] = v
            else:
                misses.append(i)
        return misses, k1, k2

    def cache_version(self):
        """The oldest model version a cache lookup accepts now."""
        return shm_cache_version(&self.seg)

    def cache_set_version(self, uint64_t version):
        """From now on no lookup accepts an answer older than version (the
        owner calls it once new weights serve)."""
        shm_cache_set_version(&self.seg, version)

    def cache_stats(self):
        """The cache's counters: {"hits", "misses", "stale", "replaced"} in
        total (reclaimed clients' included), and per live client
        {index: (hits, misses, stale, replaced)}."""
        cdef uint32_t c, det
        cdef uint64_t st, pid_ns
        cdef uint64_t x[4]
        names = ("hits", "misses", "stale", "replaced")
        total = {n: shm_stat_get(&self.seg, STAT_INDEX["cache_" + n]) for n in names}
        per = {}
        for c in range(shm_clients_hwm(&self.seg)):
            if shm_client_info(&self.seg, c, &st, &pid_ns, &det) != 0:
                shm_client_cache_stats(&self.seg, c, x)
                per[c] = (x[0], x[1], x[2], x[3])
                for i in range(4):
                    total[names[i]] += x[i]
        return total, per

    def cache_census(self, uint64_t sample=0):
        """(scanned, held, old): of `sample` entries spread over the table
        (0: all), how many hold an answer, and how many of those are older
        than cache_version()."""
        cdef uint64_t scanned = 0, held = 0, old = 0
        if self.seg.p.cache_log2:
            with nogil:
                shm_cache_census(&self.seg, sample, &scanned, &held, &old)
        return scanned, held, old

    cdef int _check_dst(self, Layout lay, list dst, Py_ssize_t row) except -1:
        """dst can take an answer in row `row`: one C-contiguous array per
        output of lay, big enough."""
        cdef uint32_t j
        cdef cnp.ndarray a
        if len(dst) != lay.n_out:
            raise ValueError("wrong number of output buffers")
        for j in range(lay.n_out):
            a = dst[j]
            if not cnp.PyArray_IS_C_CONTIGUOUS(a) or \
                    <uint64_t>cnp.PyArray_NBYTES(a) < (row + 1) * lay.out_nbytes[j]:
                raise ValueError("output buffer too small or not C-contiguous")
        return 0

    cdef void _deliver(self, Layout lay, const char *src, list dst, Py_ssize_t row) noexcept:
        """Copies one answer of lay's method (output-area bytes at src) into
        row `row` of the arrays dst (checked by the caller, or made by
        ClientPort: one array per output, big enough)."""
        cdef uint32_t j
        for j in range(lay.n_out):
            memcpy(_array_bytes(PyList_GET_ITEM(dst, j)) + row * lay.out_nbytes[j],
                   src + lay.out_off[j], lay.out_nbytes[j])

    cdef int _cache_get(self, Layout lay, uint32_t c, const char *state, object key, list dst,
                        Py_ssize_t row, uint64_t *k1, uint64_t *k2,
                        uint64_t *version) except -1:
        """Looks one request of lay's method up (by key, the caller's, or by
        the hashes of its bytes when key is None; a request's bytes begin
        with its method's index when there are several) and on a hit
        delivers its answer into row `row` of dst and returns 1; else 0.
        Either way k1, k2 are set to the request's keys.  The GIL is held
        (self.cbuf is shared)."""
        cdef uint64_t v = 0, floor
        if key is None:
            shm_hash_state(state, self.seg.p.in_bytes, k1, k2)
        else:
            k1[0] = PyLong_AsUnsignedLongLongMask(key)
            if k1[0] == 0:
                k1[0] = 0x9E3779B97F4A7C15  # 0 marks an empty entry
            # The key scheme's word (0 by default), never a hash's key2 but by
            # chance (hashes' are never 0): the key spaces stay apart.  Each
            # method's keys are apart too (an odd multiple of its index).
            k2[0] = self.key_tag + lay.index * <uint64_t>0x9E3779B97F4A7C15
        floor = shm_cache_version(&self.seg)
        if floor < self.seen_version:
            floor = self.seen_version
        if shm_cache_get(&self.seg, c, k1[0], k2[0], floor, self.cbuf, &v) != SHM_CACHE_HIT:
            return 0
        self._deliver(lay, <const char *>self.cbuf, dst, row)
        version[0] = v
        if v > self.seen_version:
            self.seen_version = v
        return 1

    cdef void _cache_put(self, Layout lay, uint32_t c, uint64_t k1, uint64_t k2,
                         uint64_t version, list dst, Py_ssize_t row):
        """Caches the answer (of lay's method) in row `row` of dst (an answer
        this process copied out and validated) under (k1, k2).  The GIL is
        held."""
        cdef uint32_t j
        cdef char *buf = <char *>self.cbuf
        memset(buf, 0, self.seg.l.cache_words * 8)
        for j in range(lay.n_out):
            memcpy(buf + lay.out_off[j],
                   <char *>cnp.PyArray_DATA(<cnp.ndarray>dst[j]) + row * lay.out_nbytes[j],
                   lay.out_nbytes[j])
        shm_cache_put(&self.seg, c, k1, k2, version, self.cbuf)

    def reclaim(self, uint32_t c):
        """Evaluator only, with no batch in flight: frees a dead or detached
        client's entry and slots; returns how many slots were stranded
        mid-write, or None (nothing changed) when a slot of the entry is in
        a batch: the core refuses, since completing that batch relies on no
        reclaim happening meanwhile."""
        cdef int rc
        self._client(c)
        rc = shm_client_reclaim(&self.seg, c)
        return None if rc == SHM_E_STATE else rc

    def request_control(self):
        """Controller side: asks the serving loop to handle one control
        request between batches; returns its ticket (1, 2, ...)."""
        return shm_request_control(&self.seg)

    def control_pending(self, uint32_t r=0):
        """(requested, handled by replica r) ticket counters."""
        cdef uint32_t done
        self._replica(r)
        cdef uint32_t req = shm_control_pending(&self.seg, r, &done)
        return req, done

    def control_done(self, uint32_t r, uint32_t ticket):
        """Replica r has handled the control requests up to ticket."""
        self._replica(r)
        shm_control_done(&self.seg, r, ticket)

    def stat_put(self, name, uint64_t v):
        shm_stat_put(&self.seg, STAT_INDEX[name], v)

    def stat_inc(self, name, uint64_t v):
        shm_stat_inc(&self.seg, STAT_INDEX[name], v)
