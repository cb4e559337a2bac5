"""Validation rules: pure functions from a typed `Config` to `Finding` values."""

from pdtool.rules.finding import Finding, error, has_errors, warning

__all__ = ["Finding", "error", "has_errors", "warning"]
