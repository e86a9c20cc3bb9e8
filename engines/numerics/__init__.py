"""Numerics without model sessions: schedulers and their plans, the step and flow graphs, flow schedules, rows
joined on the device, the step cache, tokenizers."""
