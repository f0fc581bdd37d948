/* 8-float vectors and the exp the native kernels share (heads.c, decoder.c).

   GCC and Clang map v8 onto the machine's vector registers (one AVX register, or two SSE
   ones); loads through memcpy need no alignment. Each including file is compiled with its
   own flags (heads.c lets the compiler fuse multiply-adds, decoder.c does not), so the same
   code may round differently between them, never within one. */

#ifndef EDGEMTP_V8_H
#define EDGEMTP_V8_H

#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef uint32_t vu8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* x in every lane (a broadcast; "(v8){0} + x" costs an add and a shuffle, and turns -0 into
   +0) */
static inline v8 bcast8(float x) { return (v8){x, x, x, x, x, x, x, x}; }

static inline v8 max8(v8 a, v8 b) {  /* lanes of b where b > a, else a */
#ifdef __AVX__
    return __builtin_ia32_maxps256(b, a);  /* vmaxps b, a: b > a ? b : a, lane by lane */
#else
    vi8 m = b > a;
    return (v8)(((vi8)b & m) | ((vi8)a & ~m));
#endif
}

/* 2^t for t in [-126, 127] (t = x log2 e of e^x), to ~2e-7 relative: t split into an
   integer and a fraction in [-0.5, 0.5], the fraction by its Taylor polynomial (in decoder.c,
   built without contraction, products and sums round one by one: the same bits on every
   machine, with fused multiply-adds or without) */
static inline v8 vexp2_in(v8 t) {
    v8 r = (t + 12582912.0f) - 12582912.0f;
    v8 f = t - r;
    v8 p = f * 1.5403530393381606e-4f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.0f;
    vi8 n = __builtin_convertvector(r, vi8);
    return (v8)((vi8)p + (vi8)((vu8)n << 23));  /* n * 2^23 mod 2^32, by a shift */
}

/* e^x to ~2e-7 relative, 8 lanes at once, branch-free: x clamped to [-87, 88] */
static inline v8 vexp(v8 x) {
    v8 lo = x * 0.0f - 87.0f, hi = x * 0.0f + 88.0f;
    x = max8(lo, x);
    x = -max8(-hi, -x);
    return vexp2_in(x * 1.44269504088896341f);
}

/* e^x for x <= 0 (a softmax's x - max): vexp's bits there with one clamp rather than two
   (-inf gives e^-87 where vexp gives NaN: callers that meet it mask those lanes) */
static inline v8 vexp_neg(v8 x) {
    return vexp2_in(max8(bcast8(-87.0f), x) * 1.44269504088896341f);
}

static inline float fexp(float x) {  /* vexp on one lane (tails and scalars) */
    v8 r = vexp((v8){0} + x);
    return r[0];
}

static inline float sum8(v8 q) {
    return ((q[0] + q[4]) + (q[1] + q[5])) + ((q[2] + q[6]) + (q[3] + q[7]));
}

#endif
