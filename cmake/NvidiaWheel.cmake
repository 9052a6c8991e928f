# reshard_nvidia_wheel(<package> <out_var>): the root folder of the nvidia.<package> wheel in the
# Python on PATH (e.g. nccl, nvshmem), or empty where that Python lacks it. The Find modules add it
# to their search hints.
function(reshard_nvidia_wheel package out_var)
  set(root "")
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    execute_process(
      COMMAND ${Python3_EXECUTABLE} -c
              "import nvidia.${package} as m; print(list(m.__path__)[0])"
      OUTPUT_VARIABLE root OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
  set(${out_var} "${root}" PARENT_SCOPE)
endfunction()
