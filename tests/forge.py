"""TEST-PKI variants of a REAL dstack quote, for verifier cases no real quote can show.

A real dstack quote (the simulator's ``base_quote.bin``, see ``app/simulator/fixtures/NOTICE.md``) is
patched and re-signed under a throwaway test PKI, with matching collateral built from the real
Intel TCB info and QE identity (``shared/reference/attestation.md`` §8): a debug TD, a TD that
allows #VE, a TCB level that is Revoked or freshly OutOfDate. Such quotes verify only under
:func:`policy` (which trusts that test root), never under Intel's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from attestation import Policy, parse_collateral
from attestation.tdx.dcap import Collateral
from attestation.policy import simulator_policy

from app.simulator import pki

FIXTURES = Path(pki.__file__).parent / "fixtures"
SECRET = b"cvm-tune tests: forged TEST quotes, never trust"
TD_ATTRIBUTES = 168  # offset of TDATTRIBUTES in a v4 quote


@lru_cache(maxsize=1)
def _pki() -> tuple[pki.BaseQuote, pki.DcapTestPki]:
    base = pki.BaseQuote.parse((FIXTURES / "base_quote.bin").read_bytes())
    return base, pki.DcapTestPki.build(SECRET, base.sgx_extension)


def quote(patches: dict[int, bytes] | None = None) -> bytes:
    """The base quote with ``{offset: bytes}`` written into its header/body, re-signed."""
    base, test_pki = _pki()
    body = bytearray(base.header_body)
    for offset, value in (patches or {}).items():
        body[offset : offset + len(value)] = value
    return test_pki.sign_quote(bytes(body), base.qe_report, base.qe_auth)


def collateral(edit_tcb_info: Callable[[dict[str, Any]], None] | None = None) -> Collateral:
    """Collateral for :func:`quote` (valid 2020..2099), optionally with an edited TCB info."""
    _, test_pki = _pki()
    tcb = json.loads((FIXTURES / "tcb_info.json").read_text())
    if edit_tcb_info is not None:
        edit_tcb_info(tcb)
    text = test_pki.collateral(json.dumps(tcb, separators=(",", ":")), (FIXTURES / "qe_identity.json").read_text())
    return parse_collateral(text)


def policy(**changes: Any) -> Policy:
    """A policy trusting only the forge's TEST root, with ``changes`` applied."""
    return simulator_policy(_pki()[1].root_der).model_copy(update={"name": "forged-test", **changes})


def td_attributes(value: int) -> dict[int, bytes]:
    """A patch setting TDATTRIBUTES to ``value``."""
    return {TD_ATTRIBUTES: value.to_bytes(8, "little")}
