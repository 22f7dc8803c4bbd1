# SPDX-License-Identifier: Apache-2.0
# Included before find_package(xsimd 8) (by writescope's own CMakeLists.txt and
# by its installed package config). Debian 12's xsimd 8.1 package exports its
# target with INTERFACE_LINK_LIBRARIES "xtl" although it does not depend on xtl
# and writescope never uses xsimd's xtl integration: without a target of that
# name the link line gets "-lxtl" and fails. Provide an empty stand-in.
find_package(xtl QUIET)
if(NOT TARGET xtl)
  add_library(xtl INTERFACE IMPORTED)
endif()
