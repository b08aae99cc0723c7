"""Tests of the demo models (dynvm.models)."""
