"""What a run will be, derived once from its resolved config: the run plan (device, world and
data-parallel size, gradient accumulation) and the memory plan (memory=auto)."""
