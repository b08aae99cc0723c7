"""Tests of the top package: the public API, the CLI, the environment, layering, errors."""
