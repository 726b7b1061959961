"""GPU kernels written in Triton; they run under ``TRITON_INTERPRET=1`` on a CPU, where the tests check them
against their torch references. ``gpu_paths.FastPaths`` decides which of them a model takes."""
