/* Fused float32 passes of the synchronizer's merge (DESIGN §4.5b), loaded by
 * diloco_async/native_build.py through ctypes and called from diloco_async/merge_native.py.
 *
 * Each loop does, per element, the same IEEE float32 operations in the same order as the torch
 * code it replaces (merge.py, merge_buffers.py, outer_step.py), so the results are bit for bit
 * equal: torch's add(a, b, alpha=s) on CPU is fmaf(b, s, a) (its vector path is vec::fmadd and
 * its scalar tail is contracted to an FMA in torch's build: checked by the tests), div, mul, sub
 * are single roundings. Built with -ffp-contract=off so that only the explicit fmaf fuse.
 * No allocation, no I/O; every pointer is to n contiguous floats. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 2048 /* elements per block: the output block stays in L1 while the sources add up */

/* o[i] = 0; for each source j: u = x_j[i] (or (cur_j[i] - base_j[i]) + x_j[i] when cur_j is
 * given), u = u / norm_j when divide; o[i] = fmaf(u, prob_j, o[i]).  RDA's direction
 * (divide = 1) and the weighted mean (divide = 0), as merge._rda_into / merge._mean_into. */
void dl_accumulate(float *out, int64_t n, int32_t m, const float *const *xs, const float *const *curs,
                   const float *const *bases, const float *norms, const float *probs, int32_t divide) {
    for (int64_t lo = 0; lo < n; lo += BLOCK) {
        int64_t len = n - lo < BLOCK ? n - lo : BLOCK;
        float *restrict o = out + lo;
        for (int64_t i = 0; i < len; i++)
            o[i] = 0.0f;
        for (int32_t j = 0; j < m; j++) {
            const float *restrict x = xs[j] + lo;
            const float p = probs[j];
            const float nj = norms[j];
            if (curs[j] != NULL) {
                const float *restrict c = curs[j] + lo;
                const float *restrict b = bases[j] + lo;
                if (divide) {
                    for (int64_t i = 0; i < len; i++) {
                        float d = c[i] - b[i];
                        float u = d + x[i];
                        o[i] = fmaf(u / nj, p, o[i]);
                    }
                } else {
                    for (int64_t i = 0; i < len; i++) {
                        float d = c[i] - b[i];
                        float u = d + x[i];
                        o[i] = fmaf(u, p, o[i]);
                    }
                }
            } else if (divide) {
                for (int64_t i = 0; i < len; i++)
                    o[i] = fmaf(x[i] / nj, p, o[i]);
            } else {
                for (int64_t i = 0; i < len; i++)
                    o[i] = fmaf(x[i], p, o[i]);
            }
        }
    }
}

/* out[i] = (cur[i] - base[i]) + delta[i]: the anchored outer gradient, as AnchoredDelta.write. */
void dl_anchor(float *restrict out, int64_t n, const float *restrict cur, const float *restrict base,
               const float *restrict delta) {
    for (int64_t i = 0; i < n; i++) {
        float d = cur[i] - base[i];
        out[i] = d + delta[i];
    }
}

static uint32_t exp_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u & 0x7f800000u; /* == 0x7f800000 exactly for Inf and NaN */
}

/* One tensor's outer Nesterov step, chunk by chunk (chunk elements), as
 * OuterOptimizer._step_tensor with a momentum b:
 *   gc = use_scale ? g*scale : g;  nb = b*mu;  nb = nb + gc;  t = fmaf(nb, mu, gc);
 *   np = fmaf(t, neg_lr, p);
 * new_b may be g itself (the step consumes g: each element is read before it is written).
 * Finite checks per chunk, in the torch code's order. Returns 0 when done, 1 when a chunk's gc has
 * NaN/Inf where the torch code raises on it (checked before the chunk without require_finite; in
 * the first chunk whose result is not finite with it), 2 when a result is not finite but the gc
 * of the first such chunk is (require_finite). After 1 the outputs are partly written. */
int32_t dl_outer_step(float *new_p, float *new_b, int64_t n, int64_t chunk, const float *p, const float *b,
                      const float *g, float scale, int32_t use_scale, float mu, float neg_lr,
                      int32_t require_finite) {
    int32_t status = 0;
    for (int64_t lo = 0; lo < n; lo += chunk) {
        int64_t len = n - lo < chunk ? n - lo : chunk;
        const float *gg = g + lo, *pp = p + lo, *bb = b + lo;
        float *npp = new_p + lo, *nbb = new_b + lo;
        uint32_t g_exp = 0, p_exp = 0;
#pragma GCC ivdep /* nbb may be gg: element i is read before it is written, nothing else aliases */
        for (int64_t i = 0; i < len; i++) {
            float gc = use_scale ? gg[i] * scale : gg[i];
            float nb = bb[i] * mu;
            nb = nb + gc;
            float t = fmaf(nb, mu, gc);
            float np = fmaf(t, neg_lr, pp[i]);
            nbb[i] = nb;
            npp[i] = np;
            uint32_t ge = exp_bits(gc), pe = exp_bits(np);
            g_exp = ge > g_exp ? ge : g_exp;
            p_exp = pe > p_exp ? pe : p_exp;
        }
        if (!require_finite && g_exp == 0x7f800000u)
            return 1;
        if (require_finite && status == 0 && p_exp == 0x7f800000u) {
            if (g_exp == 0x7f800000u)
                return 1;
            status = 2;
        }
    }
    return status;
}
