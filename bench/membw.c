/* Read bandwidth of this machine, for the floor of a one-row step's time (README, "Why t(1)
   at P = 2048 stays above 1.3x"): the best of 20 passes summing an array of 24, 48 and 192
   MB with OMP_NUM_THREADS threads. 24 MB fits a 32 MB L3; 192 MB does not.

     cc -O3 -march=native -fopenmp bench/membw.c -o /tmp/membw && OMP_NUM_THREADS=2 /tmp/membw
*/
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

int main(void) {
    const size_t n = (size_t)48 << 20;  /* floats: 192 MB */
    float *a = NULL;
    if (posix_memalign((void **)&a, 64, n * sizeof(float))) return 1;
    for (size_t i = 0; i < n; i++) a[i] = (float)(i & 7);
    const size_t mb[] = {24, 48, 192};
    for (int k = 0; k < 3; k++) {
        size_t m = (mb[k] << 20) / sizeof(float);
        double best = 1e9, check = 0;
        for (int it = 0; it < 20; it++) {
            double t0 = omp_get_wtime(), tot = 0;
#pragma omp parallel reduction(+ : tot)
            {
                __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
#pragma omp for
                for (size_t i = 0; i < m; i += 16) {
                    s0 = _mm256_add_ps(s0, _mm256_load_ps(a + i));
                    s1 = _mm256_add_ps(s1, _mm256_load_ps(a + i + 8));
                }
                float t[8];
                _mm256_storeu_ps(t, _mm256_add_ps(s0, s1));
                for (int l = 0; l < 8; l++) tot += t[l];
            }
            double dt = omp_get_wtime() - t0;
            if (dt < best) best = dt;
            check += tot;
        }
        printf("%4zu MB: %6.1f GB/s (%.3f ms a pass) [%g]\n", mb[k], m * sizeof(float) / best / 1e9,
               best * 1e3, check);
    }
    free(a);
    return 0;
}
