/* A whole decoder step of an int4 package on the host CPU: the native backend
   (runtimes/native_backend.py).

   Why: onnxruntime's CPU kernels make a row's logits depend on the block it sits in (MLAS runs
   a one-row MatMulNBits through its own kernel), so the onnxruntime int4 package pays for an
   extra throwaway row every plain step and for exact attention sums spelled out in ~1400
   small nodes. Here every row is computed by the same instructions in the same order
   whatever block it sits in and whatever its place in it, so a row's logits are bitwise those
   of plain decoding of the same tokens, by construction:
   - the int4 matrix products quantize each activation row on its own (int8, blocks of 32, as
     onnxruntime's accuracy level 4) and sum integer dot products per block of 32 exactly,
     then the blocks' float terms in block order, one output column per lane;
   - attention: a row's keys are listed as the cache's rows then its ancestors in the block, in
     order, which is exactly the list plain decoding has once those ancestors are committed;
     every score is the same sequence of multiply-adds over the head dimension, softmax and
     p @ V run over the list in list order;
   - norms, rotary embedding, SiLU are per row.
   Built with -ffp-contract=off: the compiler fuses nothing, so a lane and a scalar tail
   compute the same; the only fused multiply-adds are the explicit ones in the int4 kernel.

   Weights (packed by runtimes/native_backend.py from the package's MatMulNBits initializers):
   a matrix [N, K] as groups of 16 output columns, blocks of 32 inputs: w [G][nb][4][64] bytes,
   in chunk c byte r*4+e holds input 8c+e of column 16g+r in its low nibble and 8c+4+e in its
   high one; scales [G][nb][16] float; zero points [G][nb][16] bytes. A column's value is
   sum over blocks of scale * a_scale * (sum_j q_j a_j - zp * sum_j a_j), plus, for a GGUF
   file's Q4_1 blocks (d q + m, kept as they are: export/gguf_blocks.py), m * a_scale *
   sum_j a_j, as llama.cpp's Q4_1 x Q8_1 dot product adds it.

   Cache (per session): keys in blocks of 16 positions, each block transposed,
   [L][H_kv][cap / 16][D][16] (a query's scores against 16 cached keys are two vectors of 8
   lanes, each summed over the head dimension in order), values [L][H_kv][D / 32][cap][32]
   (32-lane chunks, see vidx; [L][H_kv][cap][D] where 32 does not divide D; an int8 cache's
   rows in pairs within a chunk, see vidx8); a block's rows are written after the committed
   ones and commit() moves the accepted ones down. Keys and values are cached in half
   precision (IEEE binary16, F16C where the CPU has it), rounded to nearest even when their
   row is written, or as int8 codes with scales (see Cache). Over a half-float cache the
   attention's multiply-adds are fused (fma) in every path, vector or scalar, so a key's
   score and a value lane's sum are the same operations wherever they are computed; over an
   int8 cache scores and p @ V are exact integer sums (see the note on --kv-cache int8). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q4_VNNI 1
#endif
#if !defined(Q4_VNNI) && defined(__AVX2__) && defined(__FMA__)
#define Q4_AVX2 1  /* AVX2 without VNNI: AMD Zen 2/3, Intel Haswell to Comet Lake */
#endif
#if defined(Q4_VNNI) || defined(__FMA__) || defined(__F16C__)  /* (Q4_AVX2 implies FMA) */
#include <immintrin.h>
#endif
#if !defined(Q4_VNNI) && defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define Q4_SDOT 1  /* Armv8.2 dot products (Jetson Orin's Cortex-A78AE, Raspberry Pi 5) */
#include <arm_neon.h>
#endif

#include "v8.h"

#ifdef __AVX2__
/* acc + the pairwise int16 products of a and b summed into each 32-bit lane: one vpdpwssd
   where the CPU has AVX-512 VNNI with 256-bit forms (Zen 4, Ice Lake on) or AVX-VNNI (Alder
   Lake on), else vpmaddwd then vpaddd. The same exact integers either way (the sums an int8
   cache's kernels keep stay far inside int32: no wrap) */
static inline __attribute__((always_inline)) __m256i dpwssd8(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
#endif

#ifdef __AVX512F__
/* vexp_neg and vexp on 16 lanes: the same operations lane by lane, so the same bits as the
   8-lane forms (and as a build without AVX-512), one instruction where those take two: the
   exp's throughput bounds a softmax over a long list, the log-softmax over the vocabulary
   and SiLU */
static inline __m512 vexp2_in16(__m512 t) {
    __m512 r = _mm512_sub_ps(_mm512_add_ps(t, _mm512_set1_ps(12582912.0f)),
                             _mm512_set1_ps(12582912.0f));
    __m512 f = _mm512_sub_ps(t, r);
    __m512 p = _mm512_add_ps(_mm512_mul_ps(f, _mm512_set1_ps(1.5403530393381606e-4f)),
                             _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.0f));
    __m512i n = _mm512_cvtps_epi32(r);
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p),
                                                _mm512_slli_epi32(n, 23)));
}

static inline __m512 vexp16_neg(__m512 x) {
    return vexp2_in16(_mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)),
                                    _mm512_set1_ps(1.44269504088896341f)));
}

static inline __m512 vexp16(__m512 x) {  /* (finite x: vexp's clamps are these constants) */
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    return vexp2_in16(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)));
}

/* the low and the high 8 lanes of a 16-lane vector */
static inline v8 lo8(__m512 e) { return (v8)_mm512_castps512_ps256(e); }
static inline v8 hi8(__m512 e) {
    return (v8)_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1));
}

/* sum + the low 8 lanes of e, then + its high 8: an 8-lane accumulator's order over a list
   read 16 at a time */
static inline v8 add_halves(v8 sum, __m512 e) { return (sum + lo8(e)) + hi8(e); }
#endif

/* a * b + c rounded once, lane by lane (as fmaf) */
static inline v8 fma8(v8 a, v8 b, v8 c) {
#ifdef __FMA__
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    v8 r;
    for (int l = 0; l < 8; l++) r[l] = fmaf(a[l], b[l], c[l]);
    return r;
#endif
}

/* where key position p's dimension e sits in a head's block-transposed key cache */
static inline size_t kidx(int p, int e, int D) {
    return ((size_t)(p >> 4) * D + e) * 16 + (p & 15);
}
/* the same for an int8 key cache: blocks of 16 keys, in each the dimension pairs (e, e + 1)
   of the 16 keys side by side ([D / 2][16][2]), as one integer multiply-add of 16-bit pairs
   (vpmaddwd) takes them */
static inline size_t kidx8(int p, int e, int D) {
    return ((size_t)(p >> 4) * D + (e & ~1)) * 16 + (size_t)(p & 15) * 2 + (e & 1);
}

/* where value position p's lane e sits in a head's value cache: lanes in chunks of 32 (vw),
   each chunk its own [cap][32] run, so attend_groups' pass over 32 lanes of every position
   streams whole cache lines. With rows of all D lanes it read every other line of a 64-lane
   row, and its p @ V ran at half the speed of the scores over the same bytes. SmolLM2 int4,
   P = 2000, 2 threads, each build in its own process, alternated 3 times: p @ V 1.58-1.88 ->
   0.83-0.90 ms a step, the step 5.85-6.06 -> 4.89-5.20 ms. A head dimension that 32 does
   not divide keeps whole rows (vw = D). */
static inline int vw(int D) { return D % 32 == 0 ? 32 : D; }
static inline size_t vidx(int p, int e, int D, int cap) {
    const int w = vw(D);
    return ((size_t)(e / w) * cap + p) * w + e % w;
}
/* the same for an int8 value cache: in each chunk the rows go in pairs (p, p + 1), p even,
   lane by lane side by side ([cap / 2][w][2]), as one integer multiply-add of 16-bit pairs
   takes two rows' lanes (see pv_int) */
static inline size_t vidx8(int p, int e, int D, int cap) {
    const int w = vw(D);
    return (size_t)(e / w) * cap * w + (size_t)(p & ~1) * w + (size_t)(e % w) * 2 + (p & 1);
}


/* an int4 matrix in groups of 16 columns, blocks of 32 inputs: w [G][nb][256] nibbles,
   zp [G][nb][16] zero points, and the scales [G][nb][16] as floats (sc) or, where every one
   is a half-precision value (an export since they are rounded so, as GGUF's blocks keep
   theirs), as halves (sc16, sc NULL): a block then takes 304 bytes rather than 336 (SmolLM2
   int4, 2 threads, a 2-core Zen 3, one package held both ways in one process, alternated
   forward by forward, 25 pairs: t(1) 0.94x, 0.97x, 0.96x at P = 64, 700, 2000; t(2)
   0.96-0.98x; blocks of 4+ rows, bound by their products, within 2 %). The half is
   converted exactly, so both give the same bits.
   A GGUF file's Q4_1 blocks (d q + m) come with their offsets m [G][nb][16] as halves (mn16)
   and no zero points (zp NULL: 0); a block then takes 320 bytes. Each row-block adds
   fma(m, a_scale * sum_j a_j, f) after its scaled integer sum.
   An 8-bit matrix (bits 8: a GGUF file's Q8_0 LM head, u = q + 128, zero point 128) is one
   plane of bytes, [G][nb][8][16][4]: in chunk k, bytes r*4 .. r*4 + 3 hold inputs 4k .. 4k + 3
   of column 16g + r; its zero points are 128 where zp is NULL. A row-block's integer sum
   sum_j u_j a_j - z sum_j a_j is exact in every kernel (AVX-512 VNNI: 8 vpdpbusd a block; the
   others add their nibbles' sums as lo + 16 hi in int32, or, with Arm's signed dot product,
   sum (u - 128) a), then scaled once, as a 4-bit block is. Until 2026-11-28 it was two 4-bit
   planes (the low nibbles, then the high ones at 16 times the scale) with a scaled float sum
   each: 16 products a block and their unpacking where VNNI now takes 8. */
typedef struct Q4W {
    int G, nb;
    const uint8_t *w;
    const float *sc;
    const uint8_t *zp;                      /* NULL: every zero point 0 */
    const uint16_t *sc16;
    const uint16_t *mn16;                   /* NULL: no offsets */
    int bits;                               /* 4 (or 0), or 8: one plane of bytes (above) */
} Q4W;

typedef struct {
    int L, d, H, Hkv, D, F, V, rope_rows, threads;
    float eps, scale;
    const float *cos, *sin;                 /* [rope_rows][D/2] */
    const float *norm_in, *norm_post;       /* [L][d] */
    const float *norm_final;                /* [d] */
    const Q4W *qkv, *o, *gu, *down;         /* [L] each */
    const Q4W *lm;
    const uint8_t *emb_q;                   /* [V][ceil(d/32)*16], onnxruntime's int4 layout
                                               (emb_bits 8: [V][ceil(d/32)*32], a byte each) */
    const float *emb_sc;                    /* [V][ceil(d/32)] */
    const uint8_t *emb_zp;                  /* [V][ceil(ceil(d/32)/2)] or NULL (8); emb_bits
                                               8: [V][ceil(d/32)] or NULL (128) */
    const float *qkv_bias;                  /* [L][(H + 2 Hkv) D] or NULL (Qwen2) */
    const float *q_norm, *k_norm;           /* [L][D] each or NULL: RMSNorm per head of q
                                               and k before the rotary embedding (Qwen3) */
    int emb_bits;                           /* 4, or 8 (a GGUF file's Q8_0 table); 0: 4;
                                               32: an untied model's float32 rows [V][d] in
                                               emb_q (emb_sc, emb_zp unused) */
} Model;

/* the K/V cache holds half-precision values (as llama.cpp's default cache): half the bytes
   a long context's attention reads; a value is rounded once, when its row is written */
typedef uint16_t kv_t;  /* IEEE binary16 bits */
#ifdef __F16C__
static inline v8 loadh8(const kv_t *p) {
    return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline float h2f(kv_t h) { return _cvtsh_ss(h); }
static inline kv_t f2h(float f) { return _cvtss_sh(f, 0); }  /* round to nearest even */
#else
static inline float h2f(kv_t h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
static inline kv_t f2h(float f) { _Float16 x = (_Float16)f; kv_t h; memcpy(&h, &x, 2); return h; }
static inline v8 loadh8(const kv_t *p) {
    v8 r;
    for (int l = 0; l < 8; l++) r[l] = h2f(p[l]);
    return r;
}
#endif

/* --kv-cache int8 (as llama.cpp's q8_0 cache, half the bytes again): a key row is stored as
   int8 with one scale per KV head (ks [L][H_kv][cap]: amax / 127, the row rounded to nearest),
   a value row as int8 with one scale per 32-lane chunk (vs [L][H_kv][D / 32][cap]). A row is
   quantized once, from its own values only, when it is written, so plain decoding and a
   block see the same int8 rows. Scores are integer dot products: the query row (one head)
   is rounded to int16 with its own scale qs (amax / 32767, q_pairs), and a key's score is
   ((float)(sum over e of q16[e] * k8[e]) * ks) * (qs * scale). The sum is exact in int32
   (|sum| <= D * 32767 * 127 < 2^31 for D <= 256), so it is the same number whatever order or
   kernel computes it: no chain order to keep, and integer multiply-adds of 16-bit pairs
   (AVX2's vpmaddwd) do 16 products a cycle where the float chains did 8 and converted every
   code first. p @ V is integer too (pv_int): each row's weight times its chunk's value scale,
   p * vs, is rounded to int16 with the list's own scale (amax / 32767, pv_weights), value
   rows are stored in pairs (vidx8), and vpmaddwd sums two rows' products a lane at once into
   int32, exact, flushed to a float sum every PV_FLUSH list entries (f + (float)sum * ws);
   the output is f * (1 / sum of weights). Only the flush points and the float operations
   fix the bits, and they are the same in every path. */

/* the address of element i of a cache array of half floats (q8 = 0) or int8 (q8 = 1) */
static inline const void *kv_at(const void *base, size_t i, const int q8) {
    return (const char *)base + i * (q8 ? 1 : 2);
}

/* the largest magnitude of n values */
static float amax(const float *x, int n) {
    float m = 0.f;
    for (int e = 0; e < n; e++) m = fabsf(x[e]) > m ? fabsf(x[e]) : m;
    return m;
}

/* the int8 scale of n values: amax / 127 (0 for a zero row, whose codes are 0) */
static float q8_scale(const float *x, int n) { return amax(x, n) / 127.f; }
static inline int8_t q8_code(float x, float s) {
    if (s == 0.f) return 0;
    long q = lrintf(x / s);
    return (int8_t)(q > 127 ? 127 : q < -127 ? -127 : q);
}

typedef struct {
    void *k, *v;        /* half floats, or int8 codes where ks is set */
    int cap, len;
    float *ks, *vs;     /* NULL: a half-float cache; else the int8 cache's scales */
} Cache;

typedef struct {
    int T, topk, rows_from;                 /* rows < rows_from: no LM head */
    const int64_t *ids, *pos;
    const uint8_t *mask;                    /* [T][T] */
    const float *mask_embeds; int n_mask;   /* [n_mask][d] */
    int64_t *argmax, *topk_ids;             /* [T], [T][topk] */
    float *topk_lp, *logits, *hidden;       /* [T][topk], [T][V] or NULL, [T][d] or NULL */
} Call;

#define LM_ROWS 16  /* rows of logits computed at once (bounds the scratch for a prefill) */

static int pad32(int k) { return (k + 31) / 32 * 32; }
static size_t pad8(size_t k) { return (k + 7) / 8 * 8; }

/* ---- int8 activations, per row and block of 32 ---- */
static void quant_row(const float *x, int K, int8_t *aq, float *as, int32_t *asum) {
    int nb = (K + 31) / 32;
    for (int b = 0; b < nb; b++) {
        int n = K - 32 * b < 32 ? K - 32 * b : 32;
        const float *xb = x + 32 * b;
#ifdef __AVX2__
        if (n == 32) {  /* the same bits as the loop below: a maximum is exact in any order,
                           the products are the same, vcvtps2dq rounds to nearest even as
                           rintf does, and every code is within +-127 (no saturation) */
            const __m256 sign = _mm256_set1_ps(-0.f);
            const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
            const __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
            __m256 mv = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
            const float amax = _mm_cvtss_f32(h);
            const __m256 iv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
            const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, iv));
            const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, iv));
            const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, iv));
            const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, iv));
            const __m256i pk = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
            _mm256_storeu_si256((__m256i *)(aq + 32 * b),
                                _mm256_permutevar8x32_epi32(pk, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
            const __m256i sv = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sv), _mm256_extracti128_si256(sv, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
            as[b] = amax / 127.f;
            asum[b] = _mm_cvtsi128_si32(s4);
            continue;
        }
#endif
        float amax = 0.f;
        for (int j = 0; j < n; j++) { float a = fabsf(xb[j]); amax = a > amax ? a : amax; }
        float inv = amax > 0.f ? 127.f / amax : 0.f;
        int8_t *q = aq + 32 * b;
        int s = 0;
        for (int j = 0; j < 32; j++) {
            int v = j < n ? (int)rintf(xb[j] * inv) : 0;
            q[j] = (int8_t)v;
            s += v;
        }
        as[b] = amax / 127.f;
        asum[b] = s;
    }
}

/* rows of a block whose products share one unpacking of a weight block: 8 with AVX-512
   VNNI (32 vector registers hold 8 rows' sums and the unpacked block; SmolLM2, 2 threads:
   unpacking again for rows 5-8 had made t(5) - t(4) = 1.9 ms against ~0.6 ms a row) and
   with AVX2 (SmolLM2 on a 2-core AMD EPYC: t(8) 12.3-12.8 ms with 4, 11.2-11.3 with 8), else
   4. VNNI since 2026-11-28: 16 (blocks over 4 rows keep their sums in memory anyway, so a
   wider tile only unpacks each weight block for more rows: on a 2-core Zen 4, paired in one
   process against 8, t(10) 0.98x, t(16) 0.96x, t(30) 0.96x, t(60) 0.98x, t(128) 0.97x,
   t(8) 1.00x; 32 rows: no better than 16; two 4-row groups with their sums in registers,
   each unpacking the block: 1.08-1.14x slower) */
#if defined(Q4_VNNI)
#define Q4_TILE 16
#elif defined(Q4_AVX2)
#define Q4_TILE 8
#else
#define Q4_TILE 4
#endif

#ifdef Q4_AVX2
/* rn (<= Q4_ROWS, a constant where inlined) rows of one unpacked weight block u (16 columns
   in two halves of 8, 32 inputs): each u[h][k] loaded once for all rn rows, each row's two
   int16 sums a chain in one register. The zero point's product z * asum is a vpmaddwd of
   (z, 0) by asum's low half (|asum| <= 32 * 127 fits int16), exactly vpmulld's int32 at a
   third of its cost. The same integers and float operations, in the same order, as a row
   taken alone: the same bits. SmolLM2 int4, 2 threads, a 2-core Zen 3, both builds in one
   process alternated forward by forward (15 pairs, P = 64): t(4) 0.95x, t(8) 0.90x, t(10)
   0.91x, t(16) 0.89x, t(1) 0.99x, against one row at a time over the 8-row tile (which
   reloaded the 16 spilled u vectors for every row) */
#define Q4_ROWS 4
/* a row's two int16 sums of one weight block into its 16 float columns f[0], f[1]: to
   32-bit lanes, less zero point x the row's sum, times scale x the row's scale, plus a GGUF
   Q4_1 block's offsets x the row's scale x its sum */
static inline __attribute__((always_inline)) void q4_fin32_avx2(
        __m256i c0, __m256i c1, __m256i z0, __m256i z1, __m256 s0, __m256 s1, float sav,
        int32_t smv, __m256 *f, const int mins, const int zps, __m256 n0, __m256 n1) {
    const __m256 sa = _mm256_set1_ps(sav);
    if (zps) {  /* (a plane without zero points, zp NULL, subtracts nothing: 4 of the ~20
                   instructions a row-block's sums take to finish) */
        const __m256i sm = _mm256_set1_epi32(smv);
        c0 = _mm256_sub_epi32(c0, _mm256_madd_epi16(z0, sm));
        c1 = _mm256_sub_epi32(c1, _mm256_madd_epi16(z1, sm));
    }
    f[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c0), _mm256_mul_ps(s0, sa), f[0]);
    f[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c1), _mm256_mul_ps(s1, sa), f[1]);
    if (mins) {
        const __m256 xs = _mm256_set1_ps(sav * (float)smv);
        f[0] = _mm256_fmadd_ps(n0, xs, f[0]);
        f[1] = _mm256_fmadd_ps(n1, xs, f[1]);
    }
}
static inline __attribute__((always_inline)) void q4_fin_avx2(
        __m256i acc0, __m256i acc1, __m256i z0, __m256i z1, __m256 s0, __m256 s1, float sav,
        int32_t smv, __m256 *f, const int mins, const int zps, __m256 n0, __m256 n1) {
    const __m256i ones = _mm256_set1_epi16(1);
    q4_fin32_avx2(_mm256_madd_epi16(acc0, ones), _mm256_madd_epi16(acc1, ones), z0, z1, s0, s1,
                  sav, smv, f, mins, zps, n0, n1);
}
static inline __attribute__((always_inline)) void q4_rows_avx2(
        const int rn, const __m256i u[2][8], const int8_t *a, int Kp, __m256i z0, __m256i z1,
        __m256 s0, __m256 s1, const float *asb, const int32_t *smb, int nb, int t,
        __m256 (*f)[2], const int mins, const int zps, __m256 n0, __m256 n1) {
    __m256i acc[Q4_ROWS][2];
    for (int r = 0; r < rn; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int k = 0; k < 8; k++) {
        const __m256i w0 = u[0][k], w1 = u[1][k];
        for (int r = 0; r < rn; r++) {
            int32_t ak;
            memcpy(&ak, a + (size_t)r * Kp + 4 * k, 4);
            const __m256i x = _mm256_set1_epi32(ak);
            acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(w0, x));
            acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(w1, x));
            /* keeps each sum a chain in one register: left free, the compiler computes
               every product first and spills them */
            __asm__("" : "+x"(acc[r][0]), "+x"(acc[r][1]));
        }
    }
    for (int r = 0; r < rn; r++)
        q4_fin_avx2(acc[r][0], acc[r][1], z0, z1, s0, s1, asb[(size_t)(t + r) * nb],
                    smb[(size_t)(t + r) * nb], f[r], mins, zps, n0, n1);
}

/* column group g's block b of plane p: its 16 scales, zero points (0 where the plane has
   none) and, for a GGUF file's Q4_1 blocks, offsets (else 0), two 8-lane halves each */
static inline __attribute__((always_inline)) void q4_block_consts(
        const Q4W *p, int g, int nb, int b, __m256i *z0, __m256i *z1, __m256 *s0, __m256 *s1,
        __m256 *n0, __m256 *n1) {
    const size_t so = ((size_t)g * nb + b) * 16;
    if (p->sc16) {
        *s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p->sc16 + so)));
        *s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p->sc16 + so + 8)));
    } else {
        *s0 = _mm256_loadu_ps(p->sc + so);
        *s1 = _mm256_loadu_ps(p->sc + so + 8);
    }
    const __m128i zz = p->zp ? _mm_loadu_si128((const __m128i *)(p->zp + so))
                     : p->bits == 8 ? _mm_set1_epi8((char)128) : _mm_setzero_si128();
    *z0 = _mm256_cvtepu8_epi32(zz);
    *z1 = _mm256_cvtepu8_epi32(_mm_srli_si128(zz, 8));
    *n0 = *n1 = _mm256_setzero_ps();
    if (p->mn16) {
        *n0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p->mn16 + so)));
        *n1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p->mn16 + so + 8)));
    }
}

/* rn (<= Q4_ROWS, a constant where inlined) rows of one weight block, unpacked as it is
   used: a block of at most Q4_ROWS rows (plain decoding, a prefill's last row's head, small
   trees) has no second row group to share the unpacked block with, and the 16 vectors kept
   for q4_rows_avx2 do not fit the 16 AVX registers beside the sums, so the compiler stored
   and reloaded them every block. The same integer sums (exact in int16, in any order) and
   the same float operations: the same bits. SmolLM2 GGUF int4, 2 threads, a 2-core Zen 3,
   both paths in one process alternated forward by forward: t(1) 0.93x at P = 64 and at
   P = 700 (200 pairs; a first version whose products the compiler still spilled: 0.98x),
   t(2) 0.93x, t(3) 0.93x, t(4) 0.90x (100 pairs). Blocks of 5-8 rows unpacking twice this
   way rather than once into the spilled vectors: 0.98-1.02x, so they keep q4_rows_avx2 */
static inline __attribute__((always_inline)) void q4_rowsn_avx2(
        const int rn, const uint8_t *wb, const int8_t *a, int Kp, __m256i z0, __m256i z1,
        __m256 s0, __m256 s1, const float *asb, const int32_t *smb, int nb, int t,
        __m256 (*f)[2], const int mins, const int zps, __m256 n0, __m256 n1) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i acc[Q4_ROWS][2];
    for (int r = 0; r < rn; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)(wb + 64 * c));
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(wb + 64 * c + 32));
        const __m256i l0 = _mm256_and_si256(v0, m4), l1 = _mm256_and_si256(v1, m4);
        const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
        const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
        for (int r = 0; r < rn; r++) {
            int32_t al, ah;
            memcpy(&al, a + (size_t)r * Kp + 8 * c, 4);
            memcpy(&ah, a + (size_t)r * Kp + 8 * c + 4, 4);
            const __m256i xl = _mm256_set1_epi32(al), xh = _mm256_set1_epi32(ah);
            acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(l0, xl));
            acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(l1, xl));
            acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(h0, xh));
            acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(h1, xh));
            __asm__("" : "+x"(acc[r][0]), "+x"(acc[r][1]));  /* (no spilled products) */
        }
    }
    for (int r = 0; r < rn; r++)
        q4_fin_avx2(acc[r][0], acc[r][1], z0, z1, s0, s1, asb[(size_t)(t + r) * nb],
                    smb[(size_t)(t + r) * nb], f[r], mins, zps, n0, n1);
}

/* an 8-bit block (bits 8) for rn (<= 2, a constant where inlined) rows: each byte split into
   its nibbles as it is used, each nibble plane's products summed in int16 (8 pairs of a nibble
   and an int8: |sum| <= 30480, exact), then c = lo + 16 hi in int32 lanes: sum_j u_j a_j
   exactly, for q4_fin32_avx2. Two rows at a time: their 8 sums and the 4 nibble vectors fit
   the 16 AVX registers */
static inline __attribute__((always_inline)) void q8_rows_avx2(
        const int rn, const uint8_t *wb, const int8_t *a, int Kp, __m256i (*c)[2]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i lo[2][2], hi[2][2];
    for (int r = 0; r < rn; r++) lo[r][0] = lo[r][1] = hi[r][0] = hi[r][1] = _mm256_setzero_si256();
    for (int k = 0; k < 8; k++) {
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)(wb + 64 * k));
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(wb + 64 * k + 32));
        const __m256i l0 = _mm256_and_si256(v0, m4), l1 = _mm256_and_si256(v1, m4);
        const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
        const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
        for (int r = 0; r < rn; r++) {
            int32_t ak;
            memcpy(&ak, a + (size_t)r * Kp + 4 * k, 4);
            const __m256i x = _mm256_set1_epi32(ak);
            lo[r][0] = _mm256_add_epi16(lo[r][0], _mm256_maddubs_epi16(l0, x));
            lo[r][1] = _mm256_add_epi16(lo[r][1], _mm256_maddubs_epi16(l1, x));
            hi[r][0] = _mm256_add_epi16(hi[r][0], _mm256_maddubs_epi16(h0, x));
            hi[r][1] = _mm256_add_epi16(hi[r][1], _mm256_maddubs_epi16(h1, x));
            __asm__("" : "+x"(lo[r][0]), "+x"(lo[r][1]), "+x"(hi[r][0]), "+x"(hi[r][1]));
        }
    }
    const __m256i ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
    for (int r = 0; r < rn; r++)
        for (int h = 0; h < 2; h++)
            c[r][h] = _mm256_add_epi32(_mm256_madd_epi16(lo[r][h], ones),
                                       _mm256_madd_epi16(hi[r][h], sixteen));
}
#endif

#ifdef Q4_VNNI
/* weight block b of column group g of plane p, 4 KB on prefetched (the hardware prefetcher
   stops at each 4 KB page; see the AVX2 kernel's note below): its nibbles as 8 vectors of
   bytes, its 16 scales, zero points (0 without) and a GGUF Q4_1 block's offsets (0 without) */
static inline __attribute__((always_inline)) void q4_block_vnni(
        const Q4W *p, int g, int nb, int b, __m512i u[8], __m512 *s, __m512i *z, __m512 *mn) {
    if (p->bits == 8) {  /* bytes [8][16][4]: u[k] lane r = inputs 4k .. 4k + 3 of column r */
        const uint8_t *wb = p->w + ((size_t)g * nb + b) * 512;
        for (int c = 0; c < 512; c += 64) __builtin_prefetch(wb + 4096 + c, 0, 0);
        for (int k = 0; k < 8; k++) u[k] = _mm512_loadu_si512(wb + 64 * k);
    } else {
        const uint8_t *wb = p->w + ((size_t)g * nb + b) * 256;
        for (int c = 0; c < 256; c += 64) __builtin_prefetch(wb + 4096 + c, 0, 0);
        const __m512i m4 = _mm512_set1_epi8(0x0F);
        for (int c = 0; c < 4; c++) {
            __m512i v = _mm512_loadu_si512(wb + 64 * c);
            u[2 * c] = _mm512_and_si512(v, m4);
            u[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        }
    }
    const size_t so = ((size_t)g * nb + b) * 16;
    *s = p->sc16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p->sc16 + so)))
                 : _mm512_loadu_ps(p->sc + so);
    *z = p->zp ? _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p->zp + so)))
               : _mm512_setzero_si512();
    *mn = p->mn16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p->mn16 + so)))
                  : _mm512_setzero_ps();
}

/* rn (<= 4, a constant where inlined) rows t0.. of column group g: each weight block
   unpacked once for all rn rows. A constant row count keeps the rows' sums in registers (a
   variable one had them stored and reloaded every block); a plane without zero points (a
   GGUF's Q4_1 blocks, the low plane of its 8-bit head) subtracts no z x asum product. The
   same integers and the same float operations in the same order: the same bits */
static inline __attribute__((always_inline)) void q4_tile_vnni(
        const int rn, const Q4W *m, int g, int nb, int t0, const int8_t *aq, const float *as,
        const int32_t *asum, float *y, int ldy) {
    const int Kp = nb * 32;
    __m512 f[Q4_TILE];
    for (int i = 0; i < rn; i++) f[i] = _mm512_setzero_ps();
    {
        const Q4W *p = m;
        const int zps = p->zp != NULL ? 1 : p->bits == 8 ? 2 : 0, mins = p->mn16 != NULL;
        for (int b = 0; b < nb; b++) {
            __m512i u[8], z;
            __m512 s, mn;
            q4_block_vnni(p, g, nb, b, u, &s, &z, &mn);
            for (int i = 0; i < rn; i++) {
                const int t = t0 + i;
                const int32_t *a = (const int32_t *)(aq + (size_t)t * Kp + b * 32);
                __m512i acc = _mm512_setzero_si512(), acc2 = _mm512_setzero_si512();
                for (int k = 0; k < 8; k += 2) {
                    acc = _mm512_dpbusd_epi32(acc, u[k], _mm512_set1_epi32(a[k]));
                    acc2 = _mm512_dpbusd_epi32(acc2, u[k + 1], _mm512_set1_epi32(a[k + 1]));
                }
                acc = _mm512_add_epi32(acc, acc2);
                const float sa = as[t * nb + b];
                const int32_t sm = asum[t * nb + b];
                if (zps == 1)
                    acc = _mm512_sub_epi32(acc, _mm512_mullo_epi32(z, _mm512_set1_epi32(sm)));
                else if (zps == 2)
                    acc = _mm512_sub_epi32(acc, _mm512_set1_epi32(sm * 128));
                f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc),
                                       _mm512_mul_ps(s, _mm512_set1_ps(sa)), f[i]);
                if (mins)
                    f[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sa * (float)sm), f[i]);
            }
        }
    }
    for (int i = 0; i < rn; i++) _mm512_storeu_ps(y + (size_t)(t0 + i) * ldy + 16 * g, f[i]);
}
#endif

/* y[t][n] for t < T of the int4 matrix m, columns split among the team's threads: guided,
   so each thread still streams long runs of the weights but the last chunks go to whichever
   core is ahead (a VM's two vCPUs are rarely equally fast: 15 % of a plain step was spent
   waiting at barriers). Which thread computes a column changes no bit of it. SmolLM2 int4,
   2 threads, a 2-core Zen 3, both builds in one process alternated forward by forward (25
   pairs, paired medians): P = 64 t(1) 1.01x, t(2) 0.97x, t(4) 0.95x, t(8) 0.94x; P = 700
   0.95-0.99x; P = 2000 0.95-0.99x; dynamic chunks of 4 were 1.07-1.33x slower */
static void q4_gemm(const Q4W *m, int T, const int8_t *aq, const float *as, const int32_t *asum,
                    float *y, int ldy) {
    const int nb = m->nb, Kp = nb * 32;
#pragma omp for schedule(guided)
    for (int g = 0; g < m->G; g++) {
        for (int t0 = 0; t0 < T; t0 += Q4_TILE) {
            int tn = T - t0 < Q4_TILE ? T - t0 : Q4_TILE;
#ifdef Q4_VNNI
            if (tn <= 4) {  /* the row count a constant (see q4_tile_vnni) */
                switch (tn) {
                case 1: q4_tile_vnni(1, m, g, nb, t0, aq, as, asum, y, ldy); break;
                case 2: q4_tile_vnni(2, m, g, nb, t0, aq, as, asum, y, ldy); break;
                case 3: q4_tile_vnni(3, m, g, nb, t0, aq, as, asum, y, ldy); break;
                default: q4_tile_vnni(4, m, g, nb, t0, aq, as, asum, y, ldy); break;
                }
                continue;
            }
            /* 5-16 rows: the same, the rows' sums in memory (the constant-count version of
               this loop measured 1.03-1.05x slower at t(8) and t(16) on a 2-core Zen 4) */
            __m512 f[Q4_TILE];
            for (int i = 0; i < Q4_TILE; i++) f[i] = _mm512_setzero_ps();
            const Q4W *p = m;
            for (int b = 0; b < nb; b++) {
                __m512i u[8], z;
                __m512 s, mn;
                const int zps = p->zp != NULL ? 1 : p->bits == 8 ? 2 : 0, mins = p->mn16 != NULL;
                q4_block_vnni(p, g, nb, b, u, &s, &z, &mn);
                for (int i = 0; i < tn; i++) {
                    int t = t0 + i;
                    const int32_t *a = (const int32_t *)(aq + (size_t)t * Kp + b * 32);
                    __m512i acc = _mm512_setzero_si512(), acc2 = _mm512_setzero_si512();
                    for (int k = 0; k < 8; k += 2) {
                        acc = _mm512_dpbusd_epi32(acc, u[k], _mm512_set1_epi32(a[k]));
                        acc2 = _mm512_dpbusd_epi32(acc2, u[k + 1], _mm512_set1_epi32(a[k + 1]));
                    }
                    acc = _mm512_add_epi32(acc, acc2);
                    if (zps == 1)
                        acc = _mm512_sub_epi32(acc, _mm512_mullo_epi32(z, _mm512_set1_epi32(asum[t * nb + b])));
                    else if (zps == 2)
                        acc = _mm512_sub_epi32(acc, _mm512_set1_epi32(asum[t * nb + b] * 128));
                    __m512 fi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc),
                                                _mm512_mul_ps(s, _mm512_set1_ps(as[t * nb + b])), f[i]);
                    if (mins)
                        fi = _mm512_fmadd_ps(mn, _mm512_set1_ps(as[t * nb + b]
                                                                * (float)asum[t * nb + b]), fi);
                    f[i] = fi;
                }
            }
            for (int i = 0; i < tn; i++) _mm512_storeu_ps(y + (size_t)(t0 + i) * ldy + 16 * g, f[i]);
#elif defined(Q4_AVX2)
            if (m->bits == 8) {  /* one plane of bytes, rows two at a time (q8_rows_avx2) */
                __m256 fr[Q4_TILE][2];
                for (int i = 0; i < tn; i++) fr[i][0] = fr[i][1] = _mm256_setzero_ps();
                for (int b = 0; b < nb; b++) {
                    const uint8_t *wb = m->w + ((size_t)g * nb + b) * 512;
                    for (int c = 0; c < 512; c += 64) __builtin_prefetch(wb + 4096 + c, 0, 0);
                    __m256i z0, z1;
                    __m256 s0, s1, n0, n1;
                    q4_block_consts(m, g, nb, b, &z0, &z1, &s0, &s1, &n0, &n1);
                    for (int i0 = 0; i0 < tn; i0 += 2) {
                        const int8_t *a = aq + (size_t)(t0 + i0) * Kp + b * 32;
                        __m256i c[2][2];
                        const int rn = tn - i0 < 2 ? 1 : 2;
                        if (rn == 2) q8_rows_avx2(2, wb, a, Kp, c);
                        else q8_rows_avx2(1, wb, a, Kp, c);
                        for (int r = 0; r < rn; r++) {
                            const int t = t0 + i0 + r;
                            q4_fin32_avx2(c[r][0], c[r][1], z0, z1, s0, s1, as[(size_t)t * nb + b],
                                          asum[(size_t)t * nb + b], fr[i0 + r], 0, 1, n0, n1);
                        }
                    }
                }
                for (int i = 0; i < tn; i++) {
                    _mm256_storeu_ps(y + (size_t)(t0 + i) * ldy + 16 * g, fr[i][0]);
                    _mm256_storeu_ps(y + (size_t)(t0 + i) * ldy + 16 * g + 8, fr[i][1]);
                }
                continue;
            }
            /* each half h of a chunk holds 8 columns' 32-bit lanes; _mm256_maddubs_epi16
               multiplies the unsigned nibbles by the int8 activations and adds neighbouring
               pairs into int16 (|15 * 127 * 2| = 3810: exact), eight of those summed stay
               exact in int16 (30480 < 32767), and _mm256_madd_epi16 by ones adds the pairs
               into the 32-bit lane: the same integer sum as the VNNI kernel's */
            if (tn <= Q4_ROWS) {  /* one row group: its sums stay in registers */
                __m256 fr[Q4_ROWS][2];
                for (int i = 0; i < tn; i++) fr[i][0] = fr[i][1] = _mm256_setzero_ps();
                const int8_t *a = aq + (size_t)t0 * Kp;
                const Q4W *p = m;
                for (int b = 0; b < nb; b++) {
                    const uint8_t *wb = p->w + ((size_t)g * nb + b) * 256;
                    for (int c = 0; c < 256; c += 64) __builtin_prefetch(wb + 4096 + c, 0, 0);
                    __m256i z0, z1;
                    __m256 s0, s1, n0, n1;
                    q4_block_consts(p, g, nb, b, &z0, &z1, &s0, &s1, &n0, &n1);
                    const int mins = p->mn16 != NULL, zps = p->zp != NULL;
#define Q4_SMALL(rn) q4_rowsn_avx2(rn, wb, a + b * 32, Kp, z0, z1, s0, s1, as + b, asum + b, \
                                   nb, t0, fr, mins, zps, n0, n1)
                    switch (tn) {
                    case 1: Q4_SMALL(1); break;
                    case 2: Q4_SMALL(2); break;
                    case 3: Q4_SMALL(3); break;
                    default: Q4_SMALL(4); break;
                    }
#undef Q4_SMALL
                }
                for (int i = 0; i < tn; i++) {
                    _mm256_storeu_ps(y + (size_t)(t0 + i) * ldy + 16 * g, fr[i][0]);
                    _mm256_storeu_ps(y + (size_t)(t0 + i) * ldy + 16 * g + 8, fr[i][1]);
                }
                continue;
            }
            const __m256i m4 = _mm256_set1_epi8(0x0F);
            __m256 f[Q4_TILE][2];
            for (int i = 0; i < Q4_TILE; i++) f[i][0] = f[i][1] = _mm256_setzero_ps();
            const Q4W *p = m;
            for (int b = 0; b < nb; b++) {
                const uint8_t *wb = p->w + ((size_t)g * nb + b) * 256;
                /* the block 4 KB on in this thread's run of the weights: the hardware
                   prefetcher stops at each 4 KB page, so a one-row step streamed the weights
                   at ~17 GB/s of this machine's 31-40. SmolLM2 int4, 2 threads, a 2-core Zen 3,
                   both builds in one process alternated forward by forward (25 pairs):
                   t(1) 0.84-0.88x, t(4) 0.89-0.91x, t(10) 0.96x; 1, 4 or 8 KB ahead and
                   either cache hint alike within 5 % */
                for (int c = 0; c < 256; c += 64) __builtin_prefetch(wb + 4096 + c, 0, 0);
                __m256i z0, z1;
                __m256 s0, s1, n0, n1;
                q4_block_consts(p, g, nb, b, &z0, &z1, &s0, &s1, &n0, &n1);
                const int mins = p->mn16 != NULL, zps = p->zp != NULL;
                const float *asb = as + b;
                const int32_t *smb = asum + b;
                __m256i u[2][8];
                for (int h = 0; h < 2; h++)
                    for (int c = 0; c < 4; c++) {
                        __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 64 * c + 32 * h));
                        u[h][2 * c] = _mm256_and_si256(v, m4);
                        u[h][2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    }
                for (int i0 = 0; i0 < tn; i0 += Q4_ROWS) {
                    const int8_t *a = aq + (size_t)(t0 + i0) * Kp + b * 32;
                    switch (tn - i0 < Q4_ROWS ? tn - i0 : Q4_ROWS) {
                    case 1: q4_rows_avx2(1, u, a, Kp, z0, z1, s0, s1, asb, smb, nb, t0 + i0, f + i0, mins, zps, n0, n1); break;
                    case 2: q4_rows_avx2(2, u, a, Kp, z0, z1, s0, s1, asb, smb, nb, t0 + i0, f + i0, mins, zps, n0, n1); break;
                    case 3: q4_rows_avx2(3, u, a, Kp, z0, z1, s0, s1, asb, smb, nb, t0 + i0, f + i0, mins, zps, n0, n1); break;
                    default: q4_rows_avx2(4, u, a, Kp, z0, z1, s0, s1, asb, smb, nb, t0 + i0, f + i0, mins, zps, n0, n1); break;
                    }
                }
            }
            for (int i = 0; i < tn; i++) {
                _mm256_storeu_ps(y + (size_t)(t0 + i) * ldy + 16 * g, f[i][0]);
                _mm256_storeu_ps(y + (size_t)(t0 + i) * ldy + 16 * g + 8, f[i][1]);
            }
#elif defined(Q4_SDOT)
            /* a 32-bit lane of chunk c's 16-byte quarter q holds column 4q + lane's four
               weights of inputs 8c .. 8c + 3 (low nibbles) and 8c + 4 .. 8c + 7 (high): one
               signed dot product each (a nibble, 0 .. 15, is a valid int8) */
            float32x4_t f[4][4];
            for (int i = 0; i < 4; i++)
                for (int q = 0; q < 4; q++) f[i][q] = vdupq_n_f32(0.f);
            const uint8x16_t m4 = vdupq_n_u8(0x0F);
            const int eight = m->bits == 8;
            for (int b = 0; b < nb; b++) {
                const Q4W *p = m;
                /* wv[k][q]: quarter q's bytes for inputs 4k .. 4k + 3. 4 bits: chunk c's low
                   nibbles (k = 2c) and high ones (k = 2c + 1). 8 bits (one plane of bytes):
                   u - 128, a valid int8, so the dot product is sum (u - 128) a, and the zero
                   point subtracted below is z - 128: the same integer as sum u a - z sum a */
                int8x16_t wv[8][4];
                if (eight) {
                    const uint8_t *wb = p->w + ((size_t)g * nb + b) * 512;
                    for (int k = 0; k < 8; k++)
                        for (int q = 0; q < 4; q++)
                            wv[k][q] = vreinterpretq_s8_u8(
                                veorq_u8(vld1q_u8(wb + 64 * k + 16 * q), vdupq_n_u8(0x80)));
                } else {
                    const uint8_t *wb = p->w + ((size_t)g * nb + b) * 256;
                    for (int c = 0; c < 4; c++)
                        for (int q = 0; q < 4; q++) {
                            uint8x16_t v = vld1q_u8(wb + 64 * c + 16 * q);
                            wv[2 * c][q] = vreinterpretq_s8_u8(vandq_u8(v, m4));
                            wv[2 * c + 1][q] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
                        }
                }
                const size_t so = ((size_t)g * nb + b) * 16;
                float32x4_t sv[4];
                for (int q = 0; q < 4; q++)
                    sv[q] = p->sc16 ? vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p->sc16 + so + 4 * q)))
                                    : vld1q_f32(p->sc + so + 4 * q);
                static const uint8_t zero16[16] = {0};
                const uint8_t *zp = p->zp ? p->zp + ((size_t)g * nb + b) * 16 : zero16;
                const uint16x8_t z0 = vmovl_u8(vld1_u8(zp)), z1 = vmovl_u8(vld1_u8(zp + 8));
                float32x4_t mv[4];
                for (int q = 0; q < 4; q++)
                    mv[q] = p->mn16 ? vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p->mn16 + so + 4 * q)))
                                    : vdupq_n_f32(0.f);
                const int32x4_t z8 = vdupq_n_s32(eight && p->zp ? 128 : 0);
                const int32x4_t zq[4] = {
                    vsubq_s32(vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(z0))), z8),
                    vsubq_s32(vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(z0))), z8),
                    vsubq_s32(vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(z1))), z8),
                    vsubq_s32(vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(z1))), z8)};
                for (int i = 0; i < tn; i++) {
                    int t = t0 + i;
                    const int8_t *a = aq + (size_t)t * Kp + b * 32;
                    float32x4_t sa = vdupq_n_f32(as[t * nb + b]);
                    int32x4_t sm = vdupq_n_s32(asum[t * nb + b]);
                    for (int q = 0; q < 4; q++) {
                        int32x4_t acc = vdupq_n_s32(0);
                        for (int k = 0; k < 8; k++) {
                            int32_t ak;
                            memcpy(&ak, a + 4 * k, 4);
                            acc = vdotq_s32(acc, wv[k][q], vreinterpretq_s8_s32(vdupq_n_s32(ak)));
                        }
                        acc = vsubq_s32(acc, vmulq_s32(zq[q], sm));
                        f[i][q] = vfmaq_f32(f[i][q], vcvtq_f32_s32(acc),
                                            vmulq_f32(sv[q], sa));
                        if (p->mn16)
                            f[i][q] = vfmaq_f32(f[i][q], mv[q],
                                                vdupq_n_f32(as[t * nb + b] * (float)asum[t * nb + b]));
                    }
                }
            }
            for (int i = 0; i < tn; i++)
                for (int q = 0; q < 4; q++)
                    vst1q_f32(y + (size_t)(t0 + i) * ldy + 16 * g + 4 * q, f[i][q]);
#else
            float f[4][16];
            memset(f, 0, sizeof f);
            const int eight = m->bits == 8;
            for (int b = 0; b < nb; b++) {
                const Q4W *p = m;
                /* u[r][j]: column r's weight for input j of the block (4 bits: chunk c's low
                   nibbles are inputs 8c .. 8c + 3, its high ones 8c + 4 .. 8c + 7; 8 bits: one
                   plane of bytes, chunk k holding inputs 4k .. 4k + 3) */
                const uint8_t *wb = p->w + ((size_t)g * nb + b) * (eight ? 512 : 256);
                uint8_t u[16][32];
                for (int r = 0; r < 16; r++)
                    for (int jj = 0; jj < 32; jj++) {
                        const int e = jj % 4;
                        u[r][jj] = eight ? wb[64 * (jj / 4) + r * 4 + e]
                                 : jj % 8 < 4 ? wb[64 * (jj / 8) + r * 4 + e] & 15
                                              : wb[64 * (jj / 8) + r * 4 + e] >> 4;
                    }
                const size_t so = ((size_t)g * nb + b) * 16;
                float s[16];
                for (int r = 0; r < 16; r++) s[r] = p->sc16 ? h2f(p->sc16[so + r]) : p->sc[so + r];
                int32_t z[16];  /* zero points: 0 where a 4-bit plane has none, 128 for 8 bits */
                for (int r = 0; r < 16; r++) z[r] = p->zp ? p->zp[so + r] : eight ? 128 : 0;
                float mn[16];
                for (int r = 0; r < 16; r++) mn[r] = p->mn16 ? h2f(p->mn16[so + r]) : 0.f;
                for (int i = 0; i < tn; i++) {
                    int t = t0 + i;
                    const int8_t *a = aq + (size_t)t * Kp + b * 32;
                    int32_t acc[16] = {0};
                    for (int r = 0; r < 16; r++)
                        for (int jj = 0; jj < 32; jj++) acc[r] += u[r][jj] * a[jj];
                    float sa = as[t * nb + b];
                    int32_t sm = asum[t * nb + b];
                    for (int r = 0; r < 16; r++)
                        f[i][r] = fmaf((float)(acc[r] - z[r] * sm), s[r] * sa, f[i][r]);
                    if (p->mn16) {
                        const float xs = sa * (float)sm;
                        for (int r = 0; r < 16; r++) f[i][r] = fmaf(mn[r], xs, f[i][r]);
                    }
                }
            }
            for (int i = 0; i < tn; i++) memcpy(y + (size_t)(t0 + i) * ldy + 16 * g, f[i], 64);
#endif
        }
    }
}

/* ---- per-row pieces ---- */
static float sumsq(const float *x, int n) {
    v8 s = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8) { v8 v = load8(x + i); s += v * v; }
    float r = sum8(s);
    for (; i < n; i++) r += x[i] * x[i];
    return r;
}

static void rms_norm(const float *x, const float *w, int d, float eps, float *out) {
    float inv = 1.0f / sqrtf(sumsq(x, d) / (float)d + eps);
    for (int i = 0; i < d; i++) out[i] = (x[i] * inv) * w[i];
}

static void rotate(float *x, int heads, int D, const float *cos, const float *sin) {
    int half = D / 2;
    for (int h = 0; h < heads; h++) {
        float *v = x + h * D;
        for (int i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i] + a * sin[i];
        }
    }
}

static void embed_row(const Model *M, int64_t id, const float *mask_embeds, int n_mask,
                      float *out) {
    int d = M->d;
    if (id >= M->V) {
        int64_t slot = id - M->V;
        if (slot >= n_mask) slot = n_mask - 1;
        memcpy(out, mask_embeds + slot * d, sizeof(float) * d);
        return;
    }
    if (M->emb_bits == 32) {  /* an untied model's float32 rows (embeddings.npy) */
        memcpy(out, (const float *)(const void *)M->emb_q + (size_t)id * d, sizeof(float) * d);
        return;
    }
    int nb = (d + 31) / 32, zb = (nb + 1) / 2;
    if (M->emb_bits == 8) {
        const uint8_t *u = M->emb_q + (size_t)id * nb * 32;
        for (int i = 0; i < d; i++) {
            int b = i / 32, z = M->emb_zp ? M->emb_zp[(size_t)id * nb + b] : 128;
            out[i] = (float)(u[i] - z) * M->emb_sc[(size_t)id * nb + b];
        }
        return;
    }
    const uint8_t *q = M->emb_q + (size_t)id * nb * 16;
    for (int i = 0; i < d; i++) {
        int b = i / 32;
        int z = 8;
        if (M->emb_zp) {
            uint8_t zz = M->emb_zp[(size_t)id * zb + b / 2];
            z = (b & 1) ? zz >> 4 : zz & 15;
        }
        uint8_t v = q[i / 2];
        int qi = (i & 1) ? v >> 4 : v & 15;
        out[i] = (float)(qi - z) * M->emb_sc[(size_t)id * nb + b];
    }
}

/* attention of one query head of one row: keys = cache rows [0, n0) then the block rows
   listed in anc (cache rows base + anc[i]); sc: scratch of at least n0 + n_anc + 8 floats */
#define RT 4  /* block rows whose attention over the cache one task computes together */
#define RTI 6  /* rows a pass of the int8 cache's integer scores (12 sums, 2 keys, 1 query: 15
                  AVX registers) */
#define QP_MAX 128  /* int16 pairs of a query row (int8 cache): heads of up to 256 dimensions */

/* one query row (one head) for the int8 cache's integer scores: its int16 codes, two to an
   int32 (dimension e in the low half, e + 1 in the high), q * (32767 / amax) rounded to
   nearest even; returns the codes' scale amax / 32767 (0 for a zero row, whose codes are 0).
   The same bits wherever a row is computed: they depend on the row's own values only, and
   the vector and scalar roundings are the same (round to nearest even). */
static float q_pairs(const float *q, int D, int32_t *qp) {
    const float m = amax(q, D);
    if (m == 0.f) {
        memset(qp, 0, sizeof(int32_t) * (size_t)(D / 2));
        return 0.f;
    }
    const float inv = 32767.f / m;
    int e = 0;
#ifdef __AVX2__
    const __m256i hi = _mm256_set1_epi32(32767), lo = _mm256_set1_epi32(-32767);
    for (; e + 16 <= D; e += 16) {
        __m256i a = _mm256_cvtps_epi32((__m256)(load8(q + e) * bcast8(inv)));
        __m256i b = _mm256_cvtps_epi32((__m256)(load8(q + e + 8) * bcast8(inv)));
        a = _mm256_max_epi32(_mm256_min_epi32(a, hi), lo);
        b = _mm256_max_epi32(_mm256_min_epi32(b, hi), lo);
        __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8);
        _mm256_storeu_si256((__m256i *)(qp + e / 2), w);
    }
#endif
    for (; e < D; e += 2) {
        long a = lrintf(q[e] * inv), b = lrintf(q[e + 1] * inv);
        int32_t c0 = a > 32767 ? 32767 : a < -32767 ? -32767 : (int32_t)a;
        int32_t c1 = b > 32767 ? 32767 : b < -32767 ? -32767 : (int32_t)b;
        qp[e / 2] = (int32_t)((uint32_t)(uint16_t)c0 | (uint32_t)(uint16_t)c1 << 16);
    }
    return m / 32767.f;
}

/* the exact integer dot of a query row's pairs with cached key p (int8 cache, kidx8) */
static inline int32_t qk_dot8(const int32_t *qp, const int8_t *kh, int p, int D) {
    int32_t acc = 0;
    for (int e = 0; e < D; e += 2) {
        const int8_t *k = kh + kidx8(p, e, D);
        acc += (int32_t)(int16_t)(uint16_t)qp[e / 2] * k[0]
             + (int32_t)(int16_t)((uint32_t)qp[e / 2] >> 16) * k[1];
    }
    return acc;
}

/* the int8 cache's scores of keys [k0, k1) for n (<= RTI, a constant where inlined) query
   rows: out[r][p - k0] = ((float)dot_r(p) * ks[p]) * qsc[r], qp[r] the rows' pairs (q_pairs),
   qsc[r] = qs * scale. Whole blocks of 16 keys (lanes past k1 read, never written). */
static inline __attribute__((always_inline)) void qk_tile8(
        const int n, const int32_t *const *qp, const float *qsc, const int8_t *kh,
        const float *ks, int D, int k0, int k1, float *const *out) {
    for (int b = k0 >> 4; b <= (k1 - 1) >> 4; b++) {
        const int8_t *blk = kh + (size_t)b * D * 16;
        v8 f[RTI][2];
        /* the key block 4 KB on: as for the weights (q4_gemm), the hardware prefetcher stops
           at every 4 KB, and a long context's scores read ~400 KB of keys a layer. SmolLM2
           GGUF int4, int8 cache, P = 2048, 2 threads, a 2-core Zen 3, both builds in one
           process alternated (with the same for the values in pv_int): t(1) 0.94-0.96x
           (100-200 pairs), t(4) 1.00x; a half-float cache (qk_tile, pv_heads32): t(1)
           0.95-0.96x, t(4) 0.86x, t(8) 0.86x; 8 KB on, or into every cache level, alike
           within noise; the scales' own streams prefetched too: no better, or worse. The
           same bits. (Backing the cache with huge pages instead: 0.99-1.00x.) */
        for (int c = 0; c < D * 16; c += 64) __builtin_prefetch(blk + 4096 + c, 0, 0);
#ifdef __AVX2__
        __m256i a[RTI][2];
        for (int r = 0; r < n; r++) a[r][0] = a[r][1] = _mm256_setzero_si256();
        for (int e2 = 0; e2 < D / 2; e2++) {
            __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + e2 * 32)));
            __m256i hi = _mm256_cvtepi8_epi16(
                _mm_loadu_si128((const __m128i *)(blk + e2 * 32 + 16)));
            for (int r = 0; r < n; r++) {
                __m256i qq = _mm256_set1_epi32(qp[r][e2]);
                a[r][0] = dpwssd8(a[r][0], lo, qq);
                a[r][1] = dpwssd8(a[r][1], hi, qq);
                /* each sum a chain in a register: left free, GCC kept 8 of 5-6 rows' sums on
                   the stack (a load and a store per multiply). The same integers; int8
                   cache, P = 2000, paired in one process (2 x 15 pairs): t(4) 0.91x, t(10)
                   0.92x, t(2) 0.96-1.02x, t(1) 0.96-1.03x */
                __asm__("" : "+x"(a[r][0]), "+x"(a[r][1]));
            }
        }
        for (int r = 0; r < n; r++) {
            f[r][0] = (v8)_mm256_cvtepi32_ps(a[r][0]);
            f[r][1] = (v8)_mm256_cvtepi32_ps(a[r][1]);
        }
#else
        for (int r = 0; r < n; r++) {
            int32_t acc[16] = {0};
            for (int e2 = 0; e2 < D / 2; e2++) {
                const int32_t lo = (int16_t)(uint16_t)qp[r][e2];
                const int32_t hi = (int16_t)((uint32_t)qp[r][e2] >> 16);
                const int8_t *k = blk + e2 * 32;
                for (int j = 0; j < 16; j++) acc[j] += lo * k[2 * j] + hi * k[2 * j + 1];
            }
            for (int j = 0; j < 16; j++) f[r][j >> 3][j & 7] = (float)acc[j];
        }
#endif
        const v8 s0 = load8(ks + b * 16), s1 = load8(ks + b * 16 + 8);
        int p0 = b * 16, lo_p = p0 < k0 ? k0 : p0, hi_p = p0 + 16 > k1 ? k1 : p0 + 16;
        for (int r = 0; r < n; r++) {
            const v8 c = bcast8(qsc[r]);
            v8 o0 = f[r][0] * s0 * c, o1 = f[r][1] * s1 * c;
            if (lo_p == p0 && hi_p == p0 + 16) {
                store8(out[r] + (p0 - k0), o0);
                store8(out[r] + (p0 - k0) + 8, o1);
                continue;
            }
            for (int p = lo_p; p < hi_p; p++) {
                int j = p - p0;
                out[r][p - k0] = j < 8 ? o0[j] : o1[j - 8];
            }
        }
    }
}

/* scores of key positions [k0, k1) for n query rows q[r] (n <= RT, a constant where inlined)
   over a half-float cache: out[r][p - k0] = scale * (fma chain over e of q[r][e] * K[p][e],
   from 0). Whole blocks of 16 are computed (lanes past k1 are read, never written): each lane
   is its own chain. */
static inline __attribute__((always_inline)) void qk_tile(
        const int n, const float *const *q, const kv_t *kh, int D, int k0, int k1, float scale,
        float *const *out) {
    for (int b = k0 >> 4; b <= (k1 - 1) >> 4; b++) {
        const size_t blk = (size_t)b * D * 16;
        v8 a[RT][2];
        for (int c = 0; c < D * 32; c += 64)  /* (see qk_tile8) */
            __builtin_prefetch((const char *)(kh + blk) + 4096 + c, 0, 0);
        for (int r = 0; r < n; r++) a[r][0] = a[r][1] = (v8){0};
        for (int e = 0; e < D; e++) {
            v8 lo = loadh8(kh + blk + e * 16), hi = loadh8(kh + blk + e * 16 + 8);
            for (int r = 0; r < n; r++) {
                v8 qe = (v8){0} + q[r][e];  /* (kept: bcast8 here made t(10) 3 % slower) */
                a[r][0] = fma8(qe, lo, a[r][0]);
                a[r][1] = fma8(qe, hi, a[r][1]);
            }
        }
        int p0 = b * 16, lo_p = p0 < k0 ? k0 : p0, hi_p = p0 + 16 > k1 ? k1 : p0 + 16;
        for (int r = 0; r < n; r++)
            for (int p = lo_p; p < hi_p; p++) {
                int j = p - p0;
                out[r][p - k0] = a[r][j >> 3][j & 7] * scale;
            }
    }
}

/* the same scores as qk_tile, for the keys [lo, hi) of the one 16-key block at p0, read from
   kf: that block's keys as floats (kf[e * 16 + j], converted exactly from the cache's half
   floats, so every chain is qk_tile's to the bit). out[r][p - k0]. */
#define RTF 6  /* rows a pass over a float key block (12 sums, 2 keys, 1 query: 15 AVX
                     registers; with 4 rows the compiler re-read the keys from memory for each
                     row, and two loads a cycle bounded it) */
static inline __attribute__((always_inline)) void qk_tile_f(
        const int n, const float *const *q, const float *kf, int D, int p0, int lo, int hi,
        int k0, float scale, float *const *out) {
    v8 a[RTF][2];
    for (int r = 0; r < n; r++) a[r][0] = a[r][1] = (v8){0};
    for (int e = 0; e < D; e++) {
        v8 l8 = load8(kf + e * 16), h8 = load8(kf + e * 16 + 8);
        for (int r = 0; r < n; r++) {
            v8 qe = bcast8(q[r][e]);
            a[r][0] = fma8(qe, l8, a[r][0]);
            a[r][1] = fma8(qe, h8, a[r][1]);
        }
    }
    if (lo == p0 && hi == p0 + 16) {  /* a whole block: the same products, 8 at a time */
        for (int r = 0; r < n; r++) {
            store8(out[r] + (p0 - k0), a[r][0] * scale);
            store8(out[r] + (p0 - k0) + 8, a[r][1] * scale);
        }
        return;
    }
    for (int r = 0; r < n; r++)
        for (int p = lo; p < hi; p++) {
            int j = p - p0;
            out[r][p - k0] = a[r][j >> 3][j & 7] * scale;
        }
}

static void qk_rows_f(int n, const float *const *q, const float *kf, int D,
                      int p0, int lo, int hi, int k0, float scale, float *const *out) {
    switch (n) {
    case 1: qk_tile_f(1, q, kf, D, p0, lo, hi, k0, scale, out); break;
    case 2: qk_tile_f(2, q, kf, D, p0, lo, hi, k0, scale, out); break;
    case 3: qk_tile_f(3, q, kf, D, p0, lo, hi, k0, scale, out); break;
    case 4: qk_tile_f(4, q, kf, D, p0, lo, hi, k0, scale, out); break;
    case 5: qk_tile_f(5, q, kf, D, p0, lo, hi, k0, scale, out); break;
    default: qk_tile_f(RTF, q, kf, D, p0, lo, hi, k0, scale, out); break;
    }
}

/* the scores of keys [k0, k1) for n query rows: qk_tile over a half-float cache (n <= RT),
   or (ks set) qk_tile8 over an int8 cache (n <= RTI), from the rows' int16 pairs qp[r] and
   qsc[r] = their scale * scale (q_pairs, made once a layer for each row and head) */
static void qk_rows(int n, const float *const *q, const int32_t *const *qp, const float *qsc,
                    const void *kh, const float *ks, int D, int k0, int k1, float scale,
                    float *const *out) {
    if (k1 <= k0) return;
    if (ks) {  /* constant row counts, so the accumulators stay in registers */
        const int8_t *k8 = (const int8_t *)kh;
        switch (n) {
        case 1: qk_tile8(1, qp, qsc, k8, ks, D, k0, k1, out); break;
        case 2: qk_tile8(2, qp, qsc, k8, ks, D, k0, k1, out); break;
        case 3: qk_tile8(3, qp, qsc, k8, ks, D, k0, k1, out); break;
        case 4: qk_tile8(4, qp, qsc, k8, ks, D, k0, k1, out); break;
        case 5: qk_tile8(5, qp, qsc, k8, ks, D, k0, k1, out); break;
        default: qk_tile8(RTI, qp, qsc, k8, ks, D, k0, k1, out); break;
        }
        return;
    }
    const kv_t *kf = (const kv_t *)kh;
    switch (n) {
    case 1: qk_tile(1, q, kf, D, k0, k1, scale, out); break;
    case 2: qk_tile(2, q, kf, D, k0, k1, scale, out); break;
    case 3: qk_tile(3, q, kf, D, k0, k1, scale, out); break;
    default: qk_tile(RT, q, kf, D, k0, k1, scale, out); break;
    }
}

/* --- the int8 cache's p @ V -------------------------------------------------------------
   A (block row, query head)'s scratch: its list's floats in n + 24 slots (scores, then
   weights, 1 / their sum at the slot after the last 8-lane vector, each value chunk's weight
   scale in the slots after it), then, for an int8 cache, each value chunk's int16 weights,
   wq_span(n) apiece (n: the cache rows plus the block's, an upper bound of the list). */
#define PV_FLUSH 256  /* list entries summed in int32 between flushes: |sum| <= 256 * 32767 *
                         127 < 2^31 */
static size_t wq_span(int n) { return (size_t)(n + 8 + 15) / 16 * 16; }
static size_t row_stride(int n, int nch, int q8) {
    return (size_t)n + 24 + (q8 ? (size_t)nch * wq_span(n) / 2 : 0);
}

/* value chunk c's int16 weights of a row's list (n entries: rows 0 .. n0 - 1, then P + an[]):
   w_i = x[i] * vs[row_i] (vs: the chunk's value scales) rounded to q = w * (32767 / amax),
   to nearest even; wq[n] = 0 (a pair's partner past the list); returns amax / 32767 */
static float pv_weights(const float *x, const float *vs, int n0, int n, int P, const int *an,
                        int16_t *wq) {
    float m = 0.f;
    int i = 0;
    v8 mv = {0};
#ifdef __AVX512F__
    {  /* (a maximum is exact: lanes may take the list in any grouping) */
        __m512 m16 = _mm512_setzero_ps();
        for (; i + 16 <= n0; i += 16)
            m16 = _mm512_max_ps(m16, _mm512_mul_ps(_mm512_loadu_ps(x + i),
                                                   _mm512_loadu_ps(vs + i)));
        mv = max8(lo8(m16), hi8(m16));
    }
#endif
    for (; i + 8 <= n0; i += 8) mv = max8(mv, load8(x + i) * load8(vs + i));
    for (int l = 0; l < 8; l++) m = mv[l] > m ? mv[l] : m;
    for (; i < n; i++) {
        float w = x[i] * vs[i < n0 ? i : P + an[i - n0]];
        m = w > m ? w : m;
    }
    wq[n] = 0;
    if (m == 0.f) {
        memset(wq, 0, sizeof(int16_t) * (size_t)n);
        return 0.f;
    }
    const float inv = 32767.f / m;
    i = 0;
#ifdef __AVX512F__
    {  /* the same rounding, clamp and (signed saturating) narrowing */
        const __m512 inv16 = _mm512_set1_ps(inv);
        const __m512i hi16 = _mm512_set1_epi32(32767);
        for (; i + 16 <= n0; i += 16) {
            __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(
                _mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(vs + i)), inv16));
            _mm256_storeu_si256((__m256i *)(wq + i),
                                _mm512_cvtsepi32_epi16(_mm512_min_epi32(a, hi16)));
        }
    }
#endif
#ifdef __AVX2__
    const __m256i hi = _mm256_set1_epi32(32767);
    for (; i + 16 <= n0; i += 16) {
        __m256i a = _mm256_cvtps_epi32((__m256)(load8(x + i) * load8(vs + i) * bcast8(inv)));
        __m256i b = _mm256_cvtps_epi32(
            (__m256)(load8(x + i + 8) * load8(vs + i + 8) * bcast8(inv)));
        a = _mm256_min_epi32(a, hi);
        b = _mm256_min_epi32(b, hi);
        _mm_storeu_si128((__m128i *)(wq + i), _mm_packs_epi32(_mm256_castsi256_si128(a),
                                                              _mm256_extracti128_si256(a, 1)));
        _mm_storeu_si128((__m128i *)(wq + i + 8),
                         _mm_packs_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
    }
#endif
    for (; i < n; i++) {
        long q = lrintf(x[i] * vs[i < n0 ? i : P + an[i - n0]] * inv);
        wq[i] = (int16_t)(q > 32767 ? 32767 : q);
    }
    return m / 32767.f;
}

/* p @ V over an int8 cache, list entries [i0, i1), for nj (<= 3) heads and nv (<= 4) 8-lane
   vectors of value lanes e .. e + 8 nv - 1 of one chunk (vp: the chunk, pair layout, w lanes):
   ai[j]: each head's int32 sums since the last flush (read and written back), f[j]: its
   float sums, which get f + (float)ai * ws[j] after every list entry i with (i + 1) a
   multiple of PV_FLUSH (the caller flushes the rest after the list's last entry, pv_flush).
   Entries i, i + 1 below n0 (i even) are cache rows i and i + 1: one pair; any other entry
   is its row's pair with the partner's weight 0. Integer sums are exact: how entries are
   paired or which kernel runs changes no bit. wq[j]: head j's int16 weights. */
static inline __attribute__((always_inline)) void pv_int(
        const int nj, const int nv, const int16_t *const *wq, const float *ws,
        const int8_t *vp, int w, int e, int i0, int i1, int n0, int P, const int *an,
        int32_t *const *ai, float *const *f) {
    int i = i0;
#ifdef __AVX2__
    __m256i a[3][4];
    for (int j = 0; j < nj; j++)
        for (int k = 0; k < nv; k++) a[j][k] = _mm256_loadu_si256((const __m256i *)(ai[j] + 8 * k));
#define PV_PAIR(blk, wsel)                                                                   \
    do {                                                                                     \
        __m256i ww[3];                                                                       \
        for (int j = 0; j < nj; j++) ww[j] = _mm256_set1_epi32(wsel);                        \
        for (int k = 0; k < nv; k++) {                                                       \
            __m256i v = _mm256_cvtepi8_epi16(                                                \
                _mm_loadu_si128((const __m128i *)((blk) + (size_t)(e + 8 * k) * 2)));        \
            for (int j = 0; j < nj; j++)                                                     \
                a[j][k] = dpwssd8(a[j][k], v, ww[j]);                                        \
        }                                                                                    \
    } while (0)
#else
#define PV_PAIR(blk, wsel)                                                                   \
    do {                                                                                     \
        for (int j = 0; j < nj; j++) {                                                       \
            const int32_t ww = (wsel);                                                       \
            const int32_t lo = (int16_t)(uint16_t)ww, hi = (int16_t)((uint32_t)ww >> 16);    \
            for (int l = 0; l < 8 * nv; l++)                                                 \
                ai[j][l] += lo * (blk)[(size_t)(e + l) * 2] + hi * (blk)[(size_t)(e + l) * 2 + 1]; \
        }                                                                                    \
    } while (0)
#endif
    while (i < i1) {
        int end = (i / PV_FLUSH + 1) * PV_FLUSH;
        if (end > i1) end = i1;
        int pe = end < n0 ? end : n0;
        if ((i & 1) && i < pe) {  /* an odd cache row: the second of its pair */
            const int8_t *blk = vp + (size_t)(i - 1) * w;
            PV_PAIR(blk, (int32_t)((uint32_t)(uint16_t)wq[j][i] << 16));
            i++;
        }
        for (; i + 1 < pe; i += 2) {
            const int8_t *blk = vp + (size_t)i * w;
            __builtin_prefetch(blk + 4096, 0, 0);  /* (see qk_tile8) */
            int32_t pr;
            PV_PAIR(blk, (memcpy(&pr, wq[j] + i, 4), pr));
        }
        for (; i < end; i++) {  /* the last cache row of an odd run, the block's rows */
            const int row = i < n0 ? i : P + an[i - n0];
            const int8_t *blk = vp + (size_t)(row & ~1) * w;
            PV_PAIR(blk, (row & 1) ? (int32_t)((uint32_t)(uint16_t)wq[j][i] << 16)
                                   : (int32_t)(uint16_t)wq[j][i]);
        }
        if (end % PV_FLUSH == 0) {
            for (int j = 0; j < nj; j++) {
                const v8 sc = bcast8(ws[j]);
                for (int k = 0; k < nv; k++) {
#ifdef __AVX2__
                    v8 fa = (v8)_mm256_cvtepi32_ps(a[j][k]);
                    a[j][k] = _mm256_setzero_si256();
#else
                    v8 fa;
                    for (int l = 0; l < 8; l++) { fa[l] = (float)ai[j][8 * k + l]; ai[j][8 * k + l] = 0; }
#endif
                    store8(f[j] + 8 * k, load8(f[j] + 8 * k) + fa * sc);
                }
            }
        }
    }
#undef PV_PAIR
#ifdef __AVX2__
    for (int j = 0; j < nj; j++)
        for (int k = 0; k < nv; k++) _mm256_storeu_si256((__m256i *)(ai[j] + 8 * k), a[j][k]);
#endif
}

/* pv_int for nj heads and nl (a multiple of 8, <= 32) lanes */
static void pv_ints(int nj, int nl, const int16_t *const *wq, const float *ws, const int8_t *vp,
                    int w, int e, int i0, int i1, int n0, int P, const int *an,
                    int32_t *const *ai, float *const *f) {
#define PV_NV(nj_) switch (nl / 8) {                                                         \
    case 1: pv_int(nj_, 1, wq, ws, vp, w, e, i0, i1, n0, P, an, ai, f); break;              \
    case 2: pv_int(nj_, 2, wq, ws, vp, w, e, i0, i1, n0, P, an, ai, f); break;              \
    case 3: pv_int(nj_, 3, wq, ws, vp, w, e, i0, i1, n0, P, an, ai, f); break;              \
    default: pv_int(nj_, 4, wq, ws, vp, w, e, i0, i1, n0, P, an, ai, f); break; }
    switch (nj) {
    case 1: PV_NV(1) break;
    case 2: PV_NV(2) break;
    default: PV_NV(3) break;
    }
#undef PV_NV
}

/* after a list of n entries: the sums since the last flush, if any, into f, then the output
   o = f * inv (o may be f), nl lanes */
static void pv_flush(int n, const int32_t *ai, float ws, float *f, float inv, float *o, int nl) {
    for (int l = 0; l < nl; l += 8) {
        v8 x = load8(f + l);
        if (n % PV_FLUSH) {
            v8 fa;
            for (int k = 0; k < 8; k++) fa[k] = (float)ai[l + k];
            x = x + fa * bcast8(ws);
        }
        store8(o + l, x * bcast8(inv));
    }
}

/* p @ V of one (block row, query head) over an int8 cache, every chunk (attend_rows): x the
   row's list floats (inv at x[n8], chunk c's weight scale at x[n8 + 1 + c]), wq its int16
   weights, chunk c at wq + c * wspan */
static void pv_row8(const float *x, const int16_t *wq, size_t wspan, float *o, const int8_t *vv,
                    int D, int cap, int n0, int n, int P, const int *an) {
    const int w = vw(D), n8 = (n + 7) / 8 * 8;
    const float inv = x[n8];
    for (int c = 0; c < D / w; c++) {
        const int16_t *wc = wq + (size_t)c * wspan;
        const float ws = x[n8 + 1 + c];
        for (int e = 0; e < w; e += 32) {
            int nl = w - e < 32 ? w - e : 32;
            int32_t ai[32] = {0};
            float *f = o + c * w + e, *fp = f;
            int32_t *ap = ai;
            for (int l = 0; l < nl; l++) f[l] = 0.f;
            pv_ints(1, nl, &wc, &ws, vv + (size_t)c * cap * w, w, e, 0, n, n0, P, an, &ap, &fp);
            pv_flush(n, ai, ws, f, inv, f, nl);
        }
    }
}

/* the rest of one query row's attention weights, its scores s[0 .. done) already in place
   (done >= P): the scores of the block's keys (rows 0 .. lead - 1 contiguous after the cache,
   from done on, then the ancestors anc[0 .. na)), then s <- exp(s - max) over the whole list
   and, in the slot after the list's last 8-lane vector, 1 / sum; an int8 cache (vs: the
   group's value scales, [nch][cap]) and wq set: then each value chunk c's int16 weights at
   wq + c * wspan and their scale in the slot after 1 / sum plus c (pv_weights; a one-row
   step's grouped path computes them in its p @ V tasks instead). The one code for every
   path (attend_rows, attend_groups), so a row's weights are the same bits wherever it is
   computed. */
static void row_softmax(const float *q, const int32_t *qp, float qsc, const void *kh,
                        const float *ks, int D, int P, int lead, int na, const int *anc,
                        float scale, float *x, int done, const float *vs, int cap,
                        int16_t *wq, size_t wspan) {
    int n0 = P + lead, n = n0 + na;
    float *sr = x + done;
    qk_rows(1, &q, &qp, &qsc, kh, ks, D, done, n0, scale, &sr);
    for (int a = 0; a < na; a++) {  /* the block's other ancestors: the same chains */
        int c = P + anc[a];
        if (ks) {  /* the same exact integer dot, then the same two products */
            x[n0 + a] = ((float)qk_dot8(qp, (const int8_t *)kh, c, D) * ks[c]) * qsc;
            continue;
        }
        float acc = 0.f;
        for (int e = 0; e < D; e++) acc = fmaf(q[e], h2f(((const kv_t *)kh)[kidx(c, e, D)]), acc);
        x[n0 + a] = acc * scale;
    }
    int n8 = (n + 7) / 8 * 8, i;
    for (i = n; i < n8; i++) x[i] = -INFINITY;
    v8 mx = load8(x);
    i = 8;
#ifdef __AVX512F__
    if (n8 >= 24) {  /* (a maximum is exact: any grouping gives the same) */
        __m512 m16 = _mm512_loadu_ps(x + 8);
        for (i = 24; i + 16 <= n8; i += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(x + i));
        mx = max8(mx, max8(lo8(m16), hi8(m16)));
    }
#endif
    for (; i < n8; i += 8) mx = max8(mx, load8(x + i));
    float m = mx[0];
    for (int l = 1; l < 8; l++) m = mx[l] > m ? mx[l] : m;
    v8 sum = {0};
    i = 0;
#ifdef __AVX512F__
    {  /* 16 lanes a pass, then at most one 8-lane pass */
        const __m512 m16 = _mm512_set1_ps(m), ninf = _mm512_set1_ps(-INFINITY);
        for (; i + 16 <= n8; i += 16) {
            __m512 v = _mm512_loadu_ps(x + i);
            __mmask16 live = _mm512_cmp_ps_mask(v, ninf, _CMP_GT_OQ);  /* padding: 0 */
            __m512 e = _mm512_maskz_mov_ps(live, vexp16_neg(_mm512_sub_ps(v, m16)));
            _mm512_storeu_ps(x + i, e);
            sum = add_halves(sum, e);
        }
    }
#endif
    for (; i < n8; i += 8) {
        v8 v = load8(x + i);
        v8 e = vexp_neg(v - m);
        vi8 live = v > -INFINITY;  /* padding lanes add exactly 0 */
        e = (v8)((vi8)e & live);
        store8(x + i, e);
        sum += e;
    }
    x[n8] = 1.0f / sum8(sum);  /* (a slot past the row's list) */
    if (vs && wq)
        for (int c = 0; c < D / vw(D); c++)
            x[n8 + 1 + c] = pv_weights(x, vs + (size_t)c * cap, n0, n, P, anc, wq + c * wspan);
}

/* p @ V of one block row and query head over a half-float cache, its keys in list order, 64
   value lanes a pass in registers: lane e's sum is fma(x[i], v_i[e], acc) over the list. x:
   the row's weights, inv: 1 / their sum. (An int8 cache: pv_row8.) */
static void pv_row(const float *x, float inv, float *o, const kv_t *vv, int D, int cap, int n0,
                   int n, int P, const int *an) {
    int e0 = 0;
    for (; e0 + 64 <= D; e0 += 64) {
        v8 o0 = {0}, o1 = {0}, o2 = {0}, o3 = {0}, o4 = {0}, o5 = {0}, o6 = {0}, o7 = {0};
        for (int i = 0; i < n; i++) {
            int row = i < n0 ? i : P + an[i - n0];
            size_t v = vidx(row, e0, D, cap), u = vidx(row, e0 + 32, D, cap);
            v8 p = (v8){0} + x[i];
            o0 = fma8(p, loadh8(vv + v), o0);       o1 = fma8(p, loadh8(vv + v + 8), o1);
            o2 = fma8(p, loadh8(vv + v + 16), o2);  o3 = fma8(p, loadh8(vv + v + 24), o3);
            o4 = fma8(p, loadh8(vv + u), o4);       o5 = fma8(p, loadh8(vv + u + 8), o5);
            o6 = fma8(p, loadh8(vv + u + 16), o6);  o7 = fma8(p, loadh8(vv + u + 24), o7);
        }
        store8(o + e0, o0 * inv);      store8(o + e0 + 8, o1 * inv);
        store8(o + e0 + 16, o2 * inv); store8(o + e0 + 24, o3 * inv);
        store8(o + e0 + 32, o4 * inv); store8(o + e0 + 40, o5 * inv);
        store8(o + e0 + 48, o6 * inv); store8(o + e0 + 56, o7 * inv);
    }
    for (; e0 < D; e0 += 8) {  /* (D is a multiple of 8) */
        v8 acc = {0};
        for (int i = 0; i < n; i++) {
            int row = i < n0 ? i : P + an[i - n0];
            acc = fma8((v8){0} + x[i], loadh8(vv + vidx(row, e0, D, cap)), acc);
        }
        store8(o + e0, acc * inv);
    }
}

/* attention of query head hh for block rows t0 .. t0 + rt - 1. Row t's keys, in order: the
   cache's P rows, the block's rows 0 .. lead[t] - 1 (contiguous after the cache), then the
   block rows in anc[t]: exactly the list plain decoding has once those rows are committed.
   The cache part is computed for the rt rows together (each key block read once per task),
   every score and sum with the same operations in the same order as for a row alone.
   kh, vv: the head's keys and values, ks, vs: their scales (NULL: half floats); QP, QS: the
   int8 cache's query pairs and their scales, row t's head hh at QP + (t * H + hh) * D / 2 and
   QS[t * H + hh] (q_pairs). sc: scratch of rt * (P + T + 24) floats. */
static void attend_rows(const float *qkv, int Nqkv, int hh, int t0, int rt, int P, int T,
                        const int *lead, const int *nanc, const int *anc, const void *kh,
                        const float *ks, const void *vv, const float *vs, int D, int cap,
                        const int32_t *QP, const float *QS, int H,
                        float scale, float *sc, float *att, int ldatt) {
    const size_t stride = row_stride(P + T, D / vw(D), vs != NULL), wspan = wq_span(P + T);
    const float *q[RT];
    const int32_t *qp[RT] = {0};
    float qsc[RT] = {0};
    float *s[RT];
    for (int r = 0; r < rt; r++) {
        q[r] = qkv + (size_t)(t0 + r) * Nqkv + hh * D;
        s[r] = sc + (size_t)r * stride;
        if (ks) {
            qp[r] = QP + ((size_t)(t0 + r) * H + hh) * (D / 2);
            qsc[r] = QS[(size_t)(t0 + r) * H + hh];
        }
    }
    /* the keys every row of the tile has (the cache, then the block's shortest leading run:
       in a causal prefill, row t0's) scored for the rows together */
    int m = lead[t0];
    for (int r = 1; r < rt; r++) m = lead[t0 + r] < m ? lead[t0 + r] : m;
    qk_rows(rt, q, qp, qsc, kh, ks, D, 0, P + m, scale, s);
    for (int r = 0; r < rt; r++) {
        int t = t0 + r;
        row_softmax(q[r], qp[r], qsc[r], kh, ks, D, P, lead[t], nanc[t], anc + (size_t)t * T,
                    scale, s[r], P + m, vs, cap, (int16_t *)(s[r] + P + T + 24), wspan);
    }
    for (int r = 0; r < rt; r++) {
        int t = t0 + r, n0 = P + lead[t], n = n0 + nanc[t];
        const float *x = s[r];
        float *o = att + (size_t)t * ldatt + hh * D;
        float inv = x[(n + 7) / 8 * 8];
        if (vs)
            pv_row8(x, (const int16_t *)(s[r] + P + T + 24), wspan, o, (const int8_t *)vv, D,
                    cap, n0, n, P, anc + (size_t)t * T);
        else
            pv_row(x, inv, o, (const kv_t *)vv, D, cap, n0, n, P, anc + (size_t)t * T);
    }
}

/* p @ V for nj (<= 3, a constant where inlined) query heads of one KV group and one block
   row, value lanes [e0, e0 + 32): each lane's sum runs over the row's list in list order,
   the same chain attend_rows computes, while each value row is loaded once for the nj
   heads (a half-float cache; an int8 one: pv_int). x[j]: head j's weights, inv[j] its 1 /
   sum, o[j] its output row. */
static inline __attribute__((always_inline)) void pv_heads32(
        const int nj, const float *const *x, const float *inv, float *const *o,
        const kv_t *vv, int D, int cap, int e0, int n0, int n, int P,
        const int *an, int i0, const float *const *from) {
    v8 acc[3][4];
    for (int j = 0; j < nj; j++)
        for (int c = 0; c < 4; c++) acc[j][c] = from ? load8(from[j] + 8 * c) : (v8){0};
    for (int i = i0; i < n; i++) {
        int row = i < n0 ? i : P + an[i - n0];
        size_t v = vidx(row, e0, D, cap);
        __builtin_prefetch(vv + v + 2048, 0, 0);  /* 4 KB on (see the int8 cache's pv_int) */
        v8 v0 = loadh8(vv + v), v1 = loadh8(vv + v + 8);
        v8 v2 = loadh8(vv + v + 16), v3 = loadh8(vv + v + 24);
        for (int j = 0; j < nj; j++) {
            v8 p = bcast8(x[j][i]);
            acc[j][0] = fma8(p, v0, acc[j][0]); acc[j][1] = fma8(p, v1, acc[j][1]);
            acc[j][2] = fma8(p, v2, acc[j][2]); acc[j][3] = fma8(p, v3, acc[j][3]);
        }
    }
    for (int j = 0; j < nj; j++)
        for (int c = 0; c < 4; c++) store8(o[j] + e0 + 8 * c, acc[j][c] * inv[j]);
}

/* (i0, from: the list from entry i0 on, each head's chains started from from[j]'s 32 lanes;
   0, NULL: the whole list from zero) */
static void pv_heads(int nj, const float *const *x, const float *inv, float *const *o,
                     const kv_t *vv, int D, int cap, int e0, int n0, int n,
                     int P, const int *an, int i0, const float *const *from) {
    switch (nj) {
    case 1: pv_heads32(1, x, inv, o, vv, D, cap, e0, n0, n, P, an, i0, from); break;
    case 2: pv_heads32(2, x, inv, o, vv, D, cap, e0, n0, n, P, an, i0, from); break;
    default: pv_heads32(3, x, inv, o, vv, D, cap, e0, n0, n, P, an, i0, from); break;
    }
}

/* pv_heads32's chains over the cache rows [i0, i1) of one slice, for nj heads: the rows'
   value lanes [e0, e0 + 32) read as floats from vf (vf[(i - i0) * 32 + l], converted exactly
   from the cache), each head's 32 running sums loaded from and stored back to acc[j] */
static inline __attribute__((always_inline)) void pv_slice32(
        const int nj, const float *const *x, const float *vf, int i0, int i1,
        float *const *acc) {
    v8 a[3][4];
    for (int j = 0; j < nj; j++)
        for (int c = 0; c < 4; c++) a[j][c] = load8(acc[j] + 8 * c);
    for (int i = i0; i < i1; i++) {
        const float *vr = vf + (size_t)(i - i0) * 32;
        v8 v0 = load8(vr), v1 = load8(vr + 8), v2 = load8(vr + 16), v3 = load8(vr + 24);
        for (int j = 0; j < nj; j++) {
            v8 p = bcast8(x[j][i]);
            a[j][0] = fma8(p, v0, a[j][0]); a[j][1] = fma8(p, v1, a[j][1]);
            a[j][2] = fma8(p, v2, a[j][2]); a[j][3] = fma8(p, v3, a[j][3]);
        }
    }
    for (int j = 0; j < nj; j++)
        for (int c = 0; c < 4; c++) store8(acc[j] + 8 * c, a[j][c]);
}

static void pv_slice(int nj, const float *const *x, const float *vf, int i0, int i1,
                     float *const *acc) {
    switch (nj) {
    case 1: pv_slice32(1, x, vf, i0, i1, acc); break;
    case 2: pv_slice32(2, x, vf, i0, i1, acc); break;
    default: pv_slice32(3, x, vf, i0, i1, acc); break;
    }
}

/* a block's attention over a long cache, in three work-shared passes, each a different
   split of the same arithmetic so that the two threads of a one-row step share it evenly (by
   heads alone, 9 heads went 5:4) and a KV head's keys and values are read and converted once
   for all the query heads of its group and all the block's rows:
   1. cache scores, a task per (KV group, slice of SLICE keys): the group's query heads x the
      block's rows as the rows of qk_rows; past RT rows each key block is first converted to
      floats (wk) and read from there by every RTF rows' pass;
   2. a task per (block row, query head): the block's scores and the softmax (row_softmax);
   3. p @ V: one row, a task per (KV group, 32 value lanes), each value row loaded once for
      the group's heads; more rows, a task per (KV group, 32 lanes, run of rows), the cache's
      value rows PSL at a time converted to floats once for the run's rows and heads.
   Against attend_rows (each key block converted once per query head and 4 rows), see
   group_min_p_block for the measurements.
   Every score, weight and output lane is computed by the same chain as attend_rows computes
   it (lanes and keys are independent; only the split changes), so the block's rows are the
   same bits either way; tests compare the two paths bitwise. Called by every thread of the
   parallel region (orphaned work-sharing loops). S: T * H rows of row_stride(nb) floats, nb
   the longest list's bound (the cache rows plus the whole block's). */
#define SLICE 128
#define PSL 64  /* cache rows whose value lanes a p @ V task converts at once (T > 1) */

/* block rows a p @ V task of attend_groups takes: all T where the tasks of (KV group, 32
   lanes) are enough for the team, else runs short enough to give every thread work */
static int pv_task_rows(int T, int tasks) {
    int team = 1;
#ifdef _OPENMP
    team = omp_get_num_threads();
#endif
    int tr = tasks >= team ? T : (T * tasks + team - 1) / team;
    return tr < 1 ? 1 : tr;
}

/* attend_groups' p @ V over an int8 cache (pv_int): a task per (KV group, 32-lane chunk, run
   of block rows); one row: the group's heads over the whole list at once; more rows: the
   cache's rows PSL at a time (they stay in the first-level cache) for each of the run's rows
   and heads, each chain's int32 and float sums kept in wk between slices, then each row's
   own block rows. The same flush points and float operations as pv_row8: the same bits. A
   one-row step's tasks weigh their heads' lists themselves (pv_weights, into wk: the six
   tasks of SmolLM2's 3 groups x 2 chunks split evenly over two threads, its 9 softmax tasks
   do not), more rows read the weights row_softmax wrote. */
static void pv_groups8(int H, int Hkv, int T, int P, const int *lead, const int *nanc,
                       const int *anc, int na, const int8_t *vc, const float *vst, int D, int cap,
                       float *S, int nb, float *att, int ldatt, float *wk) {
    const int grp = H / Hkv, nec = D / 32;
    const size_t stride = row_stride(nb, nec, 1), wspan = wq_span(nb);
    const int tr = pv_task_rows(T, Hkv * nec), ntr = (T + tr - 1) / tr;
#pragma omp for schedule(static)
    for (int job = 0; job < Hkv * nec * ntr; job++) {
        int g = job / (nec * ntr), c = job / ntr % nec;
        int ta = job % ntr * tr, tb = ta + tr < T ? ta + tr : T;
        const int8_t *vp = vc + ((size_t)g * nec + c) * cap * 32;  /* the chunk, in pairs */
        int32_t *ai = (int32_t *)wk;  /* [(t - ta) * grp + j][32] */
        float *fs = wk + (size_t)tr * grp * 32;  /* the same, float sums */
        float *ws1 = fs + (size_t)tr * grp * 32;  /* T = 1: the heads' weight scales */
        int16_t *w1 = (int16_t *)(ws1 + pad8(grp));  /* and their weights, [j][wspan] */
        if (T == 1)
            for (int j = 0; j < grp; j++) {
                const float *x = S + (size_t)(g * grp + j) * stride;
                ws1[j] = pv_weights(x, vst + ((size_t)g * nec + c) * cap, P + lead[0],
                                    P + lead[0] + nanc[0], P, anc, w1 + j * wspan);
            }
        memset(ai, 0, sizeof(int32_t) * (size_t)(tb - ta) * grp * 32);
        memset(fs, 0, sizeof(float) * (size_t)(tb - ta) * grp * 32);
        /* the list's cache rows, PSL at a time for every row and head (T > 1), or at once;
           then (fin) each row's own block rows, the last flush and the output */
        const int sl = T == 1 ? P : PSL;
        for (int s0 = 0, fin = 0; !fin; s0 += sl) {
            fin = s0 >= P;
            for (int t = ta; t < tb; t++)
                for (int j0 = 0; j0 < grp; j0 += 3) {
                    int nj = grp - j0 < 3 ? grp - j0 : 3;
                    const int16_t *w[3];
                    float wsc[3], *f[3];
                    int32_t *a[3];
                    int n0 = P + lead[t], n = n0 + nanc[t], n8 = (n + 7) / 8 * 8;
                    for (int j = 0; j < nj; j++) {
                        const float *x = S + ((size_t)t * H + g * grp + j0 + j) * stride;
                        w[j] = T == 1 ? w1 + (j0 + j) * wspan
                                      : (const int16_t *)(x + nb + 24) + c * wspan;
                        wsc[j] = T == 1 ? ws1[j0 + j] : x[n8 + 1 + c];
                        a[j] = ai + ((size_t)(t - ta) * grp + j0 + j) * 32;
                        f[j] = fs + ((size_t)(t - ta) * grp + j0 + j) * 32;
                    }
                    const int i0 = fin ? P : s0, i1 = fin ? n : s0 + sl < P ? s0 + sl : P;
                    pv_ints(nj, 32, w, wsc, vp, 32, 0, i0, i1, n0, P, anc + (size_t)t * na, a, f);
                    for (int j = 0; fin && j < nj; j++) {
                        int hh = g * grp + j0 + j;
                        const float *x = S + ((size_t)t * H + hh) * stride;
                        pv_flush(n, a[j], wsc[j], f[j], x[n8],
                                 att + (size_t)t * ldatt + hh * D + c * 32, 32);
                    }
                }
        }
    }
}

static void attend_groups(const float *qkv, int Nqkv, int H, int Hkv, int T, int P,
                          const int *lead, const int *nanc, const int *anc, int na,
                          const void *kt,
                          const float *kst, const void *vc, const float *vst, int D, int cap,
                          const int32_t *QP, const float *QS,
                          float scale, float *S, int nb, float *att, int ldatt, float *wk) {
    const int grp = H / Hkv, nsl = (P + SLICE - 1) / SLICE, rows = T * grp, q8 = kst != NULL;
    const int nec = D / 32;  /* value chunks (D % 32 == 0 here) */
    const size_t stride = row_stride(nb, nec, q8), wspan = wq_span(nb);
#pragma omp for schedule(static)
    for (int job = 0; job < Hkv * nsl; job++) {
        int g = job / nsl, k0 = job % nsl * SLICE, k1 = k0 + SLICE < P ? k0 + SLICE : P;
        const void *kh = kv_at(kt, (size_t)g * D * cap, q8);
        const float *ks = q8 ? kst + (size_t)g * cap : NULL;
        if (rows <= RT || q8) {  /* passes of qk_rows: one converts each key block once
                                       already; an int8 cache's integer scores read the codes
                                       as they are (its slice of keys stays in the first-level
                                       cache between passes) */
            const int step = q8 ? RTI : RT;
            for (int r0 = 0; r0 < rows; r0 += step) {
                int n = rows - r0 < step ? rows - r0 : step;
                const float *q[RTI];
                const int32_t *qp[RTI] = {0};
                float qsc[RTI] = {0}, *out[RTI];
                for (int r = 0; r < n; r++) {
                    int t = (r0 + r) / grp, hh = g * grp + (r0 + r) % grp;
                    q[r] = qkv + (size_t)t * Nqkv + hh * D;
                    out[r] = S + ((size_t)t * H + hh) * stride + k0;
                    if (q8) {
                        qp[r] = QP + ((size_t)t * H + hh) * (D / 2);
                        qsc[r] = QS[(size_t)t * H + hh];
                    }
                }
                qk_rows(n, q, qp, qsc, kh, ks, D, k0, k1, scale, out);
            }
            continue;
        }
        /* more rows over half floats: each key block converted to floats once (exactly),
           then read by every RTF rows' pass from the first-level cache */
        float *kf = wk;
        for (int b = k0 >> 4; b <= (k1 - 1) >> 4; b++) {
            const size_t blk = (size_t)b * D * 16;
            for (int c = 0; c < D * 32; c += 64)
                __builtin_prefetch((const char *)((const kv_t *)kh + blk) + 4096 + c, 0, 0);
            for (int i = 0; i < D * 16; i += 8) store8(kf + i, loadh8((const kv_t *)kh + blk + i));
            int p0 = b * 16, lo = p0 < k0 ? k0 : p0, hi = p0 + 16 > k1 ? k1 : p0 + 16;
            for (int r0 = 0; r0 < rows; r0 += RTF) {
                int n = rows - r0 < RTF ? rows - r0 : RTF;
                const float *q[RTF];
                float *out[RTF];
                for (int r = 0; r < n; r++) {
                    int t = (r0 + r) / grp, hh = g * grp + (r0 + r) % grp;
                    q[r] = qkv + (size_t)t * Nqkv + hh * D;
                    out[r] = S + ((size_t)t * H + hh) * stride + k0;
                }
                qk_rows_f(n, q, kf, D, p0, lo, hi, k0, scale, out);
            }
        }
    }
#pragma omp for schedule(static)
    for (int job = 0; job < T * H; job++) {
        int t = job / H, hh = job % H;
        int g = hh / grp;
        float *x = S + (size_t)job * stride;
        row_softmax(qkv + (size_t)t * Nqkv + hh * D,
                    q8 ? QP + (size_t)job * (D / 2) : NULL, q8 ? QS[job] : 0.f,
                    kv_at(kt, (size_t)g * D * cap, q8), q8 ? kst + (size_t)g * cap : NULL, D, P,
                    lead[t], nanc[t], anc + (size_t)t * na, scale, x, P,
                    q8 ? vst + (size_t)g * nec * cap : NULL, cap,
                    T > 1 ? (int16_t *)(x + nb + 24) : NULL, wspan);
    }
    if (q8) {
        pv_groups8(H, Hkv, T, P, lead, nanc, anc, na, (const int8_t *)vc, vst, D, cap, S, nb,
                   att, ldatt, wk);
        return;
    }
    if (T == 1) {
#pragma omp for schedule(static)
        for (int job = 0; job < Hkv * nec; job++) {
            int g = job / nec, e0 = job % nec * 32;
            int n0 = P + lead[0], n = n0 + nanc[0], n8 = (n + 7) / 8 * 8;
            const kv_t *vv = (const kv_t *)vc + (size_t)g * cap * D;
            for (int j0 = 0; j0 < grp; j0 += 3) {
                int nj = grp - j0 < 3 ? grp - j0 : 3;
                const float *x[3];
                float inv[3], *o[3];
                for (int j = 0; j < nj; j++) {
                    int hh = g * grp + j0 + j;
                    x[j] = S + (size_t)hh * stride;
                    inv[j] = x[j][n8];
                    o[j] = att + hh * D;
                }
                pv_heads(nj, x, inv, o, vv, D, cap, e0, n0, n, P, anc, 0, NULL);
            }
        }
        return;
    }
    /* more rows: a task per (KV group, 32 value lanes, run of block rows); the cache's value
       rows go PSL at a time, converted to floats once (exactly) for all the task's rows and
       heads, each chain's 32 sums kept in wk between slices; then each row's own block rows
       continue its chains, as pv_heads does */
    const int tr = pv_task_rows(T, Hkv * nec), ntr = (T + tr - 1) / tr;
#pragma omp for schedule(static)
    for (int job = 0; job < Hkv * nec * ntr; job++) {
        int g = job / (nec * ntr), e0 = job / ntr % nec * 32;
        int ta = job % ntr * tr, tb = ta + tr < T ? ta + tr : T;
        const kv_t *vv = (const kv_t *)vc + (size_t)g * cap * D;
        float *vf = wk, *acc = wk + PSL * 32;  /* acc: [(t - ta) * grp + j][32] */
        memset(acc, 0, sizeof(float) * (size_t)(tb - ta) * grp * 32);
        for (int s0 = 0; s0 < P; s0 += PSL) {
            int s1 = s0 + PSL < P ? s0 + PSL : P;
            for (int i = s0; i < s1; i++) {
                size_t v = vidx(i, e0, D, cap);
                __builtin_prefetch(vv + v + 2048, 0, 0);
                float *vr = vf + (size_t)(i - s0) * 32;
                for (int c = 0; c < 4; c++) store8(vr + 8 * c, loadh8(vv + v + 8 * c));
            }
            for (int t = ta; t < tb; t++)
                for (int j0 = 0; j0 < grp; j0 += 3) {
                    int nj = grp - j0 < 3 ? grp - j0 : 3;
                    const float *x[3];
                    float *ap[3];
                    for (int j = 0; j < nj; j++) {
                        x[j] = S + ((size_t)t * H + g * grp + j0 + j) * stride;
                        ap[j] = acc + ((size_t)(t - ta) * grp + j0 + j) * 32;
                    }
                    pv_slice(nj, x, vf, s0, s1, ap);
                }
        }
        for (int t = ta; t < tb; t++) {
            int n0 = P + lead[t], n = n0 + nanc[t], n8 = (n + 7) / 8 * 8;
            for (int j0 = 0; j0 < grp; j0 += 3) {
                int nj = grp - j0 < 3 ? grp - j0 : 3;
                const float *x[3], *from[3];
                float inv[3], *o[3];
                for (int j = 0; j < nj; j++) {
                    int hh = g * grp + j0 + j;
                    x[j] = S + ((size_t)t * H + hh) * stride;
                    inv[j] = x[j][n8];
                    o[j] = att + (size_t)t * ldatt + hh * D;
                    from[j] = acc + ((size_t)(t - ta) * grp + j0 + j) * 32;
                }
                pv_heads(nj, x, inv, o, vv, D, cap, e0, n0, n, P, anc + (size_t)t * na, P,
                         from);
            }
        }
    }
}

/* top-k (value desc, then index asc) of one row of logits, its argmax and log-softmax; the
   scans go 8 logits at a time, a lane only looked at when it beats the k-th value so far */
static void row_out(const float *lg, int V, int k, int64_t *argmax, int64_t *ids, float *lp) {
    int i = 0;
    v8 mx = (v8){0} - INFINITY;
    for (; i + 8 <= V; i += 8) mx = max8(mx, load8(lg + i));
    float m = mx[0];
    for (int l = 1; l < 8; l++) m = mx[l] > m ? mx[l] : m;
    for (; i < V; i++) m = lg[i] > m ? lg[i] : m;
    int64_t am = 0;
    while (lg[am] != m && am + 1 < V) am++;  /* the first maximal index */
    *argmax = am;
    if (k <= 0) return;
    if (k > 64) k = 64;
    v8 s = {0};
    i = 0;
#ifdef __AVX512F__
    {
        const __m512 m16 = _mm512_set1_ps(m);
        for (; i + 16 <= V; i += 16)
            s = add_halves(s, vexp16_neg(_mm512_sub_ps(_mm512_loadu_ps(lg + i), m16)));
    }
#endif
    for (; i + 8 <= V; i += 8) s += vexp_neg(load8(lg + i) - m);
    float tot = sum8(s);
    for (; i < V; i++) tot += fexp(lg[i] - m);
    float lse = m + logf(tot);
    int n = 0;
    float vals[64];
    int idx[64];
    float thr = -INFINITY;  /* lanes at or below it cannot enter a full list */
    for (i = 0; i < V; i += 8) {
        int w = V - i < 8 ? V - i : 8;
        if (w == 8 && n == k) {
            vi8 hit = load8(lg + i) > ((v8){0} + thr);
            if (!(hit[0] | hit[1] | hit[2] | hit[3] | hit[4] | hit[5] | hit[6] | hit[7]))
                continue;
        }
        for (int l = 0; l < w; l++) {
            float x = lg[i + l];
            if (n == k && x <= vals[k - 1]) continue;
            int j = n < k ? n++ : k - 1;
            while (j > 0 && vals[j - 1] < x) { vals[j] = vals[j - 1]; idx[j] = idx[j - 1]; j--; }
            vals[j] = x;
            idx[j] = i + l;
            if (n == k) thr = vals[k - 1];
        }
    }
    for (i = 0; i < n; i++) { ids[i] = idx[i]; lp[i] = vals[i] - lse; }
}

/* scratch floats a call of T rows needs (see decoder_forward) */
#define GROUP_MAX_T 64  /* the widest block attend_groups runs (see group_min_p) */
#define GROUP_ROWS 16   /* block rows one attend_groups call takes (its scores S stay in the
                           second-level caches: 60 rows at once made t(60) 8 % slower than
                           attend_rows at P = 2000) */

/* a thread's working floats in attend_groups: a key block, or a value slice and the sums
   (an int8 cache: int32 and float sums, and a one-row step's weights of lists up to nb) */
static size_t group_wk(const Model *M, int gt, int nb, int q8) {
    const size_t grp = M->H / M->Hkv;
    size_t kb = (size_t)M->D * 16, vb = PSL * 32 + (size_t)gt * grp * 64;
    if (q8) vb += pad8(grp) + grp * wq_span(nb) / 2;
    return (kb > vb ? kb : vb) + 16;
}
static size_t group_scratch(const Model *M, int gt, int cap, int threads, int q8);

/* the floats decoder_forward's work must hold for blocks of up to T rows and a cache of cap
   rows (q8: an int8 cache) */
size_t decoder_scratch(const Model *M, int T, int cap, int q8) {
    int d = M->d, D = M->D;
    int Nqkv = M->qkv[0].G * 16, Ngu = M->gu[0].G * 16, Kmax = pad32(d > M->F ? d : M->F);
    int Kattn = pad32(M->H * D);
    if (Kattn > Kmax) Kmax = Kattn;
    int Vp = M->lm->G * 16;
    int rows = T < LM_ROWS ? T : LM_ROWS;
    size_t per_row = (size_t)2 * d + Nqkv + pad32(M->H * D) + Ngu + pad32(M->F) + d
                     + (size_t)M->H * (D / 2 + 1) + Kmax / 4 + 2 * (Kmax / 32);
    int threads = 1;
#ifdef _OPENMP
    threads = M->threads > 0 ? M->threads : omp_get_max_threads();
#endif
    int gt = T < GROUP_ROWS ? T : GROUP_ROWS, nch = D / vw(D);
    return per_row * T + 16 + (size_t)rows * Vp
           + (size_t)threads * RT * row_stride(cap + T, nch, q8)
           + group_scratch(M, gt, cap + T, threads, q8) + 64;
}

/* attend_groups' floats for blocks of up to gt rows and lists of up to nb entries: the scores
   S and each thread's wk */
static size_t group_scratch(const Model *M, int gt, int nb, int threads, int q8) {
    return (size_t)gt * M->H * row_stride(nb, M->D / vw(M->D), q8)
           + (size_t)threads * group_wk(M, gt, nb, q8);
}

/* the shortest cache at which a block of T <= GROUP_MAX_T rows takes attend_groups rather
   than attend_rows (the same bits either way; below it the passes' two extra barriers a
   layer cost more than the balance wins), for one-row steps. SmolLM2 int4, P = 2000,
   interleaved, order alternated: T = 1 4.93 -> 4.43 ms (2 threads), 8.09 -> 7.12 (1 thread).
   < 0: never. Tests set it to compare the paths. */
static int group_min_p = 512;
/* the same for blocks of group_min_t .. GROUP_MAX_T rows. Attention alone, both paths in
   one process alternated forward by forward (9 pairs; SmolLM2 int4, 2 threads, a 2-core Zen 3
   whose pairs of one build against itself differ by up to 5-10 %): at P = 700, T = 4 .. 60,
   groups/rows 0.80-0.89; at P = 300 0.86-0.97 from T = 8; at P = 2000 0.96-1.04; T = 2, 3
   1.03-1.27 at P = 300-700 (so rows). Below 256 cached rows the whole steps measured alike
   (within 2 %, P = 20 .. 200). Whole steps against the build before, paired in one process,
   stayed within that machine's noise (+-10 % at P = 700 and 2000). */
static int group_min_p_block = 256, group_min_t = 4;

/* both thresholds and every block size (tests: 0 always, -1 never); -2: the defaults */
void decoder_set_group_min_p(int p) {
    group_min_p = p == -2 ? 512 : p;
    group_min_p_block = p == -2 ? 256 : p;
    group_min_t = p == -2 ? 4 : 2;
}


/* the RoPE table's row for a position (clamped to the table) */
static inline int64_t rope_at(const Model *M, int64_t p) {
    return p >= M->rope_rows ? M->rope_rows - 1 : p < 0 ? 0 : p;
}

/* a new key and value row of KV group g into the cache at position pos: int8 codes with a
   scale per key row and per value chunk where kst is set, else half floats */
static void write_kv(const float *k, const float *v, int g, int pos, int D, int cap, void *kt,
                     void *vc, float *kst, float *vst) {
    if (kst) {
        const int nch = D / vw(D), w = vw(D);
        int8_t *kh = (int8_t *)kt + (size_t)g * D * cap;
        int8_t *vh = (int8_t *)vc + (size_t)g * cap * D;
        float sk = q8_scale(k, D);
        kst[(size_t)g * cap + pos] = sk;
        for (int e = 0; e < D; e++) kh[kidx8(pos, e, D)] = q8_code(k[e], sk);
        for (int c = 0; c < nch; c++) {
            float sv = q8_scale(v + c * w, w);
            vst[((size_t)g * nch + c) * cap + pos] = sv;
            for (int e = c * w; e < (c + 1) * w; e++) vh[vidx8(pos, e, D, cap)] = q8_code(v[e], sv);
        }
    } else {
        kv_t *kh = (kv_t *)kt + (size_t)g * D * cap;
        kv_t *vh = (kv_t *)vc + (size_t)g * cap * D;
        for (int e = 0; e < D; e++) kh[kidx(pos, e, D)] = f2h(k[e]);
        for (int e = 0; e < D; e++) vh[vidx(pos, e, D, cap)] = f2h(v[e]);
    }
}

/* unit u of a row's q/k/v (u < Hkv: KV group u's key and value, into the cache at pos; else
   query head u - Hkv, its int16 pairs into qp / qs where q8): its bias, q/k norm and rotary
   embedding. Each head's operations are its own: any order of units, the same bits */
static void head_in(const Model *M, int l, float *r, int u, const float *cs, const float *sn,
                    int q8, float *qs, int32_t *qp, int pos, int cap, void *kt, void *vc,
                    float *kst, float *vst) {
    const int H = M->H, Hkv = M->Hkv, D = M->D;
    const float *bias = M->qkv_bias ? M->qkv_bias + (size_t)l * (H + 2 * Hkv) * D : NULL;
    if (u < Hkv) {
        float *k = r + (size_t)(H + u) * D, *v = r + (size_t)(H + Hkv + u) * D;
        if (bias)
            for (int i = 0; i < D; i++) {
                k[i] += bias[(size_t)(H + u) * D + i];
                v[i] += bias[(size_t)(H + Hkv + u) * D + i];
            }
        if (M->q_norm) rms_norm(k, M->k_norm + (size_t)l * D, D, M->eps, k);
        rotate(k, 1, D, cs, sn);
        write_kv(k, v, u, pos, D, cap, kt, vc, kst, vst);
    } else {
        const int hh = u - Hkv;
        float *q = r + (size_t)hh * D;
        if (bias)
            for (int i = 0; i < D; i++) q[i] += bias[(size_t)hh * D + i];
        if (M->q_norm) rms_norm(q, M->q_norm + (size_t)l * D, D, M->eps, q);
        rotate(q, 1, D, cs, sn);
        if (q8) qs[hh] = q_pairs(q, D, qp + (size_t)hh * (D / 2)) * M->scale;
    }
}

/* one-row steps: the RoPE, query pairs and cache writes of a row's heads split between the
   threads (1, the default) or all on one (0: the row loop, for A/B runs) */
static int split_rows = 1;
void decoder_set_split_rows(int on) { split_rows = on; }

/* one block of T rows after the cache's len committed rows; its K/V land in the cache at rows
   len .. len + T - 1 (cap must hold them). Returns 0, or -1 when the block does not fit. */
int decoder_forward(const Model *M, Cache *C, const Call *X, float *work) {
    const int T = X->T, d = M->d, D = M->D, H = M->H, Hkv = M->Hkv, F = M->F;
    const int P = C->len, cap = C->cap, grp = H / Hkv, half = D / 2;
    if (P + T > cap) return -1;
    if (C->ks && (D % 2 || D > 2 * QP_MAX)) return -3;  /* the int8 cache's integer scores */
    const int Nqkv = M->qkv[0].G * 16, Ngu = M->gu[0].G * 16, Vp = M->lm->G * 16;
    int Kmax = pad32(d > F ? d : F);
    if (pad32(H * D) > Kmax) Kmax = pad32(H * D);
    int threads = 1;
#ifdef _OPENMP
    threads = M->threads > 0 ? M->threads : omp_get_max_threads();
#endif
    /* carve the scratch */
    float *x = work;                               /* [T][d] residual stream */
    float *h = x + (size_t)T * d;                  /* [T][d] normed */
    float *qkv = h + (size_t)T * d;                /* [T][Nqkv] */
    float *att = qkv + (size_t)T * Nqkv;           /* [T][pad32(H*D)] */
    float *gu = att + (size_t)T * pad32(H * D);    /* [T][Ngu] */
    float *mm = gu + (size_t)T * Ngu;              /* [T][pad32(F)] */
    float *y = mm + (size_t)T * pad32(F);          /* [T][d] */
    int32_t *QP = (int32_t *)(y + (size_t)T * d);  /* [T][H][D / 2] int8 cache: q_pairs */
    float *QS = (float *)(QP + pad8((size_t)T * H * (D / 2)));  /* [T][H] their scale * scale */
    int8_t *aq = (int8_t *)(QS + pad8((size_t)T * H));  /* [T][Kmax] (32-byte aligned as before) */
    float *as = (float *)(aq + (size_t)T * Kmax);  /* [T][Kmax/32] */
    int32_t *asum = (int32_t *)(as + (size_t)T * (Kmax / 32));
    float *lg = (float *)(asum + (size_t)T * (Kmax / 32));   /* [LM_ROWS][Vp] */
    int rows = T < LM_ROWS ? T : LM_ROWS;
    float *sc_all = lg + (size_t)rows * Vp;        /* per thread [RT][rs] */
    const int q8c = C->ks != NULL;
    const size_t rs = row_stride(cap + T, D / vw(D), q8c);  /* (as decoder_scratch) */
    /* each row's block ancestors beyond the leading run of ones (which sits contiguous after
       the cache): lead[t], then anc list */
    int *lead = (int *)malloc(sizeof(int) * T * (T + 2));
    if (!lead) return -2;
    int *nanc = lead + T, *anc = lead + 2 * T;
    for (int t = 0; t < T; t++) {
        const uint8_t *r = X->mask + (size_t)t * T;
        int a = 0;
        while (a < T && r[a]) a++;
        lead[t] = a;
        int n = 0;
        for (int j = a; j < T; j++) if (r[j]) anc[t * T + n++] = j;
        nanc[t] = n;
    }
    const int nbd = pad32(d) / 32;

#pragma omp parallel num_threads(threads)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *sc = sc_all + (size_t)tid * RT * rs;
        float *S = sc_all + (size_t)threads * RT * rs;  /* attend_groups' */
        const int gt = T < GROUP_ROWS ? T : GROUP_ROWS;
        float *wk = S + (size_t)gt * H * row_stride(cap + T, D / vw(D), q8c)
                    + (size_t)tid * group_wk(M, gt, cap + T, q8c);
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            embed_row(M, X->ids[t], X->mask_embeds, X->n_mask, x + (size_t)t * d);
            rms_norm(x + (size_t)t * d, M->norm_in, d, M->eps, h + (size_t)t * d);
            quant_row(h + (size_t)t * d, d, aq + (size_t)t * pad32(d), as + t * nbd, asum + t * nbd);
        }
        for (int l = 0; l < M->L; l++) {
            q4_gemm(&M->qkv[l], T, aq, as, asum, qkv, Nqkv);
            const int q8 = C->ks != NULL, nch = D / vw(D);
            void *kt = (void *)kv_at(C->k, (size_t)l * Hkv * D * cap, q8);
            void *vc = (void *)kv_at(C->v, (size_t)l * Hkv * cap * D, q8);
            float *kst = q8 ? C->ks + (size_t)l * Hkv * cap : NULL;
            float *vst = q8 ? C->vs + (size_t)l * Hkv * nch * cap : NULL;
            if (T == 1 && threads > 1 && split_rows) {
                /* one row: its heads dealt to the threads (KV groups first, round robin: the
                   cache writes, the dearest, land on both threads) */
                const int64_t p = rope_at(M, X->pos[0]);
#pragma omp for schedule(static, 1)
                for (int u = 0; u < Hkv + H; u++)
                    head_in(M, l, qkv, u, M->cos + p * half, M->sin + p * half, q8, QS, QP, P,
                            cap, kt, vc, kst, vst);
            } else {
#pragma omp for schedule(static)
                for (int t = 0; t < T; t++) {
                    const int64_t p = rope_at(M, X->pos[t]);
                    for (int u = 0; u < Hkv + H; u++)
                        head_in(M, l, qkv + (size_t)t * Nqkv, u, M->cos + p * half,
                                M->sin + p * half, q8, QS + (size_t)t * H,
                                QP + (size_t)t * H * (D / 2), P + t, cap, kt, vc, kst, vst);
                }
            }
            const int tiles = (T + RT - 1) / RT;
            /* one tile (plain steps, small trees): the heads in order, each thread a run of
               them, so a KV head's rows stay in its cache for its query heads; more: dynamic,
               as a causal block's later rows have more keys. Which thread computes a task
               changes no bit of it. */
            const int min_p = T == 1 ? group_min_p : T >= group_min_t ? group_min_p_block : -1;
            if (T <= GROUP_MAX_T && min_p >= 0 && P >= min_p && D % 32 == 0) {
                for (int c0 = 0; c0 < T; c0 += GROUP_ROWS)  /* rows are independent here */
                    attend_groups(qkv + (size_t)c0 * Nqkv, Nqkv, H, Hkv,
                                  T - c0 < GROUP_ROWS ? T - c0 : GROUP_ROWS, P, lead + c0,
                                  nanc + c0, anc + (size_t)c0 * T, T, kt, kst, vc, vst, D, cap,
                                  QP + (size_t)c0 * H * (D / 2), QS + (size_t)c0 * H, M->scale,
                                  S, P + T, att + (size_t)c0 * pad32(H * D), pad32(H * D), wk);
            } else if (tiles == 1) {
#pragma omp for schedule(static)
                for (int hh = 0; hh < H; hh++) {
                    int g = hh / grp;
                    attend_rows(qkv, Nqkv, hh, 0, T, P, T, lead, nanc, anc,
                                kv_at(kt, (size_t)g * D * cap, q8),
                                q8 ? kst + (size_t)g * cap : NULL,
                                kv_at(vc, (size_t)g * cap * D, q8),
                                q8 ? vst + (size_t)g * nch * cap : NULL, D, cap, QP, QS, H,
                                M->scale, sc, att, pad32(H * D));
                }
            } else {
#pragma omp for schedule(dynamic, 1)
                for (int job = 0; job < tiles * H; job++) {
                    int t0 = job / H * RT, hh = job % H, g = hh / grp;
                    attend_rows(qkv, Nqkv, hh, t0, T - t0 < RT ? T - t0 : RT, P, T, lead, nanc,
                                anc, kv_at(kt, (size_t)g * D * cap, q8),
                                q8 ? kst + (size_t)g * cap : NULL,
                                kv_at(vc, (size_t)g * cap * D, q8),
                                q8 ? vst + (size_t)g * nch * cap : NULL, D, cap, QP, QS, H,
                                M->scale, sc, att, pad32(H * D));
                }
            }
            const int ka = pad32(H * D), nba = ka / 32;
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++)
                quant_row(att + (size_t)t * ka, H * D, aq + (size_t)t * ka, as + t * nba, asum + t * nba);
            q4_gemm(&M->o[l], T, aq, as, asum, y, d);
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                float *xr = x + (size_t)t * d, *yr = y + (size_t)t * d;
                for (int i = 0; i < d; i++) xr[i] += yr[i];
                rms_norm(xr, M->norm_post + (size_t)l * d, d, M->eps, h + (size_t)t * d);
                quant_row(h + (size_t)t * d, d, aq + (size_t)t * pad32(d), as + t * nbd, asum + t * nbd);
            }
            q4_gemm(&M->gu[l], T, aq, as, asum, gu, Ngu);
            const int kf = pad32(F), nbf = kf / 32;
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                const float *gr = gu + (size_t)t * Ngu;
                float *mr = mm + (size_t)t * kf;
                int i = 0;
#ifdef __AVX512F__
                for (; i + 16 <= F; i += 16) {
                    __m512 z = _mm512_loadu_ps(gr + i);
                    __m512 e = vexp16(_mm512_castsi512_ps(_mm512_xor_si512(  /* -z, as a sign flip */
                        _mm512_castps_si512(z), _mm512_set1_epi32((int)0x80000000u))));
                    _mm512_storeu_ps(mr + i, _mm512_mul_ps(
                        _mm512_div_ps(z, _mm512_add_ps(_mm512_set1_ps(1.0f), e)),
                        _mm512_loadu_ps(gr + F + i)));
                }
#endif
                for (; i + 8 <= F; i += 8) {
                    v8 z = load8(gr + i);
                    store8(mr + i, z / (1.0f + vexp(-z)) * load8(gr + F + i));
                }
                for (; i < F; i++) {
                    float z = gr[i];
                    mr[i] = z / (1.0f + fexp(-z)) * gr[F + i];
                }
                quant_row(mr, F, aq + (size_t)t * kf, as + t * nbf, asum + t * nbf);
            }
            q4_gemm(&M->down[l], T, aq, as, asum, y, d);
            const float *wn = l + 1 < M->L ? M->norm_in + (size_t)(l + 1) * d : M->norm_final;
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                float *xr = x + (size_t)t * d, *yr = y + (size_t)t * d;
                for (int i = 0; i < d; i++) xr[i] += yr[i];
                rms_norm(xr, wn, d, M->eps, h + (size_t)t * d);
                quant_row(h + (size_t)t * d, d, aq + (size_t)t * pad32(d), as + t * nbd, asum + t * nbd);
                if (l + 1 == M->L && X->hidden)
                    memcpy(X->hidden + (size_t)t * d, h + (size_t)t * d, sizeof(float) * d);
            }
        }
        /* LM head, LM_ROWS rows at a time */
        for (int t0 = X->rows_from; t0 < T; t0 += LM_ROWS) {
            int tn = T - t0 < LM_ROWS ? T - t0 : LM_ROWS;
            float *out = X->logits ? X->logits + (size_t)t0 * M->V : lg;
            int ld = X->logits ? M->V : Vp;
            if (X->logits && ld % 16) { out = lg; ld = Vp; }
            q4_gemm(M->lm, tn, aq + (size_t)t0 * pad32(d), as + t0 * nbd, asum + t0 * nbd, out, ld);
#pragma omp for schedule(static)
            for (int i = 0; i < tn; i++) {
                const float *row = out + (size_t)i * ld;
                if (X->logits && out == lg)
                    memcpy(X->logits + (size_t)(t0 + i) * M->V, row, sizeof(float) * M->V);
                row_out(row, M->V, X->topk, X->argmax + t0 + i,
                        X->topk_ids + (size_t)(t0 + i) * X->topk,
                        X->topk_lp + (size_t)(t0 + i) * X->topk);
            }
        }
    }
    free(lead);
    return 0;
}

/* move the block rows `rows` (ascending, from the last forward) to follow the cache */
void decoder_commit(const Model *M, Cache *C, const int64_t *rows, int n) {
    const int D = M->D, cap = C->cap, P = C->len, q8 = C->ks != NULL, nch = D / vw(D);
    const size_t es = q8 ? 1 : 2;  /* bytes a cached value takes */
    for (int l = 0; l < M->L; l++)
        for (int g = 0; g < M->Hkv; g++) {
            const size_t lg = (size_t)l * M->Hkv + g;
            char *kt = (char *)C->k + lg * D * cap * es, *vc = (char *)C->v + lg * cap * D * es;
            for (int i = 0; i < n; i++) {
                int src = P + (int)rows[i], dst = P + i;
                if (src == dst) continue;
                if (q8) {
                    int8_t *kq = (int8_t *)kt, *vq = (int8_t *)vc;
                    for (int e = 0; e < D; e++) {
                        kq[kidx8(dst, e, D)] = kq[kidx8(src, e, D)];
                        vq[vidx8(dst, e, D, cap)] = vq[vidx8(src, e, D, cap)];
                    }
                    C->ks[lg * cap + dst] = C->ks[lg * cap + src];
                    for (int c = 0; c < nch; c++)
                        C->vs[(lg * nch + c) * cap + dst] = C->vs[(lg * nch + c) * cap + src];
                } else {
                    kv_t *kh = (kv_t *)kt, *vh = (kv_t *)vc;
                    for (int e = 0; e < D; e++) {
                        kh[kidx(dst, e, D)] = kh[kidx(src, e, D)];
                        vh[vidx(dst, e, D, cap)] = vh[vidx(src, e, D, cap)];
                    }
                }
            }
        }
    C->len = P + n;
}

/* how many threads a forward runs on (OpenMP's team size; 1 in a build without OpenMP) */
int decoder_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* which int4 kernel this build runs: 1 the AVX-512 VNNI one, 2 the Arm dot-product one, 3
   the AVX2 one, 0 the portable C one (the same bits, see tests/test_native_kernels.py) */
int decoder_kernel(void) {
#ifdef Q4_VNNI
    return 1;
#elif defined(Q4_SDOT)
    return 2;
#elif defined(Q4_AVX2)
    return 3;
#else
    return 0;
#endif
}

