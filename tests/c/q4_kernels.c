/* tests/test_native_kernels.py: the native decoder's int4 product (decoder.c q4_gemm) on
   random weights and activations, printed as the bits of every output float, so builds for
   other kernels and machines (AVX-512 VNNI, Arm dot products under qemu, portable C) can be
   compared: they must print the same. The scales are half-precision values, and every run
   is printed twice: with them as floats, then as halves (Q4W.sc16), which must agree. */
#include <stdio.h>
#include "../../edgemtp/native/decoder.c"

static uint32_t rng = 12345;
static uint32_t next(void) { rng = rng * 1664525u + 1013904223u; return rng >> 8; }

int main(void) {
    enum { G = 3, NB = 5, T = 11 };
    static uint8_t w[G * NB * 256], zp[G * NB * 16];
    static float sc[G * NB * 16], x[T * NB * 32], y[T * G * 16], as[T * NB];
    static uint16_t sc16[G * NB * 16];
    static int8_t aq[T * NB * 32];
    static int32_t asum[T * NB];
    for (int i = 0; i < G * NB * 256; i++) w[i] = (uint8_t)next();
    for (int i = 0; i < G * NB * 16; i++) {
        zp[i] = (uint8_t)(next() % 16);
        sc16[i] = f2h((float)(next() % 100000) / 1e6f + 1e-4f);
        sc[i] = h2f(sc16[i]);
    }
    for (int i = 0; i < T * NB * 32; i++) x[i] = ((float)(next() % 200001) - 100000.f) / 3e4f;
    for (int t = 0; t < T; t++)
        quant_row(x + t * NB * 32, NB * 32, aq + t * NB * 32, as + t * NB, asum + t * NB);
    Q4W m32 = {G, NB, w, sc, zp, NULL}, m16 = {G, NB, w, NULL, zp, sc16};
    printf("kernel %d\n", decoder_kernel());
    /* the 11 rows together (tiles of 8 and 3), then the first row alone and the first two:
       every way the row-group kernels split a tile; float scales, then halves */
    const int runs[3] = {T, 1, 2};
    for (int k = 0; k < 6; k++) {
        q4_gemm(k < 3 ? &m32 : &m16, runs[k % 3], aq, as, asum, y, G * 16);
        for (int i = 0; i < runs[k % 3] * G * 16; i++) {
            uint32_t b;
            memcpy(&b, &y[i], 4);
            printf("%08x%c", b, i % 8 == 7 ? '\n' : ' ');
        }
    }
    return 0;
}
