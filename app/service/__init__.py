"""The nightly service around runs: scheduler, status, the state database, the bundles server."""
