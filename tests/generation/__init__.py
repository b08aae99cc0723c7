"""Tests of the generation loop (dynvm.compile_generator)."""
