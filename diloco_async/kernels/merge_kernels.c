/* Fused float32 passes of the synchronizer's merge (DESIGN §4.5c), loaded by
 * diloco_async/kernels/build.py through ctypes and called from diloco_async/merge/native.py.
 *
 * Each loop does, per element, the same IEEE float32 operations in the same order as the torch
 * code it replaces (merge.py, merge_buffers.py, outer_step.py), so the results are bit for bit
 * equal: torch's add(a, b, alpha=s) on CPU is fmaf(b, s, a) (its vector path is vec::fmadd and
 * its scalar tail is contracted to an FMA in torch's build: checked by the tests), div, mul, sub
 * are single roundings. Built with -ffp-contract=off so that only the explicit fmaf fuse.
 * No allocation, no I/O; every pointer is to n contiguous floats. */

#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef BLOCK
#define BLOCK 8192 /* elements per block: the output block stays in cache while the sources add up */
#endif
#define MAX_THREADS 64
#define MIN_PER_THREAD 65536 /* elements: below this a thread costs more than it saves */
#define ALIGN 64             /* elements: ranges of threads start at multiples of this */

/* Runs fn(ctx, lo, hi) on [0, n) split into up to nthreads ranges, the first in this thread. */
typedef void (*range_fn)(void *ctx, int64_t lo, int64_t hi);
struct job {
    range_fn fn;
    void *ctx;
    int64_t lo, hi;
};
static void *run_job(void *arg) {
    struct job *j = arg;
    j->fn(j->ctx, j->lo, j->hi);
    return NULL;
}
static void parallel(range_fn fn, void *ctx, int64_t n, int32_t nthreads) {
    int64_t most = n / MIN_PER_THREAD;
    int32_t k = nthreads < 1 ? 1 : nthreads > MAX_THREADS ? MAX_THREADS : nthreads;
    if (most < k)
        k = most < 1 ? 1 : (int32_t)most;
    struct job jobs[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int64_t per = (n / k + ALIGN - 1) / ALIGN * ALIGN;
    for (int32_t t = 0; t < k; t++) {
        int64_t lo = per * t, hi = t == k - 1 ? n : per * (t + 1);
        jobs[t] = (struct job){fn, ctx, lo < n ? lo : n, hi < n ? hi : n};
    }
    for (int32_t t = 1; t < k; t++)
        started[t] = pthread_create(&tids[t], NULL, run_job, &jobs[t]) == 0;
    run_job(&jobs[0]);
    for (int32_t t = 1; t < k; t++) {
        if (started[t])
            pthread_join(tids[t], NULL);
        else
            run_job(&jobs[t]); /* no thread to be had: do its range here */
    }
}

/* torch's float32 2-norm of a contiguous tensor (linalg.vector_norm on CPU, the reduction of the
 * last dimension): squares summed into L lanes, lane j taking elements j, j+L, j+2L, ... in order
 * (L = its Vectorized<float> width: 8 with AVX2, 16 with AVX512), each a product then a sum, two
 * roundings (its vector code does not fuse them); then the lanes folded left to right and the
 * square root. The loops below add each output element's square to its lane as they write it, in
 * element order, so that the chain of additions overlaps the memory traffic; only for n a
 * multiple of L (torch's tail loop for the rest is not reproduced here). merge_native checks the
 * result against torch once per process before using it. */
#define MAX_LANES 16
_Static_assert(BLOCK % MAX_LANES == 0, "blocks must hold whole lanes");

static float fold_lanes(const float *acc, int32_t lanes) {
    float b = acc[0];
    for (int j = 1; j < lanes; j++)
        b = b + acc[j];
    return sqrtf(b);
}

typedef float lanes8 __attribute__((vector_size(32)));
typedef float lanes16 __attribute__((vector_size(64)));

/* acc += x*x lane by lane over n elements (a multiple of the lanes) as one vector register, so
 * that nothing but the additions' latency orders them (element j of each group in lane j). */
#define SUMSQ(V, acc, x, i)                                                                                   \
    do {                                                                                                      \
        V v_;                                                                                                 \
        memcpy(&v_, (x) + (i), sizeof v_);                                                                    \
        (acc) = (acc) + v_ * v_;                                                                              \
    } while (0)

#define GROUP 64 /* elements written before their squares are summed: a few cache lines */

/* One source added into elements [0, len) of a block: u = x (or (cu - b) + x), u = u / nj when
 * divide, o = fmaf(u, p, o). */
static inline __attribute__((always_inline)) void add_plain(float *restrict o, const float *restrict x,
                                                            const float *restrict cu, const float *restrict b,
                                                            int64_t len, float p, float nj, int has_cur,
                                                            int divide) {
    for (int64_t i = 0; i < len; i++) {
        float u = has_cur ? (cu[i] - b[i]) + x[i] : x[i];
        o[i] = fmaf(divide ? u / nj : u, p, o[i]);
    }
}

/* The first two sources at once, both without cur/base: o = fmaf(u2, p2, fmaf(u1, p1, 0)) with
 * u = x (or x / n when divide), the same operations as zeroing o and adding them one by one,
 * in one pass over o instead of three. */
static inline __attribute__((always_inline)) void pair_plain(float *restrict o, const float *restrict x1,
                                                             const float *restrict x2, int64_t len, float p1,
                                                             float p2, float n1, float n2, int divide) {
    for (int64_t i = 0; i < len; i++) {
        float r = fmaf(divide ? x1[i] / n1 : x1[i], p1, 0.0f);
        o[i] = fmaf(divide ? x2[i] / n2 : x2[i], p2, r);
    }
}

/* One pass over a block that writes o: one source added (PASS_ADD: add_plain, with cu/b when
 * has_cur), the first two plain sources (PASS_PAIR: pair_plain, x2 the second), or the anchored
 * outer gradient o = (cu - b) + x (PASS_ANCHOR). */
enum pass_kind { PASS_ADD, PASS_PAIR, PASS_ANCHOR };
struct pass {
    float *o;
    const float *x, *x2, *cu, *b;
    float p, p2, n, n2;
};

static inline __attribute__((always_inline)) void pass_run(int kind, const struct pass *a, int64_t lo, int64_t k,
                                                           int has_cur, int divide) {
    float *restrict o = a->o + lo;
    const float *restrict x = a->x + lo;
    if (kind == PASS_ANCHOR) {
        const float *restrict cu = a->cu + lo, *restrict b = a->b + lo;
        for (int64_t i = 0; i < k; i++)
            o[i] = (cu[i] - b[i]) + x[i];
    } else if (kind == PASS_PAIR)
        pair_plain(o, x, a->x2 + lo, k, a->p, a->p2, a->n, a->n2, divide);
    else
        add_plain(o, x, has_cur ? a->cu + lo : a->cu, has_cur ? a->b + lo : a->b, k, a->p, a->n, has_cur, divide);
}

/* pass_run over [0, len); with L > 0 (a constant at each call), each group of results, once
 * written, also summed into the lanes acc (as squares), in element order. */
static inline __attribute__((always_inline)) void pass_lanes(int kind, const struct pass *a, int64_t len,
                                                             int has_cur, int divide, int L,
                                                             float *restrict acc) {
    if (L == 0) {
        pass_run(kind, a, 0, len, has_cur, divide);
        return;
    }
    lanes16 a16;
    lanes8 a8;
    memcpy(&a16, acc, sizeof a16);
    memcpy(&a8, acc, sizeof a8);
    for (int64_t g = 0; g < len; g += GROUP) {
        int64_t k = len - g < GROUP ? len - g : GROUP;
        if (k == GROUP) /* a constant trip count for the common case */
            pass_run(kind, a, g, GROUP, has_cur, divide);
        else
            pass_run(kind, a, g, k, has_cur, divide);
        for (int64_t i = g; i < g + k; i += L) {
            if (L == 16)
                SUMSQ(lanes16, a16, a->o, i);
            else
                SUMSQ(lanes8, a8, a->o, i);
        }
    }
    if (L == 16)
        memcpy(acc, &a16, sizeof a16);
    else
        memcpy(acc, &a8, sizeof a8);
}

#define PASS_L(K, HC, DV)                                                                                     \
    (lanes == 16  ? pass_lanes(K, a, len, HC, DV, 16, acc)                                                    \
     : lanes == 8 ? pass_lanes(K, a, len, HC, DV, 8, acc)                                                     \
                  : pass_lanes(K, a, len, HC, DV, 0, acc))

/* pass_lanes with every flag turned into a constant, so that each case gets its own loops. */
static void pass_any(int kind, const struct pass *a, int64_t len, int has_cur, int divide, int32_t lanes,
                     float *acc) {
    if (kind == PASS_ANCHOR)
        PASS_L(PASS_ANCHOR, 1, 0);
    else if (kind == PASS_PAIR)
        divide ? PASS_L(PASS_PAIR, 0, 1) : PASS_L(PASS_PAIR, 0, 0);
    else if (has_cur)
        divide ? PASS_L(PASS_ADD, 1, 1) : PASS_L(PASS_ADD, 1, 0);
    else
        divide ? PASS_L(PASS_ADD, 0, 1) : PASS_L(PASS_ADD, 0, 0);
}

struct acc_ctx {
    float *out;
    int32_t m, divide;
    const float *const *xs, *const *curs, *const *bases;
    const float *norms, *probs;
    int32_t lanes; /* > 0: the squares of out summed into acc as the last source is added (one range) */
    float acc[MAX_LANES];
};

static void acc_range(void *arg, int64_t lo0, int64_t hi0) {
    struct acc_ctx *c = arg;
    for (int64_t lo = lo0; lo < hi0; lo += BLOCK) {
        int64_t len = hi0 - lo < BLOCK ? hi0 - lo : BLOCK;
        float *restrict o = c->out + lo;
        int32_t j = 0;
        if (c->m >= 2 && c->curs[0] == NULL && c->curs[1] == NULL) {
            struct pass a = {o, c->xs[0] + lo, c->xs[1] + lo, NULL, NULL, c->probs[0], c->probs[1], c->norms[0],
                             c->norms[1]};
            pass_any(PASS_PAIR, &a, len, 0, c->divide, c->m == 2 ? c->lanes : 0, c->acc);
            j = 2;
        } else {
            for (int64_t i = 0; i < len; i++)
                o[i] = 0.0f;
        }
        for (; j < c->m; j++) {
            const float *cu = c->curs[j] == NULL ? NULL : c->curs[j] + lo;
            const float *b = c->bases[j] == NULL ? NULL : c->bases[j] + lo;
            struct pass a = {o, c->xs[j] + lo, NULL, cu, b, c->probs[j], 0.0f, c->norms[j], 0.0f};
            pass_any(PASS_ADD, &a, len, cu != NULL, c->divide, j == c->m - 1 ? c->lanes : 0, c->acc);
        }
    }
}

/* out[i] = 0; for each source j: u = x_j[i] (or (cur_j[i] - base_j[i]) + x_j[i] when cur_j is
 * given), u = u / norm_j when divide; out[i] = fmaf(u, prob_j, out[i]).  RDA's direction
 * (divide = 1) and the weighted mean (divide = 0), as merge._rda_into / merge._mean_into.
 * With lanes > 0 (n a multiple of it; one thread), *norm_out = torch's 2-norm of out, computed
 * in the same pass. */
void dl_accumulate(float *out, int64_t n, int32_t m, const float *const *xs, const float *const *curs,
                   const float *const *bases, const float *norms, const float *probs, int32_t divide,
                   int32_t nthreads, int32_t lanes, float *norm_out) {
    struct acc_ctx c = {out, m, divide, xs, curs, bases, norms, probs, m > 0 ? lanes : 0, {0}};
    if (lanes > 0) {
        acc_range(&c, 0, n);
        *norm_out = fold_lanes(c.acc, lanes); /* all zero lanes when m == 0: norm 0 */
    } else
        parallel(acc_range, &c, n, nthreads);
}

struct anchor_ctx {
    float *out;
    const float *cur, *base, *delta;
};

static void anchor_range(void *arg, int64_t lo, int64_t hi) {
    const struct anchor_ctx *c = arg;
    float *restrict o = c->out;
    const float *restrict cu = c->cur, *restrict b = c->base, *restrict d = c->delta;
    for (int64_t i = lo; i < hi; i++)
        o[i] = (cu[i] - b[i]) + d[i];
}

/* out[i] = (cur[i] - base[i]) + delta[i]: the anchored outer gradient, as AnchoredDelta.write.
 * With lanes > 0 (n a multiple of it; one thread), *norm_out = torch's 2-norm of out, computed
 * in the same pass. */
void dl_anchor(float *out, int64_t n, const float *cur, const float *base, const float *delta, int32_t nthreads,
               int32_t lanes, float *norm_out) {
    if (lanes != 8 && lanes != 16) {
        struct anchor_ctx c = {out, cur, base, delta};
        parallel(anchor_range, &c, n, nthreads);
        return;
    }
    float acc[MAX_LANES] = {0};
    struct pass a = {out, delta, NULL, cur, base, 0.0f, 0.0f, 0.0f, 0.0f};
    pass_any(PASS_ANCHOR, &a, n, 1, 0, lanes, acc);
    *norm_out = fold_lanes(acc, lanes);
}

static uint32_t exp_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u & 0x7f800000u; /* == 0x7f800000 exactly for Inf and NaN */
}

struct step_ctx {
    float *new_p, *new_b;
    const float *p, *b, *g;
    float scale, mu, neg_lr;
    int32_t use_scale;
    int64_t chunk;
    uint8_t *flags; /* per chunk: 1 = a gc not finite, 2 = a result not finite */
};

/* Elements [lo, hi) of the step; the largest exponent fields of gc and of the result are folded
 * into *g_exp and *p_exp. use_scale is a constant at each call, so each gets its own loop. */
static inline __attribute__((always_inline)) void step_piece(const struct step_ctx *c, int64_t lo, int64_t hi,
                                                             int use_scale, uint32_t *g_exp, uint32_t *p_exp) {
    const float *gg = c->g, *pp = c->p, *bb = c->b;
    float *npp = c->new_p, *nbb = c->new_b;
    const float scale = c->scale, mu = c->mu, neg_lr = c->neg_lr;
    uint32_t gx = 0, px = 0;
#pragma GCC ivdep /* nbb may be gg: element i is read before it is written, nothing else aliases */
    for (int64_t i = lo; i < hi; i++) {
        float gc = use_scale ? gg[i] * scale : gg[i];
        float nb = bb[i] * mu;
        nb = nb + gc;
        float np = fmaf(fmaf(nb, mu, gc), neg_lr, pp[i]);
        nbb[i] = nb;
        npp[i] = np;
        uint32_t ge = exp_bits(gc), pe = exp_bits(np);
        gx = ge > gx ? ge : gx;
        px = pe > px ? pe : px;
    }
    *g_exp = gx;
    *p_exp = px;
}

static void step_range(void *arg, int64_t lo0, int64_t hi0) {
    const struct step_ctx *c = arg;
    for (int64_t lo = lo0; lo < hi0;) { /* pieces that do not cross a chunk's end */
        int64_t k = lo / c->chunk, end = (k + 1) * c->chunk;
        int64_t hi = end < hi0 ? end : hi0;
        uint32_t g_exp, p_exp;
        if (c->use_scale)
            step_piece(c, lo, hi, 1, &g_exp, &p_exp);
        else
            step_piece(c, lo, hi, 0, &g_exp, &p_exp);
        uint8_t f = (uint8_t)((g_exp == 0x7f800000u ? 1 : 0) | (p_exp == 0x7f800000u ? 2 : 0));
        if (f)
            __atomic_fetch_or(&c->flags[k], f, __ATOMIC_RELAXED);
        lo = hi;
    }
}

/* One tensor's outer Nesterov step, as OuterOptimizer._step_tensor with a momentum b, by chunks
 * of `chunk` elements:
 *   gc = use_scale ? g*scale : g;  nb = b*mu;  nb = nb + gc;  t = fmaf(nb, mu, gc);
 *   np = fmaf(t, neg_lr, p).
 * new_b may be g itself (the step consumes g). The finite checks are judged per chunk, in the
 * torch code's order: returns 0 when done, 1 where the torch code raises for a non-finite gc (any
 * chunk without require_finite; the first chunk with a non-finite result with it), 2 when a
 * result is not finite but the gc of the first such chunk is (require_finite), -1 when out of
 * memory (nothing judged). The outputs are written in full in every case. */
int32_t dl_outer_step(float *new_p, float *new_b, int64_t n, int64_t chunk, const float *p, const float *b,
                      const float *g, float scale, int32_t use_scale, float mu, float neg_lr,
                      int32_t require_finite, int32_t nthreads) {
    int64_t nchunks = chunk > 0 ? (n + chunk - 1) / chunk : 0;
    uint8_t *flags = calloc(nchunks > 0 ? (size_t)nchunks : 1, 1);
    if (flags == NULL || chunk <= 0) {
        free(flags);
        return -1;
    }
    struct step_ctx c = {new_p, new_b, p, b, g, scale, mu, neg_lr, use_scale, chunk, flags};
    parallel(step_range, &c, n, nthreads);
    int32_t status = 0;
    for (int64_t k = 0; k < nchunks && status == 0; k++) {
        if (!require_finite && (flags[k] & 1))
            status = 1;
        else if (require_finite && (flags[k] & 2))
            status = (flags[k] & 1) ? 1 : 2;
    }
    free(flags);
    return status;
}
