"""Options of the Triton backend (all of them enter the artifact's cache key)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dynvm.vm.errors import ConfigError


@dataclass(frozen=True)
class TritonOptions:
    """How regions are partitioned and kernels generated. See Note [Block sizes] in
    dynvm.jit.backends.triton.kernels for how the tile fields are used."""

    vendor_plain_matmul: bool = True
    """A matmul with nothing to fuse after it (at most its own bias) calls torch's
    matmul (cuBLAS on a GPU) instead of a generated kernel; the plan says so."""
    matmul_precision: str = "ieee"
    """`tl.dot` input precision for fp32: "ieee" computes what eager fp32 computes
    (torch's default, TF32 off); "tf32" is faster on tensor cores and less exact."""
    elementwise_block: int = 1024
    """Largest block of an elementwise kernel; smaller when the family's largest tensor
    is smaller."""
    matmul_tiles: tuple[int, int, int] = (64, 64, 32)
    """Largest (BLOCK_M, BLOCK_N, BLOCK_K) of a matmul kernel; each is cut to the next
    power of two of the family's largest dim, and never below 16 (tl.dot's minimum)."""
    matmul_num_warps: int = 4
    num_stages: int = 3
    fp_fusion: bool = True
    """Let the compiler contract a * b + c into FMAs (Triton's default; slightly
    different rounding from eager, within float tolerance)."""
    """Software pipelining depth of compiled kernels (the K loop of a matmul)."""
    max_row_block: int = 16384
    """Rows longer than this (after rounding up to a power of two) are not fused into a
    one-tile-per-row kernel; torch runs them."""

    def __post_init__(self) -> None:
        if self.matmul_precision not in ("ieee", "tf32", "tf32x3"):
            raise ConfigError(f"matmul_precision must be 'ieee', 'tf32' or 'tf32x3', got "
                             f"{self.matmul_precision!r}")
        for name, value in (("elementwise_block", self.elementwise_block),
                            ("max_row_block", self.max_row_block),
                            *zip(("BLOCK_M", "BLOCK_N", "BLOCK_K"), self.matmul_tiles)):
            if value < 16 or value & (value - 1):
                raise ConfigError(f"{name} must be a power of two >= 16, got {value}")

    def as_key(self) -> dict:
        key = asdict(self)
        key["matmul_tiles"] = list(self.matmul_tiles)
        return key


DEFAULT_OPTIONS = TritonOptions()
