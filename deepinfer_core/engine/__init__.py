"""Engine policy: step cost model (scheduler, block manager and runner come with the engine)."""
