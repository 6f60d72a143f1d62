/* Blockwise absmax quantization of the int8/int4/int2 wire codecs, one pass each way (DESIGN §6).
 *
 * Loaded by diloco_async/codec/native.py through ctypes; built by diloco_async/kernels/build.py
 * with -ffp-contract=off and without fast-math, so every float operation below rounds as written.
 * The bits are those of the torch code in codec_blocks.py / codec.py / codec_int2.py:
 *
 *   encode: scale_k = amax_k(|x|) / qmax (one float32 division; a short last block is read as if
 *           zero-padded, which cannot change its absmax), divisor = scale or 1 where the scale is
 *           0, q = round-half-to-even(x / divisor) (one float32 division, then the 1.5 * 2^23
 *           trick, exact for |v| < 2^22), packed as the wire layout says;
 *   decode: value = (float) q * scale_k (an exact conversion, one multiplication).
 *
 * dl_quantize returns 1 without finishing when the torch code would take its careful path (a
 * NaN or Inf element, or a subnormal scale): the caller then runs the torch code, which handles
 * those blocks (clamp, NaN payloads) exactly as the reference does.
 */
#include <float.h>
#include <stdint.h>
#include <string.h>

#define ROUNDING_MAGIC 12582912.0f /* 1.5 * 2^23 */

static inline int8_t round_q(float v) {
    float r = (v + ROUNDING_MAGIC) - ROUNDING_MAGIC;
    return (int8_t)(int32_t)r;
}

/* One block's absmax of |x| (n >= 1), as the int32 maximum of the bits with the sign cleared
 * (the order of the magnitudes; a max of ints vectorizes, a max of floats does not without
 * fast-math); *bad set when an element is NaN or Inf (bits at or above +Inf's). */
static inline float block_absmax(const float *x, int64_t n, int *bad) {
    const uint32_t *bits = (const uint32_t *)x;
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t b = bits[i] & 0x7FFFFFFFu;
        m = b > m ? b : m;
    }
    if (m >= 0x7F800000u) *bad = 1;
    float a;
    memcpy(&a, &m, 4);
    return a;
}

/* Quantize n floats in blocks of bs with levels in [-qmax, qmax]; bits per value: 8, 4 or 2.
 * scale: ceil(n / bs) floats out. out: n bytes (bits 8), ceil(n/2) (bits 4) or ceil(n/4) (bits 2).
 * q: scratch of n int8 (bits 4 and 2; unused for 8). Returns 0, or 1 when the torch code must be
 * used instead. */
int dl_quantize(const float *x, int64_t n, int64_t bs, int32_t qmax, int32_t bits, float *scale,
                uint8_t *out, int8_t *q) {
    int8_t *qv = bits == 8 ? (int8_t *)out : q;
    int64_t nblocks = (n + bs - 1) / bs;
    for (int64_t k = 0; k < nblocks; k++) {
        int64_t lo = k * bs, len = (lo + bs <= n) ? bs : n - lo;
        int bad = 0;
        float s = block_absmax(x + lo, len, &bad) / (float)qmax;
        if (bad || (s != 0.0f && s < FLT_MIN)) return 1;
        scale[k] = s;
        float d = s == 0.0f ? 1.0f : s;
        const float *xb = x + lo;
        int8_t *o = qv + lo;
        for (int64_t i = 0; i < len; i++) o[i] = round_q(xb[i] / d);
    }
    if (bits == 4) {
        int64_t pairs = n / 2;
        for (int64_t i = 0; i < pairs; i++)
            out[i] = (uint8_t)((q[2 * i] & 0xF) | ((q[2 * i + 1] & 0xF) << 4));
        if (n & 1) out[pairs] = (uint8_t)(q[n - 1] & 0xF);
    } else if (bits == 2) {
        int64_t quads = n / 4;
        for (int64_t i = 0; i < quads; i++)
            out[i] = (uint8_t)((q[4 * i] & 3) | ((q[4 * i + 1] & 3) << 2) | ((q[4 * i + 2] & 3) << 4)
                               | ((q[4 * i + 3] & 3) << 6));
        if (n & 3) {
            uint8_t b = 0;
            for (int64_t e = quads * 4; e < n; e++) b |= (uint8_t)((q[e] & 3) << ((e & 3) * 2));
            out[quads] = b;
        }
    }
    return 0;
}

/* The levels of elements [lo, hi) (lo a multiple of 4) as floats into o (o[0] is element lo). */
static void unpack_levels(const uint8_t *in, int64_t lo, int64_t hi, int32_t bits, float *o) {
    if (bits == 4) {
        int64_t j0 = lo / 2, j1 = hi / 2;
        for (int64_t j = j0; j < j1; j++) {
            int32_t b = in[j];
            o[2 * (j - j0)] = (float)(((b & 0xF) ^ 8) - 8);
            o[2 * (j - j0) + 1] = (float)((((b >> 4) & 0xF) ^ 8) - 8);
        }
        if (hi & 1) o[hi - 1 - lo] = (float)(((in[hi / 2] & 0xF) ^ 8) - 8);
    } else {
        int64_t j0 = lo / 4, j1 = hi / 4;
        for (int64_t j = j0; j < j1; j++) {
            int32_t b = in[j];
            float *p = o + 4 * (j - j0);
            p[0] = (float)(((b & 3) ^ 2) - 2);
            p[1] = (float)((((b >> 2) & 3) ^ 2) - 2);
            p[2] = (float)((((b >> 4) & 3) ^ 2) - 2);
            p[3] = (float)((((b >> 6) & 3) ^ 2) - 2);
        }
        for (int64_t e = j1 * 4; e < hi; e++) o[e - lo] = (float)((((in[e / 4] >> ((e & 3) * 2)) & 3) ^ 2) - 2);
    }
}

/* Decode n values (bits 8: int8 bytes; 4: two's complement nibbles, element 2i low; 2: two's
 * complement 2-bit codes, element 4i+j in bits 2j..2j+1) times their block's scale into out:
 * the levels of a group of blocks, then each block scaled while the group is in the cache. */
void dl_dequantize(const uint8_t *in, int64_t n, int64_t bs, int32_t bits, const float *scale, float *out) {
    int64_t nblocks = (n + bs - 1) / bs;
    int64_t group = 4 * ((4096 + bs - 1) / bs); /* blocks per group: a multiple of 4, so each group
                                                   starts on a whole byte of every layout */
    for (int64_t k0 = 0; k0 < nblocks; k0 += group) {
        int64_t k1 = k0 + group < nblocks ? k0 + group : nblocks;
        int64_t lo = k0 * bs, hi = k1 * bs < n ? k1 * bs : n;
        if (bits == 8) {
            const int8_t *v = (const int8_t *)in;
            for (int64_t e = lo; e < hi; e++) out[e] = (float)v[e];
        } else {
            unpack_levels(in, lo, hi, bits, out + lo);
        }
        for (int64_t k = k0; k < k1; k++) {
            int64_t b0 = k * bs, b1 = b0 + bs < n ? b0 + bs : n;
            float s = scale[k];
            for (int64_t e = b0; e < b1; e++) out[e] *= s;
        }
    }
}
