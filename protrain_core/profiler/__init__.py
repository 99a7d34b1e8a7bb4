"""The memory-aware profiler: real iterations of the user's model on a profiling engine, and
hardware probes; its output is a ``planner.profiles.Profile``."""
