"""What a process of a run needs around the training itself: its process group, launch,
preemption, rank progress, a fast exit."""
