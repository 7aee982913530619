"""The TEE evidence: DCAP quotes, collateral and its PCCS fetch, Intel's root, the dstack event log, GPU evidence,
and reading what a relying party hands the verifier (quote, collateral, event log files)."""
