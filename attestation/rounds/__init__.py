"""Federated round bundles: the round manifest, secure aggregation, and the round verifier."""
