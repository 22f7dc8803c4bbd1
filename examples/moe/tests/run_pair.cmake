# SPDX-License-Identifier: Apache-2.0
# Included by the compare_*.cmake scripts: ws_run_pair_member(<A|B> <output file>)
# runs the ws_decode command CMD_<A|B> (arguments joined by ^^) after removing
# its output file; exit status 77 (no CUDA device) ends the calling script as a
# skip, any other non-zero status fails it; for B, the regex MATCH_B (when
# defined) must match what it printed.
macro(ws_run_pair_member x file)
  string(REPLACE "^^" ";" _ws_cmd "${CMD_${x}}")
  file(REMOVE "${file}")
  execute_process(COMMAND ${_ws_cmd} RESULT_VARIABLE _ws_rc OUTPUT_VARIABLE _ws_out ERROR_VARIABLE _ws_err)
  if(_ws_rc EQUAL 77)
    message("SKIPPED: no usable CUDA device")
    return()
  endif()
  if(NOT _ws_rc EQUAL 0)
    message(FATAL_ERROR "run ${x} exited with ${_ws_rc}:\n${_ws_out}\n${_ws_err}")
  endif()
  if("${x}" STREQUAL "B" AND DEFINED MATCH_B AND NOT _ws_out MATCHES "${MATCH_B}")
    message(FATAL_ERROR "run B's output does not match \"${MATCH_B}\":\n${_ws_out}")
  endif()
endmacro()
