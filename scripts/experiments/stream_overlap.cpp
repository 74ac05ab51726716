// Two threads streaming 800 MB of 8-bit codes with the interleaved tile's operations (AVX-512
// VNNI; one or five activation rows: per 64 bytes an integer sum a row, per run of 8 words the
// conversion, the scales' product and the multiply-add), against reading the same bytes alone,
// with and without software prefetches into L1 and L2 at several distances: whether a verify's
// arithmetic hides behind the memory stream, and whether prefetching helps it to.
//
//   g++ -O3 -march=native -pthread scripts/experiments/stream_overlap.cpp -o /tmp/so && /tmp/so
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <pthread.h>
#include <immintrin.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define RUNW 8
static size_t NW; // words per thread
static __m512i* buf;
static int xs[5][1<<16] __attribute__((aligned(64)));
static float xsc[5][1<<13];
static float sc[16];
static int T=5, PF0=2048, PF1=4096, MODE=1;
static volatile float sink[2];
typedef struct { int id; } arg_t;
static void* work(void* p){
  int id=((arg_t*)p)->id;
  const __m512i* w=buf+id*NW;
  __m512 c[5]; for(int r=0;r<5;r++) c[r]=_mm512_setzero_ps();
  __m512 s=_mm512_loadu_ps(sc);
  if(MODE==0){ // pure read
    __m512i acc=_mm512_setzero_si512();
    for(size_t i=0;i<NW;i++) acc=_mm512_add_epi32(acc,_mm512_loadu_si512(w+i));
    sink[id]=_mm512_reduce_add_epi32(acc); return 0;
  }
  size_t tilew=256; // words per tile (in=1024)
  for(size_t run=0; run<NW/RUNW; run++){
    const __m512i* p=w+run*RUNW;
    if(PF0) __builtin_prefetch((const char*)p+PF0,0,3);
    if(PF1) __builtin_prefetch((const char*)p+PF1,0,2);
    size_t xw=(run*RUNW)%tilew;
    if(T==5){
      __m512i a0=_mm512_setzero_si512(),a1=a0,a2=a0,a3=a0,a4=a0;
      for(int k=0;k<RUNW;k++){ __m512i v=_mm512_loadu_si512(p+k); size_t x=xw+k;
        a0=_mm512_dpbusd_epi32(a0,v,_mm512_set1_epi32(xs[0][x]));
        a1=_mm512_dpbusd_epi32(a1,v,_mm512_set1_epi32(xs[1][x]));
        a2=_mm512_dpbusd_epi32(a2,v,_mm512_set1_epi32(xs[2][x]));
        a3=_mm512_dpbusd_epi32(a3,v,_mm512_set1_epi32(xs[3][x]));
        a4=_mm512_dpbusd_epi32(a4,v,_mm512_set1_epi32(xs[4][x]));
      }
      size_t g=xw/RUNW;
      c[0]=_mm512_fmadd_ps(_mm512_cvtepi32_ps(a0),_mm512_mul_ps(s,_mm512_set1_ps(xsc[0][g])),c[0]);
      c[1]=_mm512_fmadd_ps(_mm512_cvtepi32_ps(a1),_mm512_mul_ps(s,_mm512_set1_ps(xsc[1][g])),c[1]);
      c[2]=_mm512_fmadd_ps(_mm512_cvtepi32_ps(a2),_mm512_mul_ps(s,_mm512_set1_ps(xsc[2][g])),c[2]);
      c[3]=_mm512_fmadd_ps(_mm512_cvtepi32_ps(a3),_mm512_mul_ps(s,_mm512_set1_ps(xsc[3][g])),c[3]);
      c[4]=_mm512_fmadd_ps(_mm512_cvtepi32_ps(a4),_mm512_mul_ps(s,_mm512_set1_ps(xsc[4][g])),c[4]);
    } else {
      __m512i a0=_mm512_setzero_si512();
      for(int k=0;k<RUNW;k++){ __m512i v=_mm512_loadu_si512(p+k); a0=_mm512_dpbusd_epi32(a0,v,_mm512_set1_epi32(xs[0][xw+k])); }
      size_t g=xw/RUNW;
      c[0]=_mm512_fmadd_ps(_mm512_cvtepi32_ps(a0),_mm512_mul_ps(s,_mm512_set1_ps(xsc[0][g])),c[0]);
    }
  }
  float t=0; for(int r=0;r<5;r++) t+=_mm512_reduce_add_ps(c[r]); sink[id]=t; return 0;
}
int main(int argc,char**argv){
  size_t bytes=(size_t)800<<20; NW=bytes/64/2;
  buf=static_cast<__m512i*>(aligned_alloc(64,bytes)); memset(buf,1,bytes);
  for(int i=0;i<16;i++) sc[i]=0.01f*i;
  for(int r=0;r<5;r++){ for(int i=0;i<(1<<16);i++) xs[r][i]=i*r; for(int i=0;i<(1<<13);i++) xsc[r][i]=1.0f/(i+1);}
  const char* cfgs[]={"read","T1 pf2k/4k","T5 pf2k/4k","T5 nopf","T5 pf0 4k only","T5 pf 4k/8k","T5 pf 8k/16k","T1 nopf", "T5 pf0 1k, pf1 4k"};
  int cf[][4]={{0,1,0,0},{1,1,2048,4096},{1,5,2048,4096},{1,5,0,0},{1,5,4096,0},{1,5,4096,8192},{1,5,8192,16384},{1,1,0,0},{1,5,1024,4096}};
  for(int rep=0;rep<3;rep++) for(int c=0;c<9;c++){
    MODE=cf[c][0];T=cf[c][1];PF0=cf[c][2];PF1=cf[c][3];
    pthread_t th[2]; arg_t a[2]={{0},{1}};
    double t0=now(); for(int i=0;i<2;i++) pthread_create(&th[i],0,work,&a[i]); for(int i=0;i<2;i++) pthread_join(th[i],0); double t1=now();
    printf("%-20s %.2f ms  %.1f GB/s\n", cfgs[c], (t1-t0)*1e3, bytes/(t1-t0)/1e9);
  }
}
