"""The CPU backend: a specialized region as generated Python source over torch kernels,
and the passes over the specialized IR that run before emission, each kept where it
measures faster on the device (Note [CPU fusion], Note [Channels-last chains]).

- `codegen`: emits and loads a kernel (`compile_kernel`, `CpuOptions`, `CpuKernel`).
- `fusion`: GEMMs with their epilogues as one oneDNN call; `conv`: convolutions with
  batch norm and epilogue folded; `channels_last`: chains of convolutions kept NHWC;
  `precision`: bf16 / int8 GEMMs; `prepack`: weights in oneDNN's layout, shared.
- `row_gate`, `calibration_rows`: where oneDNN pays per row count, and at how many rows
  a calibration question is asked.
- `arena_layout`, `arena_choice`: `out=` kernels writing into one planned arena, and
  which operations do so on this device.

Nothing is re-exported here: callers import the module they need, so loading one pass
(a test of `prepack`, say) does not load the emitter.
"""
