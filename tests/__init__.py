"""Tests of the engine and the playground; ``tests.support`` holds what tests and tools share."""
