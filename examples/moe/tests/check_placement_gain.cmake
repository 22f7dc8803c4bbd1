# SPDX-License-Identifier: Apache-2.0
# cmake -DCMD=<prog^^arg^^...> -DJSON=<file> -P check_placement_gain.cmake
#
# Runs ws_decode with --expert-placement hot (CMD writes its --json summary to
# JSON) and passes when experts were migrated after the prefill and the GPU
# experts' share of the decode's routed rows is higher under the migrated
# placement than under the placement at load (the same decode rows counted
# against both).
string(REPLACE "^^" ";" cmd "${CMD}")
file(REMOVE "${JSON}")
execute_process(COMMAND ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ws_decode exited with ${rc}:\n${out}\n${err}")
endif()
file(READ "${JSON}" j)
string(JSON mode GET "${j}" placement mode)
string(JSON migrations GET "${j}" placement migrations)
string(JSON total GET "${j}" placement decode_routed_rows)
string(JSON before GET "${j}" placement decode_device_rows_before_migration)
string(JSON after GET "${j}" placement decode_device_rows)
if(NOT mode STREQUAL "hot")
  message(FATAL_ERROR "placement mode ${mode}, expected hot")
endif()
if(NOT migrations GREATER 0)
  message(FATAL_ERROR "no expert migrated (placement.migrations ${migrations})")
endif()
if(NOT total GREATER 0)
  message(FATAL_ERROR "no routed decode rows counted")
endif()
if(NOT after GREATER before)
  message(FATAL_ERROR "device rows of the decode ${after} of ${total} after migration, ${before} before: no gain")
endif()
message("migrations ${migrations}; device rows of the decode ${before} -> ${after} of ${total}")
