/* Can a one-row step keep its K/V cache in the L3 while the weights stream past it? (issue 10:
   t(1) at P = 2048 against P = 64.) Per "layer", sum 1/30 of an 86 MB weight array (SmolLM2
   int4's), optionally prefetching it PREFETCHNTA DIST bytes ahead, then 1/30 of a K MB "cache"
   array; report both read rates over 25 steps. If the non-temporal hint kept the weights out
   of the L3, a cache under the L3's 32 MB would read at L3 speed from the second step on.

     cc -O2 -mavx2 bench/l3_nta.c -o /tmp/l3_nta && /tmp/l3_nta 23 0 && /tmp/l3_nta 23 1 2048

   2026-11-29, the 2-core AMD EPYC VM (AVX2, 32 MiB L3), one thread: the cache read at
   22.1-22.2 GB/s without the hint and 21.6-24.8 GB/s with it (23 MB), 22.4 / 20.5 GB/s (12 MB),
   the weights' rate 20.2 GB/s without and 16.6-17.9 with: no L3 residency, and the hint costs
   the weights 12-18 %. Not pursued (bench/results/drafting_host_cpu_2026-11-29.md). */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static __m256i sum_stream(const char*p,size_t n,int nta,int dist){
  __m256i a=_mm256_setzero_si256(),b=a;
  for(size_t i=0;i<n;i+=64){
    if(nta) _mm_prefetch(p+i+dist,_MM_HINT_NTA);
    a=_mm256_add_epi8(a,_mm256_load_si256((const __m256i*)(p+i)));
    b=_mm256_add_epi8(b,_mm256_load_si256((const __m256i*)(p+i+32)));
  }
  return _mm256_add_epi8(a,b);
}
int main(int argc,char**argv){
  size_t W=86u<<20, K=(size_t)atoi(argv[1])<<20; int nta=atoi(argv[2]); int dist=argc>3?atoi(argv[3]):1024;
  char*w=aligned_alloc(64,W+4096),*k=aligned_alloc(64,K+4096);
  memset(w,1,W+4096);memset(k,2,K+4096);
  int layers=30; size_t wl=W/layers, kl=K/layers;
  __m256i acc=_mm256_setzero_si256();
  double tw=0,tk=0;
  for(int it=0;it<30;it++){
    for(int l=0;l<layers;l++){
      double t0=now();
      acc=_mm256_add_epi8(acc,sum_stream(w+l*wl,wl,nta,dist));
      double t1=now();
      acc=_mm256_add_epi8(acc,sum_stream(k+l*kl,kl,0,0));
      double t2=now();
      if(it>=5){tw+=t1-t0;tk+=t2-t1;}
    }
  }
  printf("K=%zuMB nta=%d dist=%d: weights %.3f ms/step (%.1f GB/s), kv %.3f ms/step (%.1f GB/s) %d\n",K>>20,nta,dist,tw/25*1e3,W/(tw/25)/1e9,tk/25*1e3,K/(tk/25)/1e9,_mm256_extract_epi8(acc,0));
}
