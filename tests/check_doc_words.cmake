# SPDX-License-Identifier: Apache-2.0
# cmake -DROOT=<repository root> -P check_doc_words.cmake
#
# The reference documents and the headers are written for a reader who has
# never seen the project's work logs or its machines. README.md, docs/*.md
# (docs/results/ holds the dated notes and is exempt) and include/ must not
# name a work-log entry ("session 3"), files outside the repository
# (DESIGN.md, STYLE.md, ../shared) or the tool that lends the GPU machine;
# README.md and docs/*.md also no absolute paths of the development machine
# (its work tree's parent directory) and no $OUT or
# carry [...] of that tool's calls. Case-insensitive. ("session-end
# reclamation", the paper's term, is no work-log entry.)
cmake_minimum_required(VERSION 3.20)
if(NOT ROOT)
  message(FATAL_ERROR "usage: cmake -DROOT=<repository root> -P check_doc_words.cmake")
endif()
file(GLOB docs RELATIVE "${ROOT}" "${ROOT}/docs/*.md")
file(GLOB_RECURSE headers RELATIVE "${ROOT}" "${ROOT}/include/*")
set(everywhere "session [0-9]+" "design\\.md" "style\\.md" "\\.\\./shared" "device tool")
set(docs_only "/wor[k]/" "\\$out" "carry \\[")  # [k]: the pattern does not name the path itself

set(bad "")
foreach(f IN LISTS docs headers ITEMS README.md)
  file(READ "${ROOT}/${f}" text)
  string(TOLOWER "${text}" text)
  set(patterns ${everywhere})
  if(NOT f MATCHES "^include/")
    list(APPEND patterns ${docs_only})
  endif()
  foreach(re IN LISTS patterns)
    string(REGEX MATCHALL "[^\n]*${re}[^\n]*" hits "${text}")
    foreach(h IN LISTS hits)
      string(STRIP "${h}" h)
      string(REPLACE ";" "," h "${h}")
      list(APPEND bad "${f}: '${re}': ${h}")
    endforeach()
  endforeach()
endforeach()
if(bad)
  list(JOIN bad "\n  " lines)
  message(FATAL_ERROR "work-log or machine words in README.md, docs/*.md or include/:\n  ${lines}")
endif()
list(LENGTH docs nd)
list(LENGTH headers nh)
math(EXPR n "${nd} + ${nh} + 1")
message(STATUS "${n} files (README.md, docs/*.md, include/) free of work-log and machine words")
