"""The memory planner: predictions per strategy (memory, zero3_trace), their display (display), and the check of every
finished run against its prediction (check)."""
