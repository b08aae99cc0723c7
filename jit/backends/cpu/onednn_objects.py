"""oneDNN objects the primitive passes (onednn_conv, onednn_pool, onednn_matmul) make the
same way: memory descriptors of a torch dtype, a reorder run once at build time, and
freeing what a failed or finished build leaves.

Each primitive kind keeps its own descriptor, post-ops and calls; what is here has no
kind of its own.
"""

from __future__ import annotations

import ctypes

import torch

from dynvm.jit.backends.cpu import onednn_api as api

DATA_TYPES = {torch.float32: api.F32, torch.bfloat16: api.BF16}
"""oneDNN's data type of each torch dtype the passes build primitives for."""


def md_tag(lib, dims, tag: int, dtype: torch.dtype) -> ctypes.c_void_p:
    """A memory descriptor of `dims` in the layout `tag` (owned by the caller)."""
    md = ctypes.c_void_p()
    api.check(lib.dnnl_memory_desc_create_with_tag(ctypes.byref(md), len(dims),
                                                   api.Dims(*dims), DATA_TYPES[dtype], tag),
              "memory descriptor")
    return md


def md_strides(lib, dims, strides, dtype: torch.dtype) -> ctypes.c_void_p:
    """A memory descriptor of `dims` with element `strides` (owned by the caller)."""
    md = ctypes.c_void_p()
    api.check(lib.dnnl_memory_desc_create_with_strides(
        ctypes.byref(md), len(dims), api.Dims(*dims), DATA_TYPES[dtype],
        api.Dims(*strides)), "memory descriptor")
    return md


def destroy(lib, handles) -> None:
    """Free each (destroy function name, handle) whose handle was made; `lib` None (a
    library that never loaded, or an object whose build failed first) frees nothing."""
    for function, handle in handles:
        if lib is not None and handle:
            getattr(lib, function)(handle)


def reorder_once(library: api.Library, source_md, source, target_md, target,
                 what: str) -> None:
    """Run one reorder from memory `source` (a memory object) into `target` (one too),
    described by `source_md` / `target_md`, and free the primitive: weights are
    reordered this way once, when a primitive is built, never in a call."""
    lib = library.dll
    descriptor, reorder = ctypes.c_void_p(), ctypes.c_void_p()
    try:
        api.check(lib.dnnl_reorder_primitive_desc_create(
            ctypes.byref(descriptor), source_md, library.engine, target_md, library.engine,
            None), f"{what} descriptor")
        api.check(lib.dnnl_primitive_create(ctypes.byref(reorder), descriptor), what)
        args = (api.ExecArg * 2)(api.ExecArg(api.ARG_SRC, source),
                                 api.ExecArg(api.ARG_DST, target))
        api.check(lib.dnnl_primitive_execute(reorder, library.stream, 2,
                                             ctypes.cast(args, ctypes.c_void_p)), what)
    finally:
        destroy(lib, (("dnnl_primitive_destroy", reorder),
                      ("dnnl_primitive_desc_destroy", descriptor)))


def memory(library: api.Library, md, pointer: int | None) -> ctypes.c_void_p:
    """A memory object of `md` over `pointer` (None: oneDNN's own buffer is not wanted,
    the handle is set per call), owned by the caller."""
    made = ctypes.c_void_p()
    api.check(library.dll.dnnl_memory_create(
        ctypes.byref(made), md, library.engine,
        ctypes.c_void_p(pointer) if pointer is not None else None), "memory")
    return made


def destroy_build(lib, descriptor, attr, post_ops, mds) -> None:
    """Free what building a primitive made besides the primitive: its descriptor, its
    attribute and post-ops, and the memory descriptors it was described with."""
    destroy(lib, (("dnnl_primitive_desc_destroy", descriptor),
                  ("dnnl_primitive_attr_destroy", attr),
                  ("dnnl_post_ops_destroy", post_ops),
                  *(("dnnl_memory_desc_destroy", md) for md in mds)))
