"""Tests of OpenTelemetry tracing (dynvm.telemetry)."""
