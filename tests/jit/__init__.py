"""Tests of dynvm.jit: profiling, promotion, specialization, the CPU backend."""
