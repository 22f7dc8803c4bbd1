# SPDX-License-Identifier: Apache-2.0
# cmake -DCMD_A=<prog^^arg^^...> -DCMD_B=<...> -DJSON_A=<file> -DJSON_B=<file> [-DMATCH_B=<regex>]
#       -P compare_hbm_split.cmake
#
# Runs two ws_decode commands that write their --json summaries to JSON_A and
# JSON_B: A without the HBM-resident KV region (--hbm-kv off), B with the one
# the VRAM split gave it. Passes when both exit 0, the generated tokens are
# identical, A attended no KV token in HBM, B's region holds at least one
# eviction batch and B attended KV tokens there; MATCH_B: a regex B's output
# must match. Exit status 77 from either run (no CUDA device) is a skip.
include(${CMAKE_CURRENT_LIST_DIR}/run_pair.cmake)
foreach(x A B)
  ws_run_pair_member(${x} "${JSON_${x}}")
  file(READ "${JSON_${x}}" j_${x})
  string(JSON tokens_${x} GET "${j_${x}}" tokens)
  string(JSON hbm_tokens_${x} GET "${j_${x}}" attention hbm_tokens)
  string(JSON region_${x} GET "${j_${x}}" vram_split hbm_capacity_tokens)
endforeach()
if(NOT tokens_A STREQUAL tokens_B)
  message(FATAL_ERROR "the generated tokens differ:\n  --hbm-kv off: ${tokens_A}\n  with the region: ${tokens_B}")
endif()
if(NOT hbm_tokens_A EQUAL 0 OR NOT region_A EQUAL 0)
  message(FATAL_ERROR "run A has an HBM KV region (${region_A} tokens per layer) or attended ${hbm_tokens_A} KV tokens there")
endif()
if(NOT region_B GREATER 0 OR NOT hbm_tokens_B GREATER 0)
  message(FATAL_ERROR "run B's HBM KV region holds ${region_B} tokens per layer and it attended ${hbm_tokens_B} KV tokens "
                      "there; the split should have given it some")
endif()
message("tokens identical; HBM KV region ${region_B} tokens per layer, ${hbm_tokens_B} KV tokens attended there")
