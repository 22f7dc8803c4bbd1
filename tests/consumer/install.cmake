# SPDX-License-Identifier: Apache-2.0
# cmake -DBUILD_DIR=<build> -DPREFIX=<dir> [-DCONFIG=<cfg>] [-DEXPECT_CUDA=ON|OFF]
#       [-DSOURCE_DIR=<writescope> -DCONFIGURE_ARGS=<-Dx=y;...> -DGENERATOR=<g> -DPREFIX_PATH=<dirs>] -P install.cmake
#
# Installs the writescope build in BUILD_DIR into a fresh PREFIX and checks
# that the headers and the package config files are there, and that the CUDA
# headers and the cuda component are there exactly when EXPECT_CUDA is ON.
# With SOURCE_DIR, first configures SOURCE_DIR into a fresh BUILD_DIR with
# CONFIGURE_ARGS, its dependencies on PREFIX_PATH (header-only: no build step is
# needed before the install).
if(SOURCE_DIR)
  file(REMOVE_RECURSE "${BUILD_DIR}")
  execute_process(COMMAND "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${BUILD_DIR}" -G "${GENERATOR}"
                          "-DCMAKE_PREFIX_PATH=${PREFIX_PATH}" ${CONFIGURE_ARGS}
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "configuring ${SOURCE_DIR} into ${BUILD_DIR} failed (${rc})")
  endif()
endif()
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
if(NOT config_files)
  message(FATAL_ERROR "install: no writescopeConfig.cmake under ${PREFIX}")
endif()
get_filename_component(config_dir "${config_files}" DIRECTORY)
foreach(required include/writescope/writescope.hpp include/writescope/cpu/attention.hpp
                 include/writescope/reference.hpp include/writescope/calibration.hpp)
  if(NOT EXISTS "${PREFIX}/${required}")
    message(FATAL_ERROR "install: ${PREFIX}/${required} is missing")
  endif()
endforeach()
foreach(component core reference calibration)
  if(NOT EXISTS "${config_dir}/writescope-${component}-targets.cmake")
    message(FATAL_ERROR "install: ${config_dir}/writescope-${component}-targets.cmake is missing")
  endif()
endforeach()
if(DEFINED EXPECT_CUDA)
  set(has_cuda OFF)
  if(EXISTS "${PREFIX}/include/writescope/cuda/cuda_backend.hpp")
    set(has_cuda ON)
  endif()
  if(EXISTS "${config_dir}/writescope-cuda-targets.cmake" AND NOT has_cuda)
    message(FATAL_ERROR "install: the cuda component is there without the CUDA headers")
  endif()
  if(NOT has_cuda STREQUAL EXPECT_CUDA)
    message(FATAL_ERROR "install: CUDA headers installed: ${has_cuda}, expected ${EXPECT_CUDA}")
  endif()
endif()
# A package must not record the build machine's paths of optional tools.
file(GLOB package_files "${config_dir}/*.cmake")
foreach(f IN LISTS package_files)
  file(READ "${f}" text)
  if(text MATCHES "/usr/local/cuda[^ ]*|/opt/nvidia[^ ]*")
    message(FATAL_ERROR "install: ${f} names the build machine's CUDA (${CMAKE_MATCH_0})")
  endif()
endforeach()
message(STATUS "installed into ${PREFIX}: ${config_files}")
