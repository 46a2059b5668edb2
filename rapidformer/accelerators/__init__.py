"""Accelerators, one module per concern: precision, graph (and, as they land, memory, parallel)."""
