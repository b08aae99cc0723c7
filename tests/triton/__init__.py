"""Tests of the Triton backend (interpreted on the CPU; sm_90 builds without a GPU)."""
