# cmake -DCMD=<prog^^arg^^...> -DMATCH=<regex@@regex...> -DEXPECT_RC=<n> [-DSKIP_RC=<n>]
#       [-DNO_MATCH=<regex@@regex...>] -P run_and_match.cmake
#
# Runs CMD and passes when its exit status is EXPECT_RC and its output (stdout
# and stderr together) matches every regular expression of MATCH and none of
# NO_MATCH. ctest's own
# PASS_REGULAR_EXPRESSION ignores the exit status and passes on any one match;
# this checks both, and all of them.
string(REPLACE "^^" ";" cmd "${CMD}")
string(REPLACE "@@" ";" match "${MATCH}")
execute_process(COMMAND ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}")
if(err)
  message("${err}")
endif()
# -DSKIP_RC=<n>: that exit status means "skipped" (the test's SKIP_REGULAR_EXPRESSION
# matches what the program printed); pass it through as success.
if(DEFINED SKIP_RC AND "${rc}" STREQUAL "${SKIP_RC}")
  return()
endif()
if(NOT "${rc}" STREQUAL "${EXPECT_RC}")
  message(FATAL_ERROR "exit status ${rc}, expected ${EXPECT_RC}")
endif()
foreach(re IN LISTS match)
  if(NOT "${out}${err}" MATCHES "${re}")
    message(FATAL_ERROR "output does not match: ${re}")
  endif()
endforeach()
string(REPLACE "@@" ";" no_match "${NO_MATCH}")
foreach(re IN LISTS no_match)
  if("${out}${err}" MATCHES "${re}")
    message(FATAL_ERROR "output matches what it must not: ${re}")
  endif()
endforeach()
