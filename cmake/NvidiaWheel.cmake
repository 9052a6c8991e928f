# reshard_nvidia_wheel(<package> <out_var>): the root folder of the nvidia.<package> wheel (e.g.
# nccl, nvshmem) of the Python on PATH, or empty where that Python lacks it. The Find modules add
# it to their search hints. Under pip's build isolation that Python imports only the build's own
# requirements, so the environment being installed into is searched too (its site-packages, which
# sysconfig still names there): `pip install .` then builds every transport the environment has the
# wheels for, as `pip install --no-build-isolation .` does.
function(reshard_nvidia_wheel package out_var)
  set(root "")
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    execute_process(
      COMMAND
        ${Python3_EXECUTABLE} -c
        "import os, sysconfig
try:
    import nvidia.${package} as m
    print(list(m.__path__)[0])
except ImportError:
    for key in ('purelib', 'platlib'):
        root = os.path.join(sysconfig.get_paths()[key], 'nvidia', '${package}')
        if os.path.isdir(os.path.join(root, 'lib')):
            print(root)
            break"
      OUTPUT_VARIABLE root OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
  set(${out_var} "${root}" PARENT_SCOPE)
endfunction()
