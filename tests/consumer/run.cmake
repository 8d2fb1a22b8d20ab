# run.cmake — drives one consumer test (cmake -DMODE=... -P run.cmake). Modes:
#   install           cmake --install the troll build tree into PREFIX (fixture for find_package)
#   find_package      configure the consumer with CMAKE_PREFIX_PATH=PREFIX, build it, run it
#   add_subdirectory  configure the consumer with TROLL_SOURCE_DIR, build it, run it
#   include_path      compile main.cpp with the C++ compiler and plain -I flags, run it
# Inputs: MODE WORK_DIR CONFIG CONSUMER_DIR TROLL_SOURCE_DIR TROLL_BINARY_DIR PREFIX GENERATOR
#         MAKE_PROGRAM CXX_COMPILER EIGEN_INCLUDE_DIRS ('|'-separated). Nothing here touches the network.
cmake_minimum_required(VERSION 3.21)

function(run)
  list(JOIN ARGN " " shown)
  message(STATUS "run: ${shown}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "failed (${result}): ${shown}")
  endif()
endfunction()

# Configure, build and run the consumer project with a build type and extra cache settings.
function(build_and_run_consumer build_type)
  set(build ${WORK_DIR}/build)
  set(generator_args -G ${GENERATOR})
  if(MAKE_PROGRAM)
    list(APPEND generator_args -DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM})
  endif()
  run(${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${build} ${generator_args}
      -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=${build_type} ${ARGN})
  run(${CMAKE_COMMAND} --build ${build} --config ${build_type})
  if(EXISTS ${build}/${build_type}/troll_consumer)
    set(program ${build}/${build_type}/troll_consumer)
  else()
    set(program ${build}/troll_consumer)
  endif()
  run(${program})
endfunction()

foreach(input MODE WORK_DIR CONSUMER_DIR TROLL_SOURCE_DIR PREFIX)
  if(NOT DEFINED ${input})
    message(FATAL_ERROR "run.cmake needs -D${input}=...")
  endif()
endforeach()

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

if(MODE STREQUAL "install")
  file(REMOVE_RECURSE ${PREFIX})
  set(config_args "")
  if(CONFIG)
    set(config_args --config ${CONFIG})
  endif()
  run(${CMAKE_COMMAND} --install ${TROLL_BINARY_DIR} --prefix ${PREFIX} ${config_args})
  file(GLOB_RECURSE config_files ${PREFIX}/*/trollConfig.cmake)
  if(NOT config_files)
    message(FATAL_ERROR "no trollConfig.cmake under ${PREFIX}")
  endif()
  if(NOT EXISTS ${PREFIX}/include/troll/projection.hpp)
    message(FATAL_ERROR "troll/projection.hpp was not installed under ${PREFIX}/include")
  endif()

elseif(MODE STREQUAL "find_package")
  # Only the prefix may supply troll: no package registry, no stray troll_DIR. This consumer
  # compiles every entry point (one large translation unit, the longest test of the release
  # ctest): the Debug build type, without the optimiser, took 73 s of compile against -O3's 104 s,
  # and what it checks (the installed headers are complete and usable) needs no optimiser.
  build_and_run_consumer(Debug -DCMAKE_PREFIX_PATH=${PREFIX} -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
                         -DCMAKE_CXX_FLAGS_DEBUG=-O0)
  file(STRINGS ${WORK_DIR}/build/CMakeCache.txt troll_dir REGEX "^troll_DIR:")
  string(REGEX REPLACE "^troll_DIR:[A-Z]+=" "" troll_dir "${troll_dir}")
  file(REAL_PATH "${PREFIX}" prefix_real)
  file(REAL_PATH "${troll_dir}" troll_dir_real)
  string(FIND "${troll_dir_real}" "${prefix_real}/" at)
  if(NOT at EQUAL 0)
    message(FATAL_ERROR "troll was found at '${troll_dir}', not under the install prefix ${PREFIX}")
  endif()

elseif(MODE STREQUAL "add_subdirectory")
  build_and_run_consumer(Release -DTROLL_SOURCE_DIR=${TROLL_SOURCE_DIR})

elseif(MODE STREQUAL "include_path")
  set(include_flags -I${TROLL_SOURCE_DIR}/include)
  string(REPLACE "|" ";" eigen_include_dirs "${EIGEN_INCLUDE_DIRS}")
  foreach(dir IN LISTS eigen_include_dirs)
    list(APPEND include_flags -I${dir})
  endforeach()
  set(program ${WORK_DIR}/troll_consumer)
  run(${CXX_COMPILER} -std=c++17 ${include_flags} ${CONSUMER_DIR}/main.cpp -o ${program} -pthread)
  run(${program})

else()
  message(FATAL_ERROR "unknown MODE '${MODE}'")
endif()
