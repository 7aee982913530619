"""Secure aggregation in a round bundle (``attestation.rounds.manifest``; docs/verifier-spec.md §14, "Rounds").

 R4' ``round.file_hashes``  (secure) the global adapter file, ``adapter/adapter_model.safetensors.age``, is age
                            ciphertext with one X25519 stanza per listed recipient; ``global_adapter_sha256`` is its
                            plaintext's hash (checked by a recipient)
 R10 ``round.confidential`` (secure) every admitted client bundle holds its adapter as ciphertext whose recipients
                            include ``aggregator_recipient``; the global adapter's recipients are exactly the admitted
                            clients' CVM keys and the aggregator's
 R9  ``round.aggregate``    recomputed only when the identities given decrypt every client update and the global
                            adapter; otherwise skipped: it rests on the aggregator's attested code

Also :func:`verify_key_head`: a client's check of ``aggregator-key.json`` before it encrypts its update.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from attestation.bundle import manifest as B
from attestation.outputs import confidential as C
from attestation.rounds import manifest as R
from attestation.bundle.verify import _bundle_collateral, _compose_and_app_id, _events, _quote_bytes, _read
from attestation.io.hashing import sha256_hex
from attestation.policy import Policy
from attestation.io.safe_yaml import parse_json
from attestation.verify import QuoteFindings, Verdict, verify_quote


def global_problems(root: Path, m: R.RoundManifest) -> list[str]:
    """R4' for a secure round (empty: fine)."""
    conf = m.confidentiality
    assert conf is not None
    problems = []
    if m.global_adapter_sha256 != conf.plaintext_sha256:
        problems.append("global_adapter_sha256 is not the global adapter's plaintext hash")
    try:
        n = C.x25519_stanzas(_read(root / R.GLOBAL_ADAPTER_AGE, 1 << 16))
    except OSError:  # missing, or a directory in its place (round.files names it too)
        problems.append(f"{R.GLOBAL_ADAPTER_AGE} missing or unreadable")
    else:
        if n != len(conf.recipients):
            problems.append(f"the global adapter is not age ciphertext with one stanza per listed recipient ({n})")
    if m.aggregator_recipient is None or m.aggregator_recipient not in conf.recipients:
        problems.append("the aggregator's recipient is not among the global adapter's recipients")
    return problems


def check(f: QuoteFindings, m: R.RoundManifest, clients: dict[str, B.Manifest]) -> None:
    """R10 (nothing to add for a round without secure aggregation)."""
    if m.confidentiality is None:
        return
    problems, cvm_keys = [], set()
    for a in m.admitted:
        cm = clients.get(a.client)
        if cm is None:
            continue  # its client.* check already failed
        conf = cm.confidentiality
        if conf is None or m.aggregator_recipient not in conf.recipients:
            problems.append(f"{a.client}'s update is not encrypted to the aggregator's key")
        else:
            cvm_keys.add(conf.cvm_recipient)
    want = tuple(sorted(cvm_keys | {m.aggregator_recipient or ""}))
    if not problems and want != m.confidentiality.recipients:
        problems.append("the global adapter's recipients are not the admitted clients' CVM keys and the aggregator's")
    f.add("round.confidential", "fail" if problems else "pass", "; ".join(problems[:3]) or
          f"{len(m.admitted)} client update(s) encrypted to the aggregator; the global adapter to "
          f"{len(m.confidentiality.recipients)} CVM key(s): no plaintext update in the bundle")


def load_plain(root: Path, m: R.RoundManifest, identities: list[Any] | None) -> tuple[list[dict], dict] | str:
    """The client adapters (in ``m.admitted`` order) and the global adapter as tensors, decrypted in memory where
    the round is secure; a string saying why not when they cannot all be read."""
    from safetensors.numpy import load

    def plain(path: Path, digest: str | None) -> bytes:
        data = path.read_bytes()
        if digest is None:
            return data
        out = C.decrypt(data, identities or [])
        if out is None or sha256_hex(out) != digest:
            raise LookupError(path.relative_to(root).as_posix())
        return out

    try:
        clients = []
        for a in m.admitted:
            d = root / R.CLIENTS_DIR / a.client
            cm = B.Manifest.model_validate_json(_read(d / B.MANIFEST))
            digest = cm.confidentiality.plaintext_sha256.get(B.WEIGHTS) if cm.confidentiality is not None else None
            clients.append(load(plain(d / B.weights_file(cm), digest)))
        secure = m.confidentiality is not None
        result = load(plain(root / R.global_adapter(secure), m.confidentiality.plaintext_sha256 if secure else None))
    except LookupError as exc:
        return (f"{exc.args[0]} does not decrypt with the identities given: the aggregate is not recomputed; it rests "
                "on the aggregator's attested code (its quote binds this round manifest)")
    return clients, result


def verify_key_head(key_dir: Path, *, policy: Policy, now: int) -> tuple[Verdict, R.AggregatorKey | None]:
    """The aggregator's attested key: ``aggregator-key.json`` parses, its quote binds it (report_data), and the
    aggregator's compose-hash and app id agree with its event log."""
    f = QuoteFindings()
    root = Path(key_dir)
    raw = _read(root / R.KEY_DOC)
    key = None
    try:
        key = R.AggregatorKey.model_validate(parse_json(raw, R.KEY_DOC, ValueError))
        f.add("aggregator_key.schema", "pass", f"{R.KEY_SCHEMA}: {key.recipient}")
    except (ValueError, ValidationError, RecursionError) as exc:
        f.add("aggregator_key.schema", "fail", f"{R.KEY_DOC} is not a valid {R.KEY_SCHEMA}: {str(exc).splitlines()[0]}")
    quote = _quote_bytes(f, root)
    if quote is not None:
        verify_quote(quote, policy=policy, now=now, collateral=_bundle_collateral(f, root), events=_events(f, root),
                     expected_report_data=R.key_report_data(raw), findings=f)
    if key is not None:
        _compose_and_app_id(f, root, key)  # type: ignore[arg-type]  # reads only .tee
    return Verdict.of(f, policy, now), key
