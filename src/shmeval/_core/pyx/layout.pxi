# Included by shmeval/_ring.pyx: Layout, one method's rows in C.


cdef class Layout:
    """One method of a spec (``spec.MethodSpec``) as the request path reads
    it in C: where each output lies in a result row, its rank, type and
    shape (the client's copy out and the cache, the server's checks and
    scatter), and the method's index, the header of its requests."""

    def __cinit__(self, object method, uint64_t out_bytes):
        cdef Py_ssize_t j, i, at = 0
        cdef tuple inputs = tuple(method.inputs)
        cdef Py_ssize_t nin = len(inputs)
        cdef Py_ssize_t total_in = sum(len(f.shape) for f in inputs)
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
        # Its inputs, for packing named inputs into request rows in C.
        self.in_off = <uint64_t *>malloc(sizeof(uint64_t) * max(1, nin))
        self.in_nbytes = <uint64_t *>malloc(sizeof(uint64_t) * max(1, nin))
        self.in_nd = <int *>malloc(sizeof(int) * max(1, nin))
        self.in_at = <Py_ssize_t *>malloc(sizeof(Py_ssize_t) * max(1, nin))
        self.in_shape = <cnp.npy_intp *>malloc(sizeof(cnp.npy_intp) * max(1, total_in))
        self.in_type = <int *>malloc(sizeof(int) * max(1, nin))
        if not (self.in_off and self.in_nbytes and self.in_nd and self.in_at and self.in_shape
                and self.in_type):
            raise MemoryError()
        at = 0
        for j, f in enumerate(inputs):
            self.in_off[j] = f.offset
            self.in_nbytes[j] = f.nbytes
            self.in_nd[j] = len(f.shape)
            self.in_type[j] = f.dtype.num
            self.in_at[j] = at
            for i in range(len(f.shape)):
                self.in_shape[at + i] = f.shape[i]
            at += len(f.shape)
        self.in_names = tuple(f.name for f in inputs)
        self.in_dtypes = tuple(f.dtype for f in inputs)
        self.in_scalars = tuple(f.dtype.type for f in inputs)
        self.in_native = all(f.dtype.isnative and f.dtype.num < cnp.NPY_NTYPES_LEGACY and
                             len(f.shape) <= 32 for f in inputs)
        self.n_in = nin

    def __dealloc__(self):
        free(self.out_off)
        free(self.out_nbytes)
        free(self.out_nd)
        free(self.out_type)
        free(self.out_at)
        free(self.out_shape)
        free(self.in_off)
        free(self.in_nbytes)
        free(self.in_nd)
        free(self.in_at)
        free(self.in_shape)
        free(self.in_type)

    cdef inline cnp.npy_intp *_out_dims(self, Py_ssize_t j) noexcept:
        """Output j's shape (out_nd[j] dimensions), in C."""
        return &self.out_shape[self.out_at[j]]

    @property
    def name(self):
        return self.method.name

    cdef void _zero_gaps(self, char *row, uint64_t row_bytes) noexcept:
        """Zeroes the bytes of a request row of row_bytes that none of this
        method's inputs fills (its inputs lie in order, each after the
        last)."""
        cdef uint64_t at = 0
        cdef Py_ssize_t j
        for j in range(self.n_in):
            if self.in_off[j] > at:
                memset(row + at, 0, self.in_off[j] - at)
            at = self.in_off[j] + self.in_nbytes[j]
        if row_bytes > at:
            memset(row + at, 0, row_bytes - at)

    cdef dict _unpack(self, const char *rows, uint64_t row_bytes, Py_ssize_t n):
        """The named inputs of n request rows (row_bytes apart, from rows):
        {name: a new C-contiguous array (n, *shape) of its dtype}, copied in
        C; what the method's function is called with (in_native)."""
        cdef cnp.npy_intp dims[33]
        cdef Py_ssize_t j, d, i
        cdef cnp.ndarray a
        cdef char *dst
        cdef dict out = {}
        dims[0] = n
        for j in range(self.n_in):
            for d in range(self.in_nd[j]):
                dims[d + 1] = self.in_shape[self.in_at[j] + d]
            a = cnp.PyArray_EMPTY(self.in_nd[j] + 1, dims, self.in_type[j], 0)
            dst = <char *>cnp.PyArray_DATA(a)
            for i in range(n):
                memcpy(dst + i * self.in_nbytes[j], rows + i * row_bytes + self.in_off[j],
                       self.in_nbytes[j])
            out[self.in_names[j]] = a
        return out
