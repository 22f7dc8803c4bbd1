# SPDX-License-Identifier: Apache-2.0
# cmake -DCMD_A=<prog^^arg^^...> -DCMD_B=<...> -DOUT_A=<file> -DOUT_B=<file> [-DMATCH_B=<regex>] -P compare_tokens.cmake
#
# Runs two ws_decode commands that write their JSON summaries with --json OUT_A /
# OUT_B and passes only when both exit 0 and every sequence's generated tokens
# (the summaries' "tokens") are the same, e.g. greedy tokens chosen on the
# device against the host's argmax over the same logits; MATCH_B: a regex run
# B's output must match (that it did what it is compared for).
include(${CMAKE_CURRENT_LIST_DIR}/run_pair.cmake)
foreach(x A B)
  ws_run_pair_member(${x} "${OUT_${x}}")
  file(READ "${OUT_${x}}" json_${x})
  string(JSON tokens_${x} ERROR_VARIABLE err_${x} GET "${json_${x}}" tokens)
  if(err_${x})
    message(FATAL_ERROR "run ${x}: no tokens in ${OUT_${x}}: ${err_${x}}")
  endif()
  string(JSON n_${x} LENGTH "${json_${x}}" tokens)
endforeach()
if(n_A EQUAL 0)
  message(FATAL_ERROR "run A generated no sequences")
endif()
if(NOT tokens_A STREQUAL tokens_B)
  message(FATAL_ERROR "the tokens differ:\nA: ${tokens_A}\nB: ${tokens_B}")
endif()
message("tokens identical (${n_A} sequences)")
