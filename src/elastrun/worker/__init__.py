"""What runs inside a worker (no torch import here)."""

from elastrun.worker.record import record, write_error_file

__all__ = ["record", "write_error_file"]
