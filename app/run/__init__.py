"""One attested run, read top to bottom in ``pipeline.py``, and its stages: inputs, identity, lineage, privacy."""
