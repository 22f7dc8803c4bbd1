# SPDX-License-Identifier: Apache-2.0
# cmake -DSOURCE=examples/minimal.cpp -DREADME=README.md -P check_readme_snippet.cmake
#
# README (README.md, or docs/EMBEDDING.md for minimal_cuda.cpp) must contain, verbatim, the code between the "// README-BEGIN" and
# "// README-END" lines of SOURCE (less the two spaces of indentation of
# main's body), so that the snippet users read is code that compiles and runs.
file(READ "${SOURCE}" src)
file(READ "${README}" readme)
string(FIND "${src}" "// README-BEGIN\n" begin)
string(FIND "${src}" "  // README-END" end)
if(begin EQUAL -1 OR end EQUAL -1 OR end LESS begin)
  message(FATAL_ERROR "${SOURCE}: no '// README-BEGIN' ... '// README-END' block")
endif()
math(EXPR begin "${begin} + 16")
math(EXPR length "${end} - ${begin}")
string(SUBSTRING "${src}" ${begin} ${length} snippet)
# Dedent by two spaces. (No "^" in the pattern: CMake's REGEX REPLACE
# re-anchors "^" after every match, which would strip deeper indentation.)
string(REPLACE "\n  " "\n" snippet "\n${snippet}")
string(SUBSTRING "${snippet}" 1 -1 snippet)
string(FIND "${readme}" "${snippet}" at)
if(at EQUAL -1)
  get_filename_component(readme_name "${README}" NAME)
  message(FATAL_ERROR "${readme_name} does not contain the snippet of ${SOURCE} verbatim; paste this into its code block:\n"
                      "${snippet}")
endif()
message(STATUS "${README} holds the snippet of ${SOURCE} (${length} bytes)")
