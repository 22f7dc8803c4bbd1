# SPDX-License-Identifier: Apache-2.0
# cmake -DBUILD_DIR=<consumer build> -DPREFIX=<dir> -P check_install.cmake
#
# Installs the vendoring consumer into a fresh PREFIX: its own program must be
# there, and nothing of writescope (headers, package config, licence).
file(REMOVE_RECURSE "${PREFIX}")
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install ${BUILD_DIR} --prefix ${PREFIX} failed (${rc})")
endif()
file(GLOB_RECURSE installed RELATIVE "${PREFIX}" "${PREFIX}/*")
message(STATUS "installed: ${installed}")
if(NOT installed MATCHES "bin/consumer")
  message(FATAL_ERROR "the consumer's own program was not installed: ${installed}")
endif()
set(of_writescope ${installed})
list(FILTER of_writescope INCLUDE REGEX "writescope")
if(of_writescope)
  message(FATAL_ERROR "a vendored writescope (WRITESCOPE_INSTALL at its default, OFF) installed: ${of_writescope}")
endif()
