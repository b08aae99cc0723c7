"""Whose fault a model call's error is, for every transport (HTTP answers 400 or 500,
gRPC INVALID_ARGUMENT or INTERNAL): Note [Client or server fault] in
dynvm.cluster.serving._replica."""

from __future__ import annotations

from dynvm.vm.errors import ExecutionError, InputError, ShapeError


def is_client_fault(error: BaseException) -> bool:
    """Whether a model call's error is the request's fault (Note [Client or server
    fault])."""
    if isinstance(error, ShapeError | InputError):
        return True
    return isinstance(error, ExecutionError) and isinstance(error.__cause__, IndexError)
