"""Tests of dynvm.arena: liveness, offset planning, arena pools."""
