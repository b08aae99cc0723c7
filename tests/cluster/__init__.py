"""Tests of dynvm.cluster: kernel stores, signing, the fleet, serving, precompile."""
