# SPDX-License-Identifier: Apache-2.0
# cmake -DSOURCE=<refused/> -DBINARY=<dir> -DGENERATOR=<g> -DPREFIX=<install> -DCOMPONENTS=<a;b>
#       -DMATCH=<regex> [-DEXTRA=<-Dx=y;...>] -P expect_refusal.cmake
#
# Configures the consumer project SOURCE against the writescope installed in
# PREFIX, asking for COMPONENTS: passes when the configure fails and its
# output matches MATCH (the reason find_package gives).
file(REMOVE_RECURSE "${BINARY}")
string(REPLACE "," ";" components "${COMPONENTS}")
execute_process(COMMAND "${CMAKE_COMMAND}" -S "${SOURCE}" -B "${BINARY}" -G "${GENERATOR}"
                        "-DCMAKE_PREFIX_PATH=${PREFIX}" "-DWS_COMPONENTS=${components}" ${EXTRA}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(rc EQUAL 0)
  message(FATAL_ERROR "configuring with COMPONENTS ${components} succeeded; it should have been refused")
endif()
string(REGEX REPLACE "[ \t\r\n]+" " " flat "${out}${err}")  # CMake wraps long messages
if(NOT flat MATCHES "${MATCH}")
  message(FATAL_ERROR "configure failed, but its output does not match: ${MATCH}")
endif()
message(STATUS "refused as expected: ${CMAKE_MATCH_0}")
