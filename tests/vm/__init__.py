"""Tests of dynvm.vm: the ISA, programs and files, the frontend, the interpreter."""
