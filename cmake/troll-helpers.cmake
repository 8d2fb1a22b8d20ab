# troll-helpers.cmake — how troll's own tests, benchmarks and examples are built.
# `troll_developer_options` carries the warnings and sanitizers; it is linked to developer
# targets only, never to `troll` itself, so consumers inherit none of these flags.

include_guard(GLOBAL)

add_library(troll_developer_options INTERFACE)

if(MSVC)
  target_compile_options(troll_developer_options
                         INTERFACE $<$<COMPILE_LANGUAGE:CXX>:/W4 /permissive->)
  if(TROLL_WARNINGS_AS_ERRORS)
    target_compile_options(troll_developer_options INTERFACE $<$<COMPILE_LANGUAGE:CXX>:/WX>)
  endif()
else()
  target_compile_options(troll_developer_options
                         INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic>)
  if(TROLL_WARNINGS_AS_ERRORS)
    # GCC's -Wmaybe-uninitialized misfires on Eigen's inlined fixed-capacity arrays at -O2/-O3
    # (reported inside Eigen's headers); it stays a warning, never an error.
    target_compile_options(
      troll_developer_options
      INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-Werror>
                $<$<COMPILE_LANG_AND_ID:CXX,GNU>:-Wno-error=maybe-uninitialized>)
  endif()
  # nvcc's generated host code is not -Wpedantic clean, and its front end warns about Eigen;
  # CUDA sources get the host warnings, never as errors.
  target_compile_options(troll_developer_options
                         INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
endif()

if(TROLL_NATIVE_ARCH AND NOT MSVC)
  include(CheckCXXCompilerFlag)
  check_cxx_compiler_flag(-march=native TROLL_HAVE_MARCH_NATIVE)
  if(TROLL_HAVE_MARCH_NATIVE)
    # AVX-512 included where the CPU has it: GCC 12's intrinsic headers trip -Wuninitialized
    # (GCC bug 105593), which include/troll/detail/cpu/eigen.hpp confines to those headers.
    set(troll_arch_flags -march=native)
    # CUDA sources keep their host code on AVX2 with GCC 12, as before (nvcc's front end has not
    # been tried on GCC 12's AVX-512 headers here; the CPU benchmarks are C++ sources).
    set(troll_arch_flags_cuda -march=native)
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
      list(APPEND troll_arch_flags_cuda -mno-avx512f)
    endif()
    string(REPLACE ";" "," troll_arch_flags_cuda "${troll_arch_flags_cuda}")
    target_compile_options(troll_developer_options
                           INTERFACE $<$<COMPILE_LANGUAGE:CXX>:${troll_arch_flags}>
                                     $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=${troll_arch_flags_cuda}>)
  endif()
endif()

if(NOT TROLL_SANITIZE STREQUAL "")
  set(troll_sanitize_flags -fsanitize=${TROLL_SANITIZE} -fno-omit-frame-pointer
                           -fno-sanitize-recover=all)
  target_compile_options(troll_developer_options
                         INTERFACE $<$<COMPILE_LANGUAGE:CXX>:${troll_sanitize_flags}>)
  target_link_options(troll_developer_options INTERFACE
                      $<$<LINK_LANGUAGE:CXX>:${troll_sanitize_flags}>)
endif()

# troll_add_program(<target> <source>): an executable from one .cpp or .cu source, linked to
# troll and the developer options. CUDA sources compile as C++17 CUDA with relocatable code off.
function(troll_add_program target source)
  add_executable(${target} ${source})
  target_link_libraries(${target} PRIVATE troll::troll troll_developer_options)
  if(source MATCHES "\\.cu$")
    target_compile_features(${target} PRIVATE cuda_std_17)
    set_target_properties(${target} PROPERTIES CUDA_EXTENSIONS OFF)
  else()
    set_target_properties(${target} PROPERTIES CXX_EXTENSIONS OFF)
  endif()
endfunction()

# troll_link_doctest(<target> <source>): doctest's implementation, compiled once in tests/ —
# with doctest's main for C++ tests (troll_doctest_main), without it for CUDA tests, whose main
# calls troll_test::run_cuda_tests (troll_doctest_runner).
function(troll_link_doctest target source)
  if(source MATCHES "\\.cu$")
    target_link_libraries(${target} PRIVATE troll_doctest_runner)
  else()
    target_link_libraries(${target} PRIVATE troll_doctest_main)
  endif()
endfunction()

# troll_add_test(<source>): tests/test_x.cpp (or tests/cuda/test_x.cu) becomes executable and
# ctest test `test_x`.
# A test that exits with 77 is reported as skipped (CUDA tests on a machine with no GPU).
function(troll_add_test source)
  get_filename_component(name ${source} NAME_WE)
  troll_add_program(${name} ${source})
  troll_link_doctest(${name} ${source})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests/support)
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES SKIP_RETURN_CODE 77)
  set_property(GLOBAL APPEND PROPERTY troll_test_targets "${name} ${name}")
  if(source MATCHES "\\.cu$")
    set_tests_properties(${name} PROPERTIES LABELS cuda)
    set_property(GLOBAL APPEND PROPERTY troll_cuda_test_manifest "${name} ${name}")
  endif()
endfunction()

# troll_add_test_group(<target> <source>...): test files that instantiate the same heavy templates
# (Eigen's decompositions, the CUDA kernels and their CPU references) compiled as ONE translation
# unit into one executable, so the shared code is compiled once. The generated source
# (<build>/<target>.cpp or .cu) defines TROLL_TEST_GROUP and includes each file by its absolute
# path, so __FILE__ keeps the original paths. The sources are all C++ or all CUDA. CUDA files
# hide their main behind #ifndef TROLL_TEST_GROUP and the generated source calls
# troll_test::run_cuda_tests once (C++ tests get doctest's main from troll_doctest_main). The
# files must coexist in one translation unit (no clashing names at namespace scope).
# Each source stays its own ctest test, `test_x`, which runs only the test cases written in that
# file and in the tests/bodies/ headers it includes (doctest's --source-file filter); it fails if
# it ran no test case. `<target>.coverage` fails if some test case of the executable is in none of
# those filters (it would never run). CUDA tests are also listed in the manifest
# <build>/tests/cuda_tests.txt (troll_write_cuda_test_manifest) for the GPU scripts.
function(troll_add_test_group target first)
  set(sources ${first} ${ARGN})
  get_filename_component(extension ${first} LAST_EXT)
  set(content "// Generated by troll_add_test_group (cmake/troll-helpers.cmake): the test files of\n")
  string(APPEND content "// ${target}, compiled as one translation unit.\n#define TROLL_TEST_GROUP 1\n")
  foreach(source IN LISTS sources)
    get_filename_component(source_extension ${source} LAST_EXT)
    if(NOT source_extension STREQUAL extension)
      message(FATAL_ERROR "troll_add_test_group(${target}): ${source} is not a ${extension} file")
    endif()
    string(APPEND content "#include \"${source}\"\n")
  endforeach()
  if(extension STREQUAL ".cu")
    string(APPEND content "\nint main(int argc, char** argv) { return troll_test::run_cuda_tests(argc, argv, \"${target}\"); }\n")
  endif()
  set(unity ${CMAKE_CURRENT_BINARY_DIR}/${target}${extension})
  file(CONFIGURE OUTPUT ${unity} CONTENT "${content}" @ONLY)
  troll_add_program(${target} ${unity})
  troll_link_doctest(${target} ${unity})
  target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/tests/support)
  set(all_filters "")
  foreach(source IN LISTS sources)
    get_filename_component(name ${source} NAME_WE)
    get_filename_component(file ${source} NAME)
    set(filters "*/${file}")
    file(STRINGS ${source} body_includes REGEX "^#include \"(\\.\\./)?bodies/[A-Za-z0-9_]+\\.hpp\"")
    foreach(line IN LISTS body_includes)
      string(REGEX MATCH "bodies/[A-Za-z0-9_]+\\.hpp" body "${line}")
      string(APPEND filters ",*/${body}")
    endforeach()
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${source})
    add_test(NAME ${name} COMMAND ${target} --source-file=${filters})
    set_property(GLOBAL APPEND PROPERTY troll_test_targets "${name} ${target}")
    # A file none of whose test cases ran (a filter that matches nothing) fails.
    set_tests_properties(${name} PROPERTIES SKIP_RETURN_CODE 77
                                            FAIL_REGULAR_EXPRESSION "test cases: +0 [|]")
    if(extension STREQUAL ".cu")
      set_tests_properties(${name} PROPERTIES LABELS cuda)
      set_property(GLOBAL APPEND PROPERTY troll_cuda_test_manifest
                   "${name} ${target} --source-file=${filters}")
    endif()
    list(APPEND all_filters ${filters})
  endforeach()
  string(REPLACE ";" "," all_filters "${all_filters}")
  add_test(NAME ${target}.coverage
           COMMAND ${target} --count --source-file-exclude=${all_filters})
  set_tests_properties(${target}.coverage PROPERTIES
                       PASS_REGULAR_EXPRESSION "passing the current filters: 0[^0-9]")
endfunction()

# troll_write_lines(<property> <file>): the entries of a global list property, one a line.
function(troll_write_lines property file)
  get_property(lines GLOBAL PROPERTY ${property})
  string(REPLACE ";" "\n" lines "${lines}")
  file(CONFIGURE OUTPUT ${file} CONTENT "${lines}\n" @ONLY)
endfunction()

# troll_write_cuda_test_manifest(<file>): one line per CUDA ctest test, "<test> <binary> <args>",
# binaries relative to the tests build folder: scripts/gpu-verify.sh runs the CUDA tests from it
# (also under compute-sanitizer) without ctest.
function(troll_write_cuda_test_manifest file)
  troll_write_lines(troll_cuda_test_manifest ${file})
endfunction()

# troll_write_test_targets(<file>): one line per test file's ctest test, "<test> <target>" (the
# executable that holds it: its own, or its group's), for scripts that build a few tests.
function(troll_write_test_targets file)
  troll_write_lines(troll_test_targets ${file})
endfunction()

# troll_add_bench(<source>): bench/bench_x.cpp (or bench/cuda/bench_x.cu) becomes `bench_x`.
function(troll_add_bench source)
  get_filename_component(name ${source} NAME_WE)
  troll_add_program(${name} ${source})
  target_link_libraries(${name} PRIVATE benchmark::benchmark)
endfunction()

# troll_add_example(<source>): examples/x.cpp becomes executable `x`. CPU examples also run as
# ctest test `example.x` (from the build's examples folder, no arguments) so they cannot rot.
function(troll_add_example source)
  get_filename_component(name ${source} NAME_WE)
  troll_add_program(${name} ${source})
  if(TROLL_BUILD_TESTS AND NOT source MATCHES "\\.cu$")
    add_test(NAME example.${name} COMMAND ${name} WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
    set_tests_properties(example.${name} PROPERTIES LABELS example TIMEOUT 300)
  endif()
endfunction()
