"""Our own device kernels, each next to its torch reference.

A kernel here is an optional fast path: the module that uses it falls back to the
torch implementation when the kernel cannot be built or is switched off
(``SIDECAR_CPU_KERNELS=0``), and tests compare the two.
"""
