/*
 * test_layout.c -- the segment's layout, shm_init and shm_attach (ring/layout.h).
 */
#include "harness.h"

static void check_layout_numbers(const shm_params *p, const shm_layout *l) {
    uint64_t K = p->slots_per_client;
    CHECK(l->header_bytes >=
          sizeof(shm_header) + sizeof(uint64_t) * ((uint64_t)p->max_batch + 1));
    CHECK_EQU(l->header_bytes % SHM_LINE, 0);
    CHECK_EQU(l->replicas_off, l->header_bytes);
    CHECK(l->servers_off >= l->replicas_off + sizeof(shm_replica) * p->replicas);
    CHECK_EQU(l->servers_off % SHM_LINE, 0);
    CHECK(l->server_stride >=
          sizeof(shm_server_head) + sizeof(shm_taken) * p->max_batch);
    CHECK_EQU(l->server_stride % SHM_LINE, 0);
    CHECK_EQU(l->clients_off, l->servers_off + l->server_stride * p->servers);
    CHECK_EQU(l->client_stride % SHM_LINE, 0);
    CHECK(l->client_stride >= sizeof(shm_client) + 4 * K);
    CHECK_EQU(l->slots_off % 4096, 0);
    CHECK(l->slots_off >= l->clients_off + l->client_stride * p->max_clients);
    CHECK(l->in_off >= sizeof(shm_slot_meta));
    CHECK_EQU(l->in_off % SHM_LINE, 0);
    CHECK(l->out_off >= l->in_off + p->in_bytes);
    CHECK_EQU(l->out_off % SHM_LINE, 0);
    CHECK(l->out_area >= p->out_bytes);
    CHECK(l->out_area >= SHM_ERRMSG_MIN);
    CHECK_EQU(l->out_area % SHM_LINE, 0);
    CHECK(l->slot_stride >= l->out_off + l->out_area);
    CHECK_EQU(l->slot_stride % SHM_LINE, 0);
    uint64_t slots_end = l->slots_off + l->slot_stride * p->max_clients * K;
    CHECK_EQU(l->cache_words * 8, shm_round_up(p->out_bytes, 8));
    CHECK_EQU(l->cache_stride, sizeof(shm_cache_entry) + 8 * l->cache_words);
    if (p->cache_log2) {
        CHECK(l->cache_off >= slots_end);
        CHECK_EQU(l->cache_off % 4096, 0);
        CHECK_EQU(l->total, l->cache_off + (l->cache_stride << p->cache_log2));
    } else {
        CHECK_EQU(l->total, slots_end);
    }
}

/* Address-level facts on a formatted segment. */
static void check_layout_addresses(const shm_params *p) {
    test_seg t;
    seg_make(&t, p);
    shm_seg *s = &t.s;
    uintptr_t base = (uintptr_t)t.mem, end = base + t.size;
    uint32_t K = p->slots_per_client;
    CHECK((uintptr_t)(shm_batch_hist_at(s) + p->max_batch + 1) <=
          base + s->l.replicas_off);
    CHECK((uintptr_t)(shm_replica_at(s, p->replicas - 1) + 1) <=
          base + s->l.servers_off);
    CHECK((uintptr_t)(shm_server_taken(s, p->servers - 1) + p->max_batch) <=
          base + s->l.clients_off);
    CHECK_EQU((uintptr_t)shm_batch_hist_at(s) % 8, 0);
    for (uint32_t c = 0; c < p->max_clients; c++) {
        uintptr_t e = (uintptr_t)shm_client_at(s, c);
        uintptr_t w0 = (uintptr_t)shm_slot_word_at(s, c, 0);
        uintptr_t wend = (uintptr_t)(shm_slot_word_at(s, c, K - 1) + 1);
        uintptr_t next = c + 1 < p->max_clients
                             ? (uintptr_t)shm_client_at(s, c + 1)
                             : base + s->l.slots_off;
        CHECK_EQU(e % SHM_LINE, 0);
        /* the state words start on their own cache line (not the entry's)
         * and end before the next entry's line: no false sharing with the
         * entry fields or with another client's words */
        CHECK_EQU(w0 % SHM_LINE, 0);
        CHECK(w0 >= e + sizeof(shm_client));
        CHECK(wend <= next);
        CHECK_EQU(next % SHM_LINE, 0);
        for (uint32_t k = 0; k < K; k++) {
            CHECK_EQU((uintptr_t)shm_slot_word_at(s, c, k), w0 + 4ull * k);
            uintptr_t d = (uintptr_t)shm_slot_data(s, c, k);
            CHECK_EQU(d % SHM_LINE, 0);
            CHECK_EQU((uintptr_t)shm_slot_in(s, c, k) % SHM_LINE, 0);
            CHECK_EQU((uintptr_t)shm_slot_out(s, c, k) % SHM_LINE, 0);
            CHECK(d >= base + s->l.slots_off);
            CHECK(d + s->l.slot_stride <= end);
            CHECK_EQU((uintptr_t)shm_slot_meta_at(s, c, k), d);
            CHECK((uintptr_t)shm_slot_out(s, c, k) + s->l.out_area <=
                  d + s->l.slot_stride);
            /* slot data areas are consecutive and disjoint */
            if (k + 1 < K)
                CHECK_EQU((uintptr_t)shm_slot_data(s, c, k + 1),
                          d + s->l.slot_stride);
        }
        /* every state word is FREE, generation 0 after init */
        for (uint32_t k = 0; k < K; k++) CHECK_EQU(word_of(s, c, k), 0);
    }
    CHECK_EQU((uintptr_t)shm_slot_data(s, p->max_clients - 1, K - 1) +
                  s->l.slot_stride,
              p->cache_log2 ? base + s->l.slots_off + s->l.slot_stride *
                                  p->max_clients * K
                            : end);
    if (p->cache_log2) {
        uint64_t n = shm_cache_entries(s);
        CHECK((uintptr_t)shm_cache_entry_at(s, 0) >=
              (uintptr_t)shm_slot_data(s, p->max_clients - 1, K - 1) +
                  s->l.slot_stride);
        CHECK_EQU((uintptr_t)shm_cache_entry_at(s, n - 1) + s->l.cache_stride, end);
        CHECK_EQU((uintptr_t)shm_cache_entry_at(s, 0) % 8, 0);
        CHECK_EQU(s->l.cache_stride % 8, 0);
    }
    seg_free(&t);
}

/* The layout computed from the parameters: every part aligned, in its
 * place and inside the segment, and the parameters out of range refused. */
static void test_layout(void) {
    start_test("layout", 60);
    shm_layout l;

    /* struct facts the layout relies on */
    CHECK_EQU(sizeof(shm_header) % SHM_LINE, 0);
    CHECK_EQU(offsetof(shm_header, ev_state) % SHM_LINE, 0);
    CHECK_EQU(offsetof(shm_header, submit_seq) % SHM_LINE, 0);
    CHECK_EQU(offsetof(shm_header, clients_hwm) % SHM_LINE, 0);
    CHECK_EQU(offsetof(shm_header, st) % SHM_LINE, 0);
    CHECK(offsetof(shm_header, submit_seq) / SHM_LINE !=
          offsetof(shm_header, ev_state) / SHM_LINE);
    CHECK(offsetof(shm_header, clients_hwm) / SHM_LINE !=
          offsetof(shm_header, submit_seq) / SHM_LINE);
    CHECK(offsetof(shm_header, st) / SHM_LINE !=
          offsetof(shm_header, submit_seq) / SHM_LINE);
    CHECK_EQU(offsetof(shm_header, magic), 0);
    CHECK_EQU(sizeof(shm_client), SHM_LINE);
    CHECK(sizeof(shm_slot_meta) <= SHM_LINE);
    CHECK_EQU(sizeof(shm_params), 40);
    CHECK(ST_CACHE_REPLACED < SHM_N_STATS);
    CHECK_EQU(offsetof(shm_header, cache_version) % SHM_LINE, 0);

    /* slot word encoding */
    CHECK_EQU(shm_word_state(shm_slot_word(SLOT_DONE, 77)), SLOT_DONE);
    CHECK_EQU(shm_word_gen(shm_slot_word(SLOT_DONE, 77)), 77);
    CHECK_EQU(shm_word_gen(shm_slot_word(SLOT_READY, SLOT_GEN_MASK)),
              SLOT_GEN_MASK);
    CHECK_EQU(shm_word_gen(shm_slot_word(SLOT_READY, SLOT_GEN_MASK + 1)), 0);
    CHECK_EQU(shm_word_state(shm_slot_word(SLOT_TAKEN, 5) | SLOT_WAITER),
              SLOT_TAKEN);
    CHECK_EQU(shm_word_gen(shm_slot_word(SLOT_TAKEN, 5) | SLOT_WAITER), 5);

    /* bad parameters */
    const uint64_t R = SHM_MAX_ROW_BYTES;
    struct {
        const char *what;
        shm_params p;
    } bad[] = {
        {"in_bytes=0", mkparams(0, 32, 16, 4, 16)},
        {"in_bytes>max", mkparams(R + 1, 32, 16, 4, 16)},
        {"in_bytes=UINT64_MAX", mkparams(UINT64_MAX, 32, 16, 4, 16)},
        {"out_bytes=0", mkparams(336, 0, 16, 4, 16)},
        {"out_bytes>max", mkparams(336, R + 1, 16, 4, 16)},
        {"out_bytes=UINT64_MAX", mkparams(336, UINT64_MAX, 16, 4, 16)},
        {"max_clients=0", mkparams(336, 32, 0, 4, 16)},
        {"max_clients>max", mkparams(336, 32, SHM_MAX_CLIENTS + 1, 4, 16)},
        {"max_clients=UINT32_MAX", mkparams(336, 32, UINT32_MAX, 4, 16)},
        {"slots=0", mkparams(336, 32, 16, 0, 16)},
        {"slots>max", mkparams(336, 32, 16, SHM_MAX_SLOTS_PER_CLIENT + 1, 16)},
        {"slots=UINT32_MAX", mkparams(336, 32, 16, UINT32_MAX, 16)},
        {"max_batch=0", mkparams(336, 32, 16, 4, 0)},
        {"max_batch>max", mkparams(336, 32, 16, 4, SHM_MAX_BATCH + 1)},
        {"max_batch=UINT32_MAX", mkparams(336, 32, 16, 4, UINT32_MAX)},
        {"all zero", mkparams(0, 0, 0, 0, 0)},
        {"replicas=0", with_replicas(mkparams(336, 32, 16, 4, 16), 0, 1)},
        {"replicas>max", with_replicas(mkparams(336, 32, 16, 4, 16),
                                       SHM_MAX_REPLICAS + 1, SHM_MAX_REPLICAS + 1)},
        {"servers<replicas", with_replicas(mkparams(336, 32, 16, 4, 16), 2, 1)},
        {"servers>max", with_replicas(mkparams(336, 32, 16, 4, 16), 1,
                                      SHM_MAX_SERVERS + 1)},
        {"cache_log2=1", with_cache(mkparams(336, 32, 16, 4, 16), 1)},
        {"cache_log2>max", with_cache(mkparams(336, 32, 16, 4, 16),
                                      SHM_CACHE_MAX_LOG2 + 1)},
        {"cache_log2=UINT32_MAX", with_cache(mkparams(336, 32, 16, 4, 16),
                                             UINT32_MAX)},
        {"cache bytes>max", with_cache(mkparams(336, R, 16, 4, 16), 20)},
    };
    const uint64_t scratch_n = 64 * 1024;
    char *scratch = seg_alloc(scratch_n);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = shm_layout_compute(&bad[i].p, &l);
        CHECK_MSG(rc == SHM_E_PARAMS, "layout(%s) returned %d, want %d",
                  bad[i].what, rc, SHM_E_PARAMS);
        /* shm_init refuses them too, before touching the buffer */
        shm_seg s;
        memset(scratch, 0xA5, scratch_n);
        rc = shm_init(&s, scratch, scratch_n, &bad[i].p, "", 0, 1, 0, 0, 0);
        CHECK_MSG(rc == SHM_E_PARAMS, "init(%s) returned %d", bad[i].what, rc);
        for (uint64_t j = 0; j < scratch_n; j++)
            CHECK_MSG((unsigned char)scratch[j] == 0xA5,
                      "init(%s) wrote the buffer", bad[i].what);
    }
    free(scratch);

    /* the limits themselves are accepted and the sizes do not overflow */
    shm_params mx = mkparams(R, R, SHM_MAX_CLIENTS, SHM_MAX_SLOTS_PER_CLIENT,
                             SHM_MAX_BATCH);
    CHECK_EQ(shm_layout_compute(&mx, &l), SHM_OK);
    check_layout_numbers(&mx, &l);
    CHECK(l.total / ((uint64_t)SHM_MAX_CLIENTS * SHM_MAX_SLOTS_PER_CLIENT) >=
          l.slot_stride);
    shm_params mn = mkparams(1, 1, 1, 1, 1);
    CHECK_EQ(shm_layout_compute(&mn, &l), SHM_OK);
    check_layout_numbers(&mn, &l);
    shm_params mc = with_cache(mkparams(8, 8, 1, 1, 1), SHM_CACHE_MAX_LOG2);
    CHECK_EQ(shm_layout_compute(&mc, &l), SHM_OK); /* 2^32 entries of 40 B */
    check_layout_numbers(&mc, &l);

    /* a matrix of shapes: numeric facts always, addresses when small */
    const uint64_t ins[] = {1, 63, 64, 65, 336, 4097};
    const uint64_t outs[] = {1, 32, 511, 512, 513, 5000};
    const uint32_t cls[] = {1, 3, 16};
    const uint32_t ks[] = {1, 3, 4, 16, 17, 64};
    const uint32_t bs[] = {1, 16, 1000};
    unsigned n_addr = 0, n_num = 0;
    for (size_t a = 0; a < sizeof ins / sizeof ins[0]; a++)
        for (size_t b = 0; b < sizeof outs / sizeof outs[0]; b++)
            for (size_t c = 0; c < sizeof cls / sizeof cls[0]; c++)
                for (size_t d = 0; d < sizeof ks / sizeof ks[0]; d++)
                    for (size_t e = 0; e < sizeof bs / sizeof bs[0]; e++) {
                        shm_params p =
                            mkparams(ins[a], outs[b], cls[c], ks[d], bs[e]);
                        /* a cache on a third of them, of 4 to 64 entries */
                        if ((a + 2 * b + c + d + e) % 3 == 1)
                            p.cache_log2 = 2 + (uint32_t)((a + b + d) % 5);
                        CHECK_EQ(shm_layout_compute(&p, &l), SHM_OK);
                        check_layout_numbers(&p, &l);
                        n_num++;
                        /* a subset with real addresses (kept cheap) */
                        if (l.total <= (2u << 20) && (a + b + c + d + e) % 3 == 0) {
                            check_layout_addresses(&p);
                            n_addr++;
                        }
                    }

    /* latency histogram bins: in range and monotone */
    uint32_t prev = 0;
    for (uint64_t ns = 0; ns < 64; ns++) {
        uint32_t b = shm_hist_bin(ns);
        CHECK(b < SHM_HIST_BINS && b >= prev);
        prev = b;
    }
    for (int sh = 6; sh < 64; sh++)
        for (uint64_t q = 0; q < 8; q++) {
            uint64_t ns = (1ull << sh) + q * ((1ull << sh) / 8);
            uint32_t b = shm_hist_bin(ns);
            CHECK(b < SHM_HIST_BINS && b >= prev);
            prev = b;
        }
    CHECK(shm_hist_bin(UINT64_MAX) < SHM_HIST_BINS);

    printf("  layout: %zu bad parameter sets refused, %u shapes checked "
           "(%u at address level)\n",
           sizeof bad / sizeof bad[0], n_num, n_addr);
}

/* Attaches to a private exact-size copy of `img` (first min(size, img_size)
 * bytes; the rest zero), so that ASan catches any read past `size`. */
static int attach_copy(const char *img, uint64_t img_size, uint64_t size,
                       shm_seg *out) {
    void *buf = NULL;
    CHECK_EQ(posix_memalign(&buf, 4096, size ? size : 1), 0);
    uint64_t n = size < img_size ? size : img_size;
    memcpy(buf, img, n);
    if (size > n) memset((char *)buf + n, 0, size - n);
    shm_seg s;
    memset(&s, 0, sizeof s);
    int rc = shm_attach(&s, (char *)buf, size);
    if (rc == SHM_OK) {
        /* what it accepted must be self-consistent and in bounds */
        shm_layout l;
        CHECK_EQ(shm_layout_compute(&s.p, &l), SHM_OK);
        CHECK(memcmp(&l, &s.l, sizeof l) == 0);
        CHECK(s.l.total <= size);
        CHECK(s.base == (char *)buf);
        if (out) *out = s;
    }
    free(buf);
    return rc;
}

/* The documented decision order of shm_attach, written independently. */
static int attach_oracle(const char *img, uint64_t img_size, uint64_t size) {
    if (size < sizeof(shm_header)) return SHM_E_TOO_SMALL;
    shm_header h;
    memset(&h, 0, sizeof h);
    memcpy(&h, img, img_size < sizeof h ? img_size : sizeof h);
    if (h.magic != SHM_MAGIC) return SHM_E_MAGIC;
    if (h.layout_version != SHM_LAYOUT_VERSION) return SHM_E_VERSION;
    shm_layout l;
    if (shm_layout_compute(&h.params, &l) != SHM_OK) return SHM_E_PARAMS;
    if (h.total_bytes != l.total) return SHM_E_PARAMS;
    if (size < l.total) return SHM_E_TOO_SMALL;
    if (h.spec_len > SHM_SPEC_MAX) return SHM_E_SPEC;
    if (shm_fnv1a(h.spec, h.spec_len) != h.spec_hash) return SHM_E_SPEC;
    return SHM_OK;
}

static int is_status(int rc) { return rc <= SHM_OK && rc >= SHM_E_STATE; }

/* shm_attach refuses every corrupt or short segment, in its documented
 * order, and never reads out of bounds (ASan watches). */
static void test_attach(void) {
    start_test("attach", 120);
    const shm_params P = mkparams(336, 32, 16, 4, 16);
    test_seg t;
    seg_make(&t, &P);
    const uint64_t T = t.size;
    char *img = malloc(T);
    CHECK(img != NULL);
    shm_seg s;
    int rc;

    /* shm_init's own refusals */
    {
        shm_seg s2;
        char *b2 = seg_alloc(T);
        CHECK_EQ(shm_init(&s2, b2, T - 1, &P, k_spec, 10, 1, 0, 0, 0), SHM_E_TOO_SMALL);
        CHECK_EQ(shm_init(&s2, b2, 0, &P, k_spec, 10, 1, 0, 0, 0), SHM_E_TOO_SMALL);
        char *big = malloc(SHM_SPEC_MAX + 1);
        CHECK(big != NULL);
        memset(big, 'x', SHM_SPEC_MAX + 1);
        CHECK_EQ(shm_init(&s2, b2, T, &P, big, SHM_SPEC_MAX + 1, 1, 0, 0, 0), SHM_E_SPEC);
        /* exactly SHM_SPEC_MAX bytes of spec is fine, and attaches */
        CHECK_EQ(shm_init(&s2, b2, T, &P, big, SHM_SPEC_MAX, 1, 0, 0, 0), SHM_OK);
        CHECK_EQ(attach_copy(b2, T, T, NULL), SHM_OK);
        uint32_t len = 0;
        const char *sp = shm_spec(&s2, &len);
        CHECK_EQ(len, SHM_SPEC_MAX);
        CHECK(memcmp(sp, big, SHM_SPEC_MAX) == 0);
        free(big);
        free(b2);
    }

    /* the good case, and what it reports */
    memcpy(img, t.mem, T);
    memset(&s, 0, sizeof s);
    CHECK_EQ(attach_copy(img, T, T, &s), SHM_OK);
    CHECK(memcmp(&s.p, &P, sizeof P) == 0);
    CHECK(memcmp(&s.l, &t.s.l, sizeof s.l) == 0);
    CHECK_EQ(attach_copy(img, T, T + 4096, NULL), SHM_OK); /* bigger map */
    {
        shm_seg s3;
        CHECK_EQ(shm_attach(&s3, t.mem, T), SHM_OK);
        uint32_t len = 0;
        const char *sp = shm_spec(&s3, &len);
        CHECK_EQ(len, strlen(k_spec));
        CHECK(memcmp(sp, k_spec, len) == 0);
        CHECK_EQ(shm_owner_pid(&s3), getpid());
        CHECK_EQ(shm_ev_state(&s3), EV_STARTING);
    }

    /* sizes */
    struct {
        const char *what;
        uint64_t size;
    } sizes[] = {
        {"size 0", 0},
        {"size 1", 1},
        {"size header-1", sizeof(shm_header) - 1},
        {"size header", sizeof(shm_header)},
        {"size slots_off", t.s.l.slots_off},
        {"size total-1 (truncated)", T - 1},
        {"size total-slot (truncated)", T - t.s.l.slot_stride},
    };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        rc = attach_copy(img, T, sizes[i].size, NULL);
        CHECK_MSG(rc == SHM_E_TOO_SMALL, "%s: attach returned %d, want %d",
                  sizes[i].what, rc, SHM_E_TOO_SMALL);
    }

    /* targeted corruptions of a copy */
#define CORRUPT(what, want, stmt)                                           \
    do {                                                                    \
        memcpy(img, t.mem, T);                                              \
        shm_header *h = (shm_header *)img;                                  \
        (void)h;                                                            \
        stmt;                                                               \
        rc = attach_copy(img, T, T, NULL);                                  \
        CHECK_MSG(rc == (want), "%s: attach returned %d, want %d (%s)",     \
                  what, rc, (int)(want), #want);                            \
        CHECK_EQ(attach_oracle(img, T, T), (want));                         \
    } while (0)

    CORRUPT("magic byte flipped", SHM_E_MAGIC, img[0] ^= 0x01);
    CORRUPT("magic zero (never formatted)", SHM_E_MAGIC, h->magic = 0);
    CORRUPT("magic byte-swapped", SHM_E_MAGIC,
            h->magic = __builtin_bswap64(SHM_MAGIC));
    CORRUPT("version 0", SHM_E_VERSION, h->layout_version = 0);
    CORRUPT("version 2", SHM_E_VERSION,
            h->layout_version = SHM_LAYOUT_VERSION + 1);
    CORRUPT("version ~0", SHM_E_VERSION, h->layout_version = UINT32_MAX);
    CORRUPT("max_clients 16->8", SHM_E_PARAMS, h->params.max_clients = 8);
    CORRUPT("max_clients 16->17", SHM_E_PARAMS, h->params.max_clients = 17);
    CORRUPT("slots 4->5", SHM_E_PARAMS, h->params.slots_per_client = 5);
    CORRUPT("out_bytes 32->1100", SHM_E_PARAMS, h->params.out_bytes = 1100);
    CORRUPT("replicas 1->2", SHM_E_PARAMS, h->params.replicas = 2);
    CORRUPT("replicas 0", SHM_E_PARAMS, h->params.replicas = 0);
    CORRUPT("servers 1->33", SHM_E_PARAMS, h->params.servers = 33);
    CORRUPT("in_bytes 336->400", SHM_E_PARAMS, h->params.in_bytes = 400);
    CORRUPT("max_batch 0", SHM_E_PARAMS, h->params.max_batch = 0);
    CORRUPT("in_bytes 0", SHM_E_PARAMS, h->params.in_bytes = 0);
    CORRUPT("max_clients 100000", SHM_E_PARAMS,
            h->params.max_clients = 100000);
    CORRUPT("in_bytes 2^40", SHM_E_PARAMS, h->params.in_bytes = 1ull << 40);
    CORRUPT("total_bytes+1", SHM_E_PARAMS, h->total_bytes += 1);
    CORRUPT("total_bytes 0", SHM_E_PARAMS, h->total_bytes = 0);
    CORRUPT("total_bytes ~0", SHM_E_PARAMS, h->total_bytes = UINT64_MAX);
    /* a self-consistent header that claims more than is mapped */
    CORRUPT("consistent params, bigger than the mapping", SHM_E_TOO_SMALL, {
        h->params.max_clients = 32;
        shm_layout l2;
        CHECK_EQ(shm_layout_compute(&h->params, &l2), SHM_OK);
        h->total_bytes = l2.total;
    });
    CORRUPT("spec byte flipped", SHM_E_SPEC, h->spec[3] ^= 0x20);
    CORRUPT("spec byte past spec_len set", SHM_OK,
            h->spec[h->spec_len + 1] = 'z'); /* not covered: fine */
    CORRUPT("spec_len+1", SHM_E_SPEC, h->spec_len += 1);
    CORRUPT("spec_len-1", SHM_E_SPEC, h->spec_len -= 1);
    CORRUPT("spec_len 0", SHM_E_SPEC, h->spec_len = 0);
    CORRUPT("spec_len SPEC_MAX+1", SHM_E_SPEC, h->spec_len = SHM_SPEC_MAX + 1);
    CORRUPT("spec_len ~0", SHM_E_SPEC, h->spec_len = UINT32_MAX);
    CORRUPT("spec_hash flipped", SHM_E_SPEC, h->spec_hash ^= 1);
    CORRUPT("order: bad version wins over bad params", SHM_E_VERSION, {
        h->layout_version = SHM_LAYOUT_VERSION + 1;
        h->params.max_batch = 0;
    });
    CORRUPT("order: bad params win over bad spec", SHM_E_PARAMS, {
        h->params.max_batch = 0;
        h->spec_hash ^= 1;
    });
#undef CORRUPT
    /* wrong magic in a header-sized buffer: the magic check, not size */
    memcpy(img, t.mem, T);
    ((shm_header *)img)->magic = 1;
    CHECK_EQ(attach_copy(img, T, sizeof(shm_header), NULL), SHM_E_MAGIC);

    /* A parameter change that keeps total_bytes is NOT detected (no checksum
     * over the identity block); document what attach says. */
    memcpy(img, t.mem, T);
    ((shm_header *)img)->params.in_bytes = 330; /* same 64-byte rounding */
    int same_total_in = attach_copy(img, T, T, NULL);
    memcpy(img, t.mem, T);
    ((shm_header *)img)->params.max_batch = 17; /* header rounds to 4096 */
    int same_total_batch = attach_copy(img, T, T, NULL);
    if (same_total_in == SHM_OK || same_total_batch == SHM_OK)
        printf("  note: attach does not notice params changed without "
               "changing the total (in_bytes 336->330: %s, max_batch "
               "16->17: %s)\n",
               same_total_in == SHM_OK ? "accepted" : "refused",
               same_total_batch == SHM_OK ? "accepted" : "refused");

    /* ---- random trials: never crash, never read out of bounds, always a
     * status code (checked against the oracle) ---- */
    uint64_t rng = g_seed ^ 0xA77AC4ull;
    const unsigned trials = g_slow ? 1500 : 4000;
    const uint64_t MAXBUF = 2 * T + 2 * sizeof(shm_header) + 8192;
    char *fz = malloc(MAXBUF);
    CHECK(fz != NULL);
    unsigned n_ok = 0, hist[16] = {0};

    for (unsigned i = 0; i < trials; i++) {
        /* R1: all garbage, random size (mostly around the header size) */
        uint64_t r0 = rng_next(&rng);
        uint64_t size = (r0 & 15) == 0 ? (r0 >> 8) % (2 * T + 1)
                                        : (r0 >> 8) % (2 * sizeof(shm_header) + 1);
        for (uint64_t j = 0; j < size; j += 8) {
            uint64_t r = rng_next(&rng);
            memcpy(fz + j, &r, size - j < 8 ? size - j : 8);
        }
        rc = attach_copy(fz, size, size, NULL);
        CHECK(is_status(rc) && rc != SHM_OK);
        CHECK_EQ(rc, attach_oracle(fz, size, size));
        hist[-rc]++;
    }
    for (unsigned i = 0; i < trials; i++) {
        /* R2: garbage with the right magic (and sometimes version) */
        uint64_t size = sizeof(shm_header) + rng_next(&rng) % (2 * T);
        for (uint64_t j = 0; j < sizeof(shm_header); j += 8) {
            uint64_t r = rng_next(&rng);
            memcpy(fz + j, &r, sizeof(shm_header) - j < 8 ? sizeof(shm_header) - j : 8);
        }
        memset(fz + sizeof(shm_header), 0, size - sizeof(shm_header));
        shm_header *h = (shm_header *)fz;
        h->magic = SHM_MAGIC;
        if (i & 1) h->layout_version = SHM_LAYOUT_VERSION;
        rc = attach_copy(fz, size, size, NULL);
        CHECK(is_status(rc));
        CHECK_EQ(rc, attach_oracle(fz, size, size));
        if (rc == SHM_OK) n_ok++;
        hist[-rc]++;
    }
    for (unsigned i = 0; i < 2 * trials; i++) {
        /* R3: magic + version right, parameters drawn from interesting
         * values, total_bytes often consistent, spec often valid, size
         * around the claimed total */
        static const uint64_t rows[] = {0, 1, 64, 336, 4096, SHM_MAX_ROW_BYTES,
                                        SHM_MAX_ROW_BYTES + 1, UINT64_MAX};
        static const uint32_t counts[] = {0, 1, 2, 7, 16, 64, 65, 4096, 4097,
                                          65536, 65537, UINT32_MAX};
        shm_header hh;
        memset(&hh, 0, sizeof hh);
        for (size_t j = 0; j < sizeof hh; j += 8) {
            uint64_t r = rng_next(&rng);
            memcpy((char *)&hh + j, &r, sizeof hh - j < 8 ? sizeof hh - j : 8);
        }
        hh.magic = SHM_MAGIC;
        hh.layout_version = SHM_LAYOUT_VERSION;
        uint64_t r = rng_next(&rng);
        hh.params.in_bytes = (r & 1) ? rows[(r >> 1) % 8] : 1 + (r >> 8) % 3000;
        r = rng_next(&rng);
        hh.params.out_bytes = (r & 1) ? rows[(r >> 1) % 8] : 1 + (r >> 8) % 3000;
        r = rng_next(&rng);
        hh.params.max_clients = (r & 1) ? counts[(r >> 1) % 12] : 1 + (r >> 8) % 20;
        r = rng_next(&rng);
        hh.params.slots_per_client =
            (r & 1) ? counts[(r >> 1) % 12] : 1 + (r >> 8) % 8;
        r = rng_next(&rng);
        hh.params.max_batch = (r & 1) ? counts[(r >> 1) % 12] : 1 + (r >> 8) % 300;
        shm_layout l;
        int lrc = shm_layout_compute(&hh.params, &l);
        r = rng_next(&rng);
        if (lrc == SHM_OK && (r & 3) != 0) hh.total_bytes = l.total;
        r = rng_next(&rng);
        switch (r % 6) {
        case 0: hh.spec_len = 0; break;
        case 1: hh.spec_len = (uint32_t)((r >> 8) % 100); break;
        case 2: hh.spec_len = SHM_SPEC_MAX; break;
        case 3: hh.spec_len = SHM_SPEC_MAX + 1; break;
        case 4: hh.spec_len = (uint32_t)(r >> 32); break;
        default: hh.spec_len = (uint32_t)((r >> 8) % SHM_SPEC_MAX); break;
        }
        r = rng_next(&rng);
        if ((r & 3) != 0 && hh.spec_len <= SHM_SPEC_MAX)
            hh.spec_hash = shm_fnv1a(hh.spec, hh.spec_len);
        uint64_t size;
        r = rng_next(&rng);
        uint64_t claim = hh.total_bytes;
        if (claim > MAXBUF - 4096 || claim < sizeof(shm_header))
            size = sizeof(shm_header) + (r >> 8) % (64 * 1024);
        else
            switch (r % 4) {
            case 0: size = claim; break;
            case 1: size = claim - 1; break;
            case 2: size = claim + (r >> 8) % 4096; break;
            default: size = sizeof(shm_header) + (r >> 8) % (claim - sizeof(shm_header) + 1); break;
            }
        if (r % 97 == 0) size = (r >> 20) % sizeof(shm_header); /* tiny */
        memset(fz, 0, size < sizeof hh ? sizeof hh : size);
        memcpy(fz, &hh, sizeof hh);
        rc = attach_copy(fz, size, size, NULL);
        CHECK(is_status(rc));
        CHECK_EQ(rc, attach_oracle(fz, size, size));
        if (rc == SHM_OK) n_ok++;
        hist[-rc]++;
    }
    for (unsigned i = 0; i < trials; i++) {
        /* R4: a valid segment with a few random bytes of the header (and
         * sometimes of the batch histogram / client table) overwritten */
        memcpy(fz, t.mem, T);
        uint64_t r = rng_next(&rng);
        unsigned nflip = 1 + (unsigned)(r % 4);
        for (unsigned j = 0; j < nflip; j++) {
            uint64_t q = rng_next(&rng);
            uint64_t lim = (q & 1) ? sizeof(shm_header) : 256;
            fz[(q >> 8) % lim] = (char)(q >> 56);
        }
        uint64_t size = (r >> 8) % 4 == 0 ? T - 1 - (r >> 16) % T : T;
        rc = attach_copy(fz, T, size, NULL);
        CHECK(is_status(rc));
        CHECK_EQ(rc, attach_oracle(fz, T, size));
        if (rc == SHM_OK) n_ok++;
        hist[-rc]++;
    }
    free(fz);
    free(img);
    seg_free(&t);
    printf("  attach: %u random trials: ok=%u too_small=%u magic=%u "
           "version=%u params=%u spec=%u\n",
           5 * trials, hist[0], hist[1], hist[2], hist[3], hist[4], hist[5]);
    (void)n_ok;
}

/* The spec is read once at attach: a peer rewriting the header afterwards
 * (spec_len included) changes nothing this process reads. */
static void test_spec_once(void) {
    start_test("spec_once", 10);
    const shm_params P = mkparams(64, 32, 1, 1, 8);
    test_seg t;
    seg_make(&t, &P);
    shm_seg s2;
    CHECK_EQ(shm_attach(&s2, t.mem, t.size), SHM_OK);
    shm_header *h = shm_hdr(&s2);
    h->spec_len = UINT32_MAX;
    memset(h->spec, 'z', 16);
    uint32_t len;
    const char *sp = shm_spec(&s2, &len);
    CHECK_EQ(len, strlen(k_spec));
    CHECK(memcmp(sp, k_spec, len) == 0);
    seg_free(&t);
}

const test_case layout_tests[] = {
    {"layout", test_layout},
    {"attach", test_attach},
    {"spec_once", test_spec_once},
    {NULL, NULL},
};
