# Source this to run a benchmark on an AVX-512 CPU with every library held to AVX2, as on the 2-core AVX2
# machines most figures here come from: `. benchmarks/avx2_env.sh && python benchmarks/train_speed.py ...`.
# The same instructions on other cores: compare ratios, not tokens/s, with the AVX2 machine's figures.
export ATEN_CPU_CAPABILITY=avx2          # torch's own vectorized kernels (SDPA on the CPU, elementwise)
export ONEDNN_MAX_CPU_ISA=AVX2 DNNL_MAX_CPU_ISA=AVX2   # oneDNN (mkldnn matmuls and convolutions)
export MKL_ENABLE_INSTRUCTIONS=AVX2      # MKL's sgemm
export FBGEMM_ENABLE_INSTRUCTIONS=AVX2   # fbgemm (quantized linear layers)
export FASTFORWARD_NATIVE_ISA=avx2       # fastforward's own kernels (fastforward/cpu/native.py)
# Not held: what the CPU reports of itself. fastforward's choice of bf16 autocast (`default_autocast`) still sees
# AVX-512 BF16 and picks it: give float32 explicitly (`train --no-bf16`, train_speed's float32 contenders).
