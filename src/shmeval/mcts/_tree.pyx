# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The C core of :mod:`shmeval.mcts`: a search tree whose statistics live in
flat C arrays, and the two steps of a batched simulation (select one leaf
per tree; expand the evaluated leaves and back their values up).

The game stays in Python: the tree keeps each node's state (any Python
object) and calls the game's ``play``, ``terminal_value`` and
``legal_moves``; only the walk down the tree, the PUCT arithmetic and the
backup run in C.  See :mod:`shmeval.mcts` for the sign convention and the
selection formula, which this module implements.
"""
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from libc.math cimport INFINITY, isfinite, sqrt

import numpy as np

ctypedef long long i64


cdef inline Py_ssize_t _capacity(Py_ssize_t cap, Py_ssize_t need) noexcept:
    """The capacity to grow ``cap`` to for ``need`` items (doubling from 16)."""
    while cap < need:
        cap = 2 * cap if cap else 16
    return cap


cdef int _grow(void **p, Py_ssize_t cap, size_t item) except -1:
    """Reallocates ``*p`` to ``cap`` items of ``item`` bytes."""
    cdef void *q = PyMem_Realloc(p[0], <size_t>cap * item)
    if q == NULL:
        raise MemoryError()
    p[0] = q
    return 0


cdef class Tree:
    """The search tree of one game (see :mod:`shmeval.mcts`).

    Nodes are numbered in order of creation; ``state[i]`` and ``term[i]``
    are node ``i``'s position and terminal value (from the view of the
    player to move, ``None`` while the game goes on).  A node's edges (its
    legal actions with their priors, visit counts, value sums and child
    ids) are created together when the node is expanded; a child node is
    created when its edge is first selected.  ``root`` is the current
    root; :meth:`advance` moves it and keeps the child's subtree.
    """

    cdef:
        # per node
        Py_ssize_t nn, ncap
        Py_ssize_t *first       # first edge, -1 until expanded
        int *deg                # number of edges
        i64 *visits             # sum of the node's edge visit counts
        # per edge
        Py_ssize_t ne, ecap
        int *act
        double *prior
        i64 *cnt
        double *w
        Py_ssize_t *child       # -1 until created
        # the path of the leaf awaiting evaluation
        Py_ssize_t plen, pcap
        Py_ssize_t *pnode
        int *pedge
        Py_ssize_t leaf
        # root noise
        Py_ssize_t noised
        list clean
        readonly list state
        readonly list term
        readonly Py_ssize_t root

    def __cinit__(self, game, state):
        self.state = []
        self.term = []
        self.leaf = -1
        self.noised = -1
        self.root = self._add(state, game.terminal_value(state))

    def __dealloc__(self):
        PyMem_Free(self.first)
        PyMem_Free(self.deg)
        PyMem_Free(self.visits)
        PyMem_Free(self.act)
        PyMem_Free(self.prior)
        PyMem_Free(self.cnt)
        PyMem_Free(self.w)
        PyMem_Free(self.child)
        PyMem_Free(self.pnode)
        PyMem_Free(self.pedge)

    cdef Py_ssize_t _add(self, object s, object tv) except -1:
        cdef Py_ssize_t i = self.nn, c
        if tv is not None:
            tv = float(tv)
        if i == self.ncap:
            c = _capacity(self.ncap, i + 1)
            _grow(<void **>&self.first, c, sizeof(Py_ssize_t))
            _grow(<void **>&self.deg, c, sizeof(int))
            _grow(<void **>&self.visits, c, sizeof(i64))
            self.ncap = c
        self.state.append(s)
        self.term.append(tv)
        self.first[i] = -1
        self.deg[i] = 0
        self.visits[i] = 0
        self.nn = i + 1
        return i

    cdef Py_ssize_t _child(self, Py_ssize_t node, Py_ssize_t e, object play,
                           object terminal_value) except -1:
        """Creates the child of ``node`` reached by its edge ``e``."""
        s = play(self.state[node], self.act[e])
        self.child[e] = self._add(s, terminal_value(s))
        return self.child[e]

    cdef int _reserve_edges(self, Py_ssize_t m) except -1:
        cdef Py_ssize_t need = self.ne + m, c
        if need <= self.ecap:
            return 0
        c = _capacity(self.ecap, need)
        _grow(<void **>&self.act, c, sizeof(int))
        _grow(<void **>&self.prior, c, sizeof(double))
        _grow(<void **>&self.cnt, c, sizeof(i64))
        _grow(<void **>&self.w, c, sizeof(double))
        _grow(<void **>&self.child, c, sizeof(Py_ssize_t))
        self.ecap = c
        return 0

    cdef int _push(self, Py_ssize_t node, int edge) except -1:
        cdef Py_ssize_t c
        if self.plen == self.pcap:
            c = _capacity(self.pcap, self.plen + 1)
            _grow(<void **>&self.pnode, c, sizeof(Py_ssize_t))
            _grow(<void **>&self.pedge, c, sizeof(int))
            self.pcap = c
        self.pnode[self.plen] = node
        self.pedge[self.plen] = edge
        self.plen += 1
        return 0

    cdef int _expand(self, Py_ssize_t node, object acts, const double *row,
                     Py_ssize_t n_actions) except -1:
        """Creates ``node``'s edges for the legal actions ``acts`` with the
        priors ``row[a]`` renormalised (uniform when they are all 0)."""
        cdef Py_ssize_t m = len(acts), i, f
        cdef int a
        cdef double p, total = 0.0
        cdef bint bad = False
        if m == 0:
            raise ValueError(f"legal_moves returned no moves for a state whose "
                             f"terminal_value is None: {self.state[node]!r}")
        if m > 2147483647:
            raise ValueError("too many legal moves")
        self._reserve_edges(m)
        f = self.ne
        for i in range(m):
            a = acts[i]
            if not 0 <= a < n_actions:
                raise ValueError(f"legal move {a} is outside 0..{n_actions - 1}")
            p = row[a]
            if not (p >= 0.0 and isfinite(p)):
                bad = True
            self.act[f + i] = a
            self.prior[f + i] = p
            total += p
        if bad:
            raise ValueError(f"policy must hold finite probabilities >= 0 (logits? use "
                             f"evaluator_fn(..., logits=True)); got "
                             f"{[row[j] for j in range(n_actions)]}")
        for i in range(m):
            if total > 0.0:
                self.prior[f + i] /= total
            else:                           # all legal moves got 0: uniform
                self.prior[f + i] = 1.0 / m
            self.cnt[f + i] = 0
            self.w[f + i] = 0.0
            self.child[f + i] = -1
        self.ne = f + m
        self.first[node] = f
        self.deg[node] = <int>m
        return 0

    cdef Py_ssize_t _descend(self, object play, object terminal_value, double c_puct,
                             double fpu) except -1:
        """Walks from the root by PUCT to a leaf (creating it when its edge
        was never taken), records the path, returns the leaf."""
        cdef Py_ssize_t node = self.root, f, e, ch
        cdef int i, bi, m
        cdef double sq, best, u, p
        cdef i64 k
        self.plen = 0
        if self.first[node] < 0:
            raise ValueError("the root is not expanded")
        while True:
            f = self.first[node]
            m = self.deg[node]
            sq = c_puct * sqrt(<double>(self.visits[node] + 1))
            best = -INFINITY
            bi = 0
            for i in range(m):
                e = f + i
                k = self.cnt[e]
                p = self.prior[e]
                if k:
                    u = self.w[e] / k + sq * p / (k + 1)
                else:
                    u = fpu + sq * p
                if u > best:
                    best = u
                    bi = i
            self._push(node, bi)
            e = f + bi
            ch = self.child[e]
            if ch < 0:
                return self._child(node, e, play, terminal_value)
            if self.first[ch] < 0:          # terminal, or left unevaluated by an error
                return ch
            node = ch

    cdef void _backup(self, double leaf_value) noexcept:
        cdef Py_ssize_t j, node, e
        cdef double v = -leaf_value
        for j in range(self.plen - 1, -1, -1):
            node = self.pnode[j]
            e = self.first[node] + self.pedge[j]
            self.cnt[e] += 1
            self.w[e] += v
            self.visits[node] += 1
            v = -v
        self.plen = 0

    cdef Py_ssize_t _check(self, Py_ssize_t node) except -1:
        if not 0 <= node < self.nn:
            raise IndexError(f"node {node} out of range 0..{self.nn - 1}")
        return node

    # -- Python interface ----------------------------------------------------

    def __len__(self):
        """Number of nodes stored (including abandoned ones)."""
        return self.nn

    @property
    def root_state(self):
        return self.state[self.root]

    def is_expanded(self, Py_ssize_t node):
        """Whether ``node`` has its edges (was evaluated)."""
        return self.first[self._check(node)] >= 0

    def edges(self, Py_ssize_t node):
        """``node``'s edges as lists: ``(actions, priors, visit counts,
        value sums, child ids)`` (value sums from the view of the player
        to move at ``node``; child -1 = not created yet); all empty while
        the node is unexpanded."""
        cdef Py_ssize_t f = self.first[self._check(node)], i
        cdef int m = self.deg[node]
        if f < 0:
            return [], [], [], [], []
        return ([self.act[f + i] for i in range(m)], [self.prior[f + i] for i in range(m)],
                [self.cnt[f + i] for i in range(m)], [self.w[f + i] for i in range(m)],
                [self.child[f + i] for i in range(m)])

    def actions(self, Py_ssize_t node):
        """``node``'s legal actions (empty while it is unexpanded)."""
        return self.edges(node)[0]

    def priors(self, Py_ssize_t node):
        """``node``'s priors, in the order of :meth:`actions`."""
        return self.edges(node)[1]

    def expand(self, Py_ssize_t node, acts, const double[::1] row not None):
        """Gives the unexpanded ``node`` its edges: the legal actions
        ``acts`` with priors ``row[a]`` renormalised."""
        if self.first[self._check(node)] >= 0:
            raise ValueError(f"node {node} is already expanded")
        self._expand(node, acts, &row[0], row.shape[0])

    def edge_visits(self):
        """Edge visits summed over the whole tree (each simulation adds one
        per edge on its path)."""
        cdef i64 total = 0
        cdef Py_ssize_t i
        for i in range(self.ne):
            total += self.cnt[i]
        return total

    def visit_counts(self, Py_ssize_t n_actions):
        """Root visit counts per action, ``int64 [n_actions]`` (0 for illegal actions)."""
        out = np.zeros(n_actions, dtype=np.int64)
        cdef i64[::1] o = out
        cdef Py_ssize_t f = self.first[self.root], i
        if f >= 0:
            for i in range(self.deg[self.root]):
                if 0 <= self.act[f + i] < n_actions:
                    o[self.act[f + i]] = self.cnt[f + i]
        return out

    def root_q(self, Py_ssize_t n_actions):
        """Root mean values per action from the view of the player to move,
        ``float64 [n_actions]`` (NaN where unvisited or illegal)."""
        out = np.full(n_actions, np.nan)
        cdef double[::1] o = out
        cdef Py_ssize_t f = self.first[self.root], i
        if f >= 0:
            for i in range(self.deg[self.root]):
                if self.cnt[f + i] and 0 <= self.act[f + i] < n_actions:
                    o[self.act[f + i]] = self.w[f + i] / self.cnt[f + i]
        return out

    def advance(self, game, action):
        """Re-roots the tree at the child reached by ``action`` (created if
        needed), keeping that subtree's statistics; ``ValueError`` for an
        action that is not legal at the root."""
        cdef Py_ssize_t r = self.root, f = self.first[r], e = -1, i, ch
        cdef int a = action
        if f >= 0:
            for i in range(self.deg[r]):
                if self.act[f + i] == a:
                    e = f + i
                    break
            if e < 0:
                raise ValueError(f"{a} is not a legal move at the root")
            ch = self.child[e]
            if ch < 0:
                ch = self._child(r, e, game.play, game.terminal_value)
        else:
            s = game.play(self.state[r], a)
            ch = self._add(s, game.terminal_value(s))
        self.clear_noise()
        self.root = ch

    def add_noise(self, eta, double fraction):
        """Mixes ``eta`` (one value per root edge) into the root's clean
        priors: ``(1 - fraction) * p + fraction * eta``; the clean priors
        are kept for :meth:`clear_noise`."""
        cdef Py_ssize_t r = self.root, f = self.first[r], i
        cdef int m = self.deg[r]
        if f < 0:
            raise ValueError("the root is not expanded")
        self.clear_noise()
        if len(eta) != m:
            raise ValueError(f"{len(eta)} noise values for {m} root edges")
        self.clean = [self.prior[f + i] for i in range(m)]
        for i in range(m):
            self.prior[f + i] = (1 - fraction) * self.clean[i] + fraction * eta[i]
        self.noised = r

    def clear_noise(self):
        """Puts the root's clean priors back if noise is mixed in."""
        cdef Py_ssize_t r = self.noised, f, i
        if r >= 0:
            f = self.first[r]
            for i in range(self.deg[r]):
                self.prior[f + i] = self.clean[i]
            self.noised = -1
            self.clean = None


def select_leaves(list trees, play, terminal_value, double c_puct, double fpu):
    """One selection in each tree.  A terminal leaf is backed up at once
    with its game value; the others wait for evaluation.  Returns the
    waiting trees and their leaves' states, in the order of ``trees``."""
    cdef Tree t
    cdef Py_ssize_t leaf
    cdef list waiting = [], states = []
    for t in trees:
        t.leaf = -1
        leaf = t._descend(play, terminal_value, c_puct, fpu)
        tv = t.term[leaf]
        if tv is not None:
            t._backup(tv)
        else:
            t.leaf = leaf
            waiting.append(t)
            states.append(t.state[leaf])
    return waiting, states


def expand_backup(list waiting, legal_moves, const double[:, ::1] policy not None,
                  const double[::1] value not None):
    """Expands the leaf of ``waiting[j]`` with ``policy[j]`` and backs
    ``value[j]`` up its path (``waiting`` from :func:`select_leaves`)."""
    cdef Tree t
    cdef Py_ssize_t j, n = len(waiting)
    if policy.shape[0] != n or value.shape[0] != n:
        raise ValueError(f"{policy.shape[0]} policies and {value.shape[0]} values for {n} leaves")
    for j in range(n):
        t = waiting[j]
        if t.leaf < 0 or t.first[t.leaf] >= 0:
            raise ValueError("a tree without a leaf awaiting evaluation (listed twice?)")
        t._expand(t.leaf, legal_moves(t.state[t.leaf]), &policy[j, 0], policy.shape[1])
        t._backup(value[j])
        t.leaf = -1
