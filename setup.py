"""The compiled parts of dynvm: the CPU backend's small-M GEMM (Note [A small-M GEMM of
our own] in jit/backends/cpu/native_linear.py), its chain of oneDNN primitives in one
call (Note [A chain of primitives in one call] in jit/backends/cpu/onednn_chain.py) and
a GEMM's column halves with a helper thread (Note [Column halves with a helper thread]
in jit/backends/cpu/column_halves.py), a batch-1 chain in row halves with a helper
thread (Note [A chain in halves, one wake a call] in jit/backends/cpu/chain_halves.py),
a layer norm writing a bf16 copy too (Note [Layer
norm writing bf16 too] in jit/backends/cpu/norm_bf16.py) and a GEMM over weights packed
in column panels (Note [A panel GEMM of our own] in jit/backends/cpu/panel_linear.py).
Everything else is in pyproject.toml.

The kernels are plain C functions called through ctypes (the module itself is empty, so
that every module of the package imports); it is optional: where no
C compiler is found the install goes on and the backend keeps oneDNN for those GEMMs.
-fopenmp links the libgomp soname that torch ships, so the kernels run on torch's own
OpenMP team (one team per process, not two)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "dynvm.jit.backends.cpu._small_m_linear",
    sources=["jit/backends/cpu/native/small_m_linear.c",
             "jit/backends/cpu/native/decode_ops.c"],
    extra_compile_args=["-O3", "-fopenmp"],
    extra_link_args=["-fopenmp"],
    optional=True,
), Extension(
    # oneDNN's functions arrive as pointers at run time: nothing of libdnnl is linked,
    # so it builds and loads without the `onednn` extra
    "dynvm.jit.backends.cpu._onednn_chain",
    sources=["jit/backends/cpu/native/onednn_chain.c",
             # a chain's own 1x1 convolution (Note [A 1x1 convolution of our own at a
             # few rows] in jit/backends/cpu/own_1x1.py), on torch's OpenMP team
             "jit/backends/cpu/native/own_1x1.c",
             # Winograd F(2x2, 3x3) for its 3x3s (Note [Winograd F(2x2, 3x3) for the
             # 3x3s] in jit/backends/cpu/winograd.py)
             "jit/backends/cpu/native/winograd.c"],
    extra_compile_args=["-O3", "-fopenmp"],
    extra_link_args=["-fopenmp"],
    optional=True,
), Extension(
    # a GEMM's column halves, the second run by a helper thread of dynvm's own (Note
    # [Column halves with a helper thread] in jit/backends/cpu/column_halves.py);
    # oneDNN's and OpenMP's functions arrive as pointers: nothing is linked
    "dynvm.jit.backends.cpu._column_halves",
    sources=["jit/backends/cpu/native/column_halves.c"],
    extra_compile_args=["-O3"],
    optional=True,
), Extension(
    # a batch-1 chain of primitives as row halves, the second run by a helper thread of
    # dynvm's own (Note [A chain in halves, one wake a call] in
    # jit/backends/cpu/chain_halves.py); oneDNN's and OpenMP's functions arrive as
    # pointers: nothing is linked
    "dynvm.jit.backends.cpu._chain_halves",
    sources=["jit/backends/cpu/native/chain_halves.c"],
    extra_compile_args=["-O3"],
    optional=True,
), Extension(
    # layer norm writing its bf16 copy in the same pass (Note [Layer norm writing bf16
    # too] in jit/backends/cpu/norm_bf16.py); without it the bf16 lowering keeps torch's
    # layer norm and a cast
    "dynvm.jit.backends.cpu._layer_norm_bf16",
    sources=["jit/backends/cpu/native/layer_norm_bf16.c"],
    extra_compile_args=["-O3", "-fopenmp"],
    extra_link_args=["-fopenmp"],
    optional=True,
), Extension(
    # masked attention over short sequences (Note [Masked attention of our own] in
    # jit/backends/cpu/attention_native.py); without it SDPA stays torch's
    "dynvm.jit.backends.cpu._attention",
    sources=["jit/backends/cpu/native/attention.c"],
    extra_compile_args=["-O3", "-fopenmp"],
    extra_link_args=["-fopenmp"],
    optional=True,
), Extension(
    # an fp32 GEMM of 8-64 rows over panels packed once (Note [A panel GEMM of our own]
    # in jit/backends/cpu/panel_linear.py), on torch's OpenMP team
    "dynvm.jit.backends.cpu._panel_linear",
    sources=["jit/backends/cpu/native/panel_linear.c"],
    extra_compile_args=["-O3", "-fopenmp"],
    extra_link_args=["-fopenmp"],
    optional=True,
)])
