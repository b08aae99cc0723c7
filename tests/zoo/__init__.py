"""Tests of real architectures from model libraries, against eager."""
