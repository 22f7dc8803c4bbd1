# Finds xsimd (>= 8). Debian 12's xsimd 8.1 package exports its target with
# INTERFACE_LINK_LIBRARIES "xtl" although it does not depend on xtl and
# writescope never uses xsimd's xtl integration: without a target of that
# name the link line gets "-lxtl" and fails. Provide an empty stand-in.
find_package(xtl QUIET)
if(NOT TARGET xtl)
  add_library(xtl INTERFACE IMPORTED)
endif()
find_package(xsimd 8 REQUIRED)
