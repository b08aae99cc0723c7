"""Tests of faults, hostile input, concurrency and soak."""
