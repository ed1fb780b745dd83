"""Schedule rules that turn legalized TIR into fast kernels (CPU here; GPU uses s_tir.dlight)."""

from .cpu import ApplyCPUSchedules, schedule_func

__all__ = ["ApplyCPUSchedules", "schedule_func"]
