// The AVX-512 kernel with VNNI and BF16: bf16 weights times bf16 activations two products to
// an fp32 lane in one instruction (vdpbf16ps), besides kernel_avx512_vnni.cpp's integer sums.
#define AVX512_NAME avx512_bf16
#include "kernel_avx512.cpp"
