"""Fixtures for tests, benchmarks and your own experiments: random-init and planted-structure models saved as
local Hugging Face folders."""
