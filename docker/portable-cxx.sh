#!/bin/sh
# C++ compiler wrapper for building DeepSpeed's CPU ops into a runtime image: CXX=/etc/textsql/portable-cxx.sh.
#
# DeepSpeed's CPU op builder (cpu_adam: the optimizer of ZeRO offload) compiles with -march=native and a SIMD
# define it reads from the CPU of the machine that builds it (-D__AVX512__ on an AVX-512 build host). An op built
# that way dies with SIGILL (illegal instruction) on a pod whose CPU lacks those instructions — for example an
# image built on an Intel Xeon and run on an AMD EPYC of an older generation. This wrapper compiles for a fixed
# target instead: -march=native becomes -march=$TEXTSQL_CPU_ARCH -mtune=generic (default x86-64-v3: AVX2, FMA,
# F16C, BMI2 — every x86-64 server CPU since Intel Haswell (2013) and AMD Zen (2017)), and unless that target is
# x86-64-v4 the AVX-512 define becomes DeepSpeed's AVX2 one (-D__AVX256__). Every other argument is passed as is
# to the real compiler ($TEXTSQL_REAL_CXX, default g++). docker/check_image.sh checks the result.
set -eu
arch="${TEXTSQL_CPU_ARCH:-x86-64-v3}"
first=1
for arg do
  if [ "$first" = 1 ]; then set --; first=0; fi
  case "$arg" in
    -march=native) set -- "$@" "-march=$arch" -mtune=generic ;;
    -D__AVX512__) if [ "$arch" = x86-64-v4 ]; then set -- "$@" "$arg"; else set -- "$@" -D__AVX256__; fi ;;
    *) set -- "$@" "$arg" ;;
  esac
done
exec "${TEXTSQL_REAL_CXX:-g++}" "$@"
