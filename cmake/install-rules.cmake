# install-rules.cmake — installs the headers and a relocatable CMake package so that
# `find_package(troll CONFIG REQUIRED)` + `target_link_libraries(app PRIVATE troll::troll)` works.
# The package is architecture independent (header-only): it lives under share/troll.

include(CMakePackageConfigHelpers)

set(TROLL_INSTALL_CMAKEDIR
    "${CMAKE_INSTALL_DATADIR}/troll"
    CACHE STRING "Where troll's CMake package files are installed (relative to the prefix)")
mark_as_advanced(TROLL_INSTALL_CMAKEDIR)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        COMPONENT troll_Development)

install(TARGETS troll EXPORT trollTargets)
install(EXPORT trollTargets NAMESPACE troll:: DESTINATION ${TROLL_INSTALL_CMAKEDIR}
        COMPONENT troll_Development)

configure_package_config_file(
  ${PROJECT_SOURCE_DIR}/cmake/trollConfig.cmake.in ${PROJECT_BINARY_DIR}/trollConfig.cmake
  INSTALL_DESTINATION ${TROLL_INSTALL_CMAKEDIR})
write_basic_package_version_file(
  ${PROJECT_BINARY_DIR}/trollConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMajorVersion ARCH_INDEPENDENT)
install(FILES ${PROJECT_BINARY_DIR}/trollConfig.cmake ${PROJECT_BINARY_DIR}/trollConfigVersion.cmake
        DESTINATION ${TROLL_INSTALL_CMAKEDIR} COMPONENT troll_Development)
