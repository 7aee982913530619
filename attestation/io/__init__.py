"""Bounded parsing and the edges: YAML/JSON with size and nesting limits, the one HTTP client, hashing helpers."""
