"""The export bundle: manifest schema and report_data binding, the audit chain, the OpenSSF model signatures, the
confidential-output and input checks, lineage, and :func:`attestation.bundle.verify.verify_bundle`, the bundle
verifier."""
