"""Checkpoint -> TVM library. Import the submodules you need; this package imports nothing."""
