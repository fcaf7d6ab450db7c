# Included by shmeval/_ring.pyx: Layout, one method's rows in C.


cdef class Layout:
    """One method of a spec (``spec.MethodSpec``) as the request path reads
    it in C: where each output lies in a result row, its rank, type and
    shape (the client's copy out and the cache, the server's checks and
    scatter), and the method's index, the header of its requests."""

    def __cinit__(self, object method, uint64_t out_bytes):
        cdef Py_ssize_t j, i, at = 0
        cdef tuple outputs = tuple(method.outputs)
        cdef Py_ssize_t n = len(outputs)
        cdef Py_ssize_t total = sum(len(o.shape) for o in outputs)
        self.method = method
        self.index = method.index
        self.out_off = <uint64_t *>malloc(sizeof(uint64_t) * max(1, n))
        self.out_nbytes = <uint64_t *>malloc(sizeof(uint64_t) * max(1, n))
        self.out_nd = <int *>malloc(sizeof(int) * max(1, n))
        self.out_type = <int *>malloc(sizeof(int) * max(1, n))
        self.out_at = <Py_ssize_t *>malloc(sizeof(Py_ssize_t) * max(1, n))
        self.out_shape = <cnp.npy_intp *>malloc(sizeof(cnp.npy_intp) * max(1, total))
        if not (self.out_off and self.out_nbytes and self.out_nd and self.out_type and
                self.out_at and self.out_shape):
            raise MemoryError()
        for j, o in enumerate(outputs):
            if o.offset + o.nbytes > out_bytes:
                raise ValueError("output field exceeds the result row")
            self.out_off[j] = o.offset
            self.out_nbytes[j] = o.nbytes
            self.out_nd[j] = len(o.shape)
            self.out_type[j] = o.dtype.num
            self.out_at[j] = at
            for i in range(len(o.shape)):
                self.out_shape[at + i] = o.shape[i]
            at += len(o.shape)
        self.out_names = tuple(o.name for o in outputs)
        self.out_float = [o.dtype.kind in "fc" for o in outputs]
        self.out_native = all(o.dtype.isnative and o.dtype.num < cnp.NPY_NTYPES_LEGACY and
                              len(o.shape) <= 32 for o in outputs)
        self.n_out = n

    def __dealloc__(self):
        free(self.out_off)
        free(self.out_nbytes)
        free(self.out_nd)
        free(self.out_type)
        free(self.out_at)
        free(self.out_shape)

    cdef inline cnp.npy_intp *_out_dims(self, Py_ssize_t j) noexcept:
        """Output j's shape (out_nd[j] dimensions), in C."""
        return &self.out_shape[self.out_at[j]]

    @property
    def name(self):
        return self.method.name
