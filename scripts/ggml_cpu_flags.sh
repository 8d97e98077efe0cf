#!/usr/bin/env bash
# The CMake flags for a llama.cpp (ggml) CPU build that runs on this host: GGML_NATIVE off (the native build's AMX
# path died with SIGILL on an AMX Xeon: "amx repack tensor ..." then Illegal instruction), the instruction sets
# this CPU reports turned on one by one, AMX off. Printed on one line, for CMAKE_ARGS or a cmake command line.
flags=$(grep -m1 -o -w -E 'avx|avx2|fma|f16c|avx512f|avx512bw|avx512vl|avx512dq|avx512cd|avx512_vnni|avx512_bf16|avx512vbmi|avx_vnni' /proc/cpuinfo | sort -u)
has() { grep -qx "$1" <<<"$flags"; }
args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
on() { if has "$1"; then args="$args -D$2=ON"; else args="$args -D$2=OFF"; fi; }
on avx GGML_AVX; on avx2 GGML_AVX2; on fma GGML_FMA; on f16c GGML_F16C; on avx_vnni GGML_AVX_VNNI
if has avx512f && has avx512bw && has avx512vl && has avx512dq && has avx512cd; then
    args="$args -DGGML_AVX512=ON"
    on avx512_vnni GGML_AVX512_VNNI; on avx512_bf16 GGML_AVX512_BF16; on avx512vbmi GGML_AVX512_VBMI
else
    args="$args -DGGML_AVX512=OFF"
fi
echo "$args"
