# SPDX-License-Identifier: Apache-2.0
# cmake -DCMD_A=<prog^^arg^^...> -DCMD_B=<...> -DOUT_A=<file> -DOUT_B=<file> -P compare_runs.cmake
#
# Runs two ws_decode commands that write their logits with --logits-out OUT_A /
# OUT_B and passes only when both exit 0 and the two files are byte-identical
# (bit-exact logits: e.g. the prefill with host experts streamed to the device
# against the prefill with every expert resident); MATCH_B: a regex run B's
# output must match (that it did what it is compared for).
include(${CMAKE_CURRENT_LIST_DIR}/run_pair.cmake)
foreach(x A B)
  ws_run_pair_member(${x} "${OUT_${x}}")
  file(SIZE "${OUT_${x}}" size_${x})
endforeach()
if(size_A EQUAL 0)
  message(FATAL_ERROR "run A wrote no logits")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files "${OUT_A}" "${OUT_B}" RESULT_VARIABLE diff)
if(NOT diff EQUAL 0)
  message(FATAL_ERROR "the logits differ (${OUT_A}: ${size_A} bytes, ${OUT_B}: ${size_B} bytes)")
endif()
message("logits bit-identical (${size_A} bytes)")
