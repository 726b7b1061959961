"""CPU kernels: C sources compiled at first use for the host's instruction set (``cpu_build``), each
with its ctypes wrapper beside it and a torch reference in the module that calls it."""
