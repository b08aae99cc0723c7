"""Code generators of the JIT: `cpu` (Python source over torch kernels) and, for GPUs,
`triton`. A backend turns a `SpecializedRegion` into a callable `kernel(regs)`."""
