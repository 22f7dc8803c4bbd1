# cmake -DBUILD_DIR=<build> -DPREFIX=<dir> [-DCONFIG=<cfg>] -P install.cmake
#
# Installs the writescope build in BUILD_DIR into a fresh PREFIX and checks
# that the headers and the package config files are there.
file(REMOVE_RECURSE "${PREFIX}")
set(config_args "")
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}" ${config_args}
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install ${BUILD_DIR} --prefix ${PREFIX} failed (${rc})")
endif()
file(GLOB_RECURSE config_files "${PREFIX}/*/writescopeConfig.cmake")
foreach(required include/writescope/writescope.hpp include/writescope/cpu/attention.hpp)
  if(NOT EXISTS "${PREFIX}/${required}")
    message(FATAL_ERROR "install: ${PREFIX}/${required} is missing")
  endif()
endforeach()
if(NOT config_files)
  message(FATAL_ERROR "install: no writescopeConfig.cmake under ${PREFIX}")
endif()
message(STATUS "installed into ${PREFIX}: ${config_files}")
