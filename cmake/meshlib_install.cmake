message(STATUS "install rules: TODO")
