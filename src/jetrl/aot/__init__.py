"""Compile-only programs for accelerators this machine lacks (docs/compile_report.md)."""
