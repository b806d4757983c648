"""What makes a CPU forward fast and exact, without touching a modeling file.

- `quantize`: int8 and int4 linear layers (`w4a8`: the native int4 × int8 kernel; `smoothing`:
  SmoothQuant calibration; `fusion`: projections that read one input run as one matmul);
- `attention`: row-invariant attention, the `--exact` path;
- `native`: builds and loads the C++ kernels in `csrc/`;
- `compiled`: `torch.compile` of the decoding steps;
- `threads`: how many torch threads the free cores allow.
"""
