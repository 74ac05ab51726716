// The AVX-512 kernel with VNNI: 8-bit products summed four to an int32 lane in one
// instruction (vpdpbusd) where kernel_avx512.cpp's takes three or six.
#define AVX512_NAME avx512_vnni
#include "kernel_avx512.cpp"
