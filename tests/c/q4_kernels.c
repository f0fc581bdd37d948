/* tests/test_native_kernels.py: the native decoder's int4 product (decoder.c q4_gemm) on
   random weights and activations, printed as the bits of every output float, so builds for
   other kernels and machines (AVX-512 VNNI, Arm dot products under qemu, portable C) can be
   compared: they must print the same. The scales are half-precision values, and every run
   is printed twice: with them as floats, then as halves (Q4W.sc16), which must agree; then a
   third time as a GGUF file's Q4_1 blocks (no zero points, half offsets: Q4W.mn16), then as
   8-bit matrices (Q4W.bits 8, one plane of bytes: a GGUF's Q8_0 LM head), with zero point 128
   (zp NULL) and with zero points of their own. */
#include <stdio.h>
#include "../../edgemtp/native/decoder.c"

static uint32_t rng = 12345;
static uint32_t next(void) { rng = rng * 1664525u + 1013904223u; return rng >> 8; }

int main(void) {
    enum { G = 3, NB = 5, T = 11 };
    static uint8_t w[G * NB * 256], zp[G * NB * 16], w8[G * NB * 512], zp8[G * NB * 16];
    static float sc[G * NB * 16], x[T * NB * 32], y[T * G * 16], as[T * NB];
    static uint16_t sc16[G * NB * 16], mn16[G * NB * 16];
    static int8_t aq[T * NB * 32];
    static int32_t asum[T * NB];
    for (int i = 0; i < G * NB * 256; i++) w[i] = (uint8_t)next();
    for (int i = 0; i < G * NB * 512; i++) w8[i] = (uint8_t)next();
    for (int i = 0; i < G * NB * 16; i++) {
        zp[i] = (uint8_t)(next() % 16);
        sc16[i] = f2h((float)(next() % 100000) / 1e6f + 1e-4f);
        sc[i] = h2f(sc16[i]);
        mn16[i] = f2h(-(float)(next() % 100000) / 1e5f * 0.08f);
        zp8[i] = (uint8_t)next();
    }
    for (int i = 0; i < T * NB * 32; i++) x[i] = ((float)(next() % 200001) - 100000.f) / 3e4f;
    for (int j = 0; j < 32; j++) x[3 * NB * 32 + 32 + j] = 0.f;  /* a block of zeros */
    for (int t = 0; t < T; t++)
        quant_row(x + t * NB * 32, NB * 32, aq + t * NB * 32, as + t * NB, asum + t * NB);
    Q4W m32 = {G, NB, w, sc, zp, NULL, NULL, 4}, m16 = {G, NB, w, NULL, zp, sc16, NULL, 4};
    Q4W m41 = {G, NB, w, NULL, NULL, sc16, mn16, 4};
    Q4W m8 = {G, NB, w8, NULL, NULL, sc16, NULL, 8}, m8z = {G, NB, w8, NULL, zp8, sc16, NULL, 8};
    const Q4W *mats[5] = {&m32, &m16, &m41, &m8, &m8z};
    printf("kernel %d\n", decoder_kernel());
    /* the 11 rows together (tiles of 8 and 3), then the first row alone, the first two and
       the first four: every way the row-group kernels split a tile (AVX2: blocks of up to 4
       rows unpack each weight block as they use it, wider ones into registers kept for the
       tile); float scales, halves, Q4_1 blocks, 8 bits (zero point 128, then their own) */
    const int runs[4] = {T, 1, 2, 4};
    for (int k = 0; k < 20; k++) {
        q4_gemm(mats[k / 4], runs[k % 4], aq, as, asum, y, G * 16);
        for (int i = 0; i < runs[k % 4] * G * 16; i++) {
            uint32_t b;
            memcpy(&b, &y[i], 4);
            printf("%08x%c", b, i % 8 == 7 ? '\n' : ' ');
        }
    }
    /* the Q4_1 run against the formula in double precision (the offsets enter as m *
       a_scale * sum_j a_j), and the 8-bit ones: u - z, z 128 or the column's own */
    for (int which = 0; which < 3; which++) {
    q4_gemm(which == 2 ? &m8z : which ? &m8 : &m41, T, aq, as, asum, y, G * 16);
    for (int t = 0; t < T; t++)
        for (int col = 0; col < G * 16; col++) {
            int g = col / 16, r = col % 16;
            double want = 0, mag = 0;
            for (int b = 0; b < NB; b++) {
                const uint8_t *wb = w + ((size_t)g * NB + b) * 256;
                const uint8_t *wb8 = w8 + ((size_t)g * NB + b) * 512;
                long acc = 0, sa = 0;
                for (int c = 0; c < 4 && !which; c++)
                    for (int e = 0; e < 4; e++) {
                        uint8_t v = wb[64 * c + r * 4 + e];
                        acc += (v & 15) * aq[t * NB * 32 + b * 32 + 8 * c + e]
                               + (v >> 4) * aq[t * NB * 32 + b * 32 + 8 * c + 4 + e];
                    }
                for (int k = 0; k < 8 && which; k++)
                    for (int e = 0; e < 4; e++)
                        acc += wb8[64 * k + r * 4 + e] * aq[t * NB * 32 + b * 32 + 4 * k + e];
                for (int j = 0; j < 32; j++) sa += aq[t * NB * 32 + b * 32 + j];
                size_t so = ((size_t)g * NB + b) * 16 + r;
                const long z = which == 2 ? zp8[so] : 128;
                double term = which
                    ? (double)h2f(sc16[so]) * as[t * NB + b] * (acc - z * sa)
                    : (double)h2f(sc16[so]) * as[t * NB + b] * acc
                      + (double)h2f(mn16[so]) * as[t * NB + b] * sa;
                want += term;
                mag += fabs(term);
            }
            if (fabs(y[t * G * 16 + col] - want) > 1e-5 * mag + 1e-30) {
                fprintf(stderr, "%s row %d column %d: %g, expected %g\n",
                        which ? "8-bit" : "Q4_1", t, col, y[t * G * 16 + col], want);
                return 1;
            }
        }
    }
    return 0;
}
