"""Real attestation samples (copied from shared/testdata/attestation with their README, which names
origins and licences), so the suite runs on a clean clone with no ../shared."""

from __future__ import annotations

import json
from pathlib import Path

TESTDATA = Path(__file__).parent / "data" / "attestation"


def load_manifest() -> list[dict]:
    return json.loads((TESTDATA / "manifest.json").read_text())
