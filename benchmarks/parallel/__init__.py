"""Schedules measured where ranks really run at the same time (issue 40): pp partitions of
one GPU's SMs, and pp processes pinned to disjoint groups of CPU cores."""
