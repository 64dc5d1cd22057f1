"""Layer 2: runner's C++ CPU kernels (csrc/), built once per machine, and the torch ops that wrap them."""
