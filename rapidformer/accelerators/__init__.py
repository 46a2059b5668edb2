"""One strategy per backend (ddp, zero, fsdp, megatron, ort; `table` picks one) and the seams
they share: precision, graph, recompute. docs/architecture.md has the table and the protocol."""
