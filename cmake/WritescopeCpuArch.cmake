# writescope_target_cpu_arch(<target> <arch>)
#
# Compiles <target>'s sources for the ISA the CPU attention kernels should use
# (xsimd picks its best architecture from the compiler flags). <arch> is one of
#   native  -march=native (the build machine's ISA; the default for our own targets)
#   avx512  -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma
#   avx2    -mavx2 -mfma
#   sse2    nothing beyond the x86-64 baseline
#   none    leave the flags alone
# At run time cpu::require_cpu_support() rejects a binary moved to a CPU that
# lacks the ISA, with a config_error instead of SIGILL.
function(writescope_target_cpu_arch target arch)
  if(arch STREQUAL "native")
    set(flags -march=native)
  elseif(arch STREQUAL "avx512")
    set(flags -mavx512f -mavx512bw -mavx512dq -mavx512vl -mavx2 -mfma)
  elseif(arch STREQUAL "avx2")
    set(flags -mavx2 -mfma)
  elseif(arch STREQUAL "sse2" OR arch STREQUAL "none")
    set(flags "")
  else()
    message(FATAL_ERROR "writescope_target_cpu_arch: unknown arch '${arch}' (native, avx512, avx2, sse2, none)")
  endif()
  if(flags)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${flags}>)
  endif()
endfunction()
