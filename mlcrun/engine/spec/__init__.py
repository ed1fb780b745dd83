"""Speculative decoding: drafters propose token trees, the target verifies every running
request's tree in one forward, and accept.py keeps exactly the target's distribution."""
