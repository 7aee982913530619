"""The client's check of the aggregator: train on a global adapter only if the aggregator's attested round made it.

With ``federation.aggregator_compose_hashes`` set, a global adapter must come with the previous round's attestation
(round manifest, the aggregator's quote over it, event log, app-compose, collateral): the quote verifies under the
client's ``aggregator_policy``, the aggregator's compose-hash is allowed, and the manifest names the previous round
and exactly this adapter. A first round's initial adapter has no round behind it: it must be the one pinned in
``federation.initial_adapter_sha256``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from attestation.policy import Policy, load_policy, simulator_policy
from attestation.rounds.confidential import verify_key_head
from attestation.rounds.verify import verify_round_head

from app.config import Config
from app.errors import TeeError
from app.federated.transport import unpack_bundle


def check_global_adapter(cfg: Config, conf: Any, round_: int, global_sha: str | None, workdir: Path) -> None:
    """Raise unless the global adapter ``global_sha`` may be trained on (nothing to check without one, or when the
    client pins no aggregator compose-hash).

    Raises:
        TeeError: no attested round behind the adapter, or that round does not verify or names another adapter.
    """
    fed = cfg.federation
    if not fed.aggregator_compose_hashes or global_sha is None:
        return
    evidence = conf.get("previous-round")
    if not evidence:
        if round_ == 1 and fed.initial_adapter_sha256 == global_sha:
            return
        raise TeeError(f"round {round_}: the aggregator sent a global adapter without the attested round that made it",
                       fix="pin the initial adapter in federation.initial_adapter_sha256, or check the aggregator")
    if not isinstance(evidence, bytes):  # never bytes(n): an integer would allocate n bytes
        raise TeeError(f"round {round_}: the aggregator's previous-round evidence is not tar bytes",
                       fix="do not train on this global adapter; check the aggregator's deployment")
    verdict, m = verify_round_head(unpack_bundle(evidence, workdir), policy=_policy(cfg), now=int(time.time()))
    problems = [f"{c.name}: {c.detail}" for c in verdict.failed]
    if m is not None and not problems:
        if m.tee.compose_hash not in fed.aggregator_compose_hashes:
            problems.append(f"the aggregator's compose-hash {m.tee.compose_hash[:16]}… is not in "
                            "federation.aggregator_compose_hashes")
        if (m.round, m.global_adapter_sha256) != (round_ - 1, global_sha):
            problems.append(f"its round {m.round} manifest does not name the global adapter of round {round_}")
    if problems or m is None:
        raise TeeError(f"round {round_}: the aggregator's previous round does not verify: "
                       f"{'; '.join(problems[:2]) or 'no round manifest'}",
                       fix="do not train on this global adapter; check the aggregator's deployment")


def aggregator_recipient(cfg: Config, conf: Any, round_: int, workdir: Path) -> str | None:
    """Secure aggregation: the aggregator's age recipient, once its quote over ``aggregator-key.json`` verifies
    under the client's ``aggregator_policy`` (and its compose-hash is allowed, when the client pins them); None when
    the aggregator asks for no secure aggregation.

    Raises:
        TeeError: the key's attestation does not verify.
    """
    evidence = conf.get("aggregator-key")
    if not evidence:
        return None
    fix = "do not send an update to this aggregator; check its deployment"
    if not isinstance(evidence, bytes):
        raise TeeError(f"round {round_}: the aggregator's key evidence is not tar bytes", fix=fix)
    verdict, key = verify_key_head(unpack_bundle(evidence, workdir), policy=_policy(cfg), now=int(time.time()))
    problems = [f"{c.name}: {c.detail}" for c in verdict.failed]
    fed = cfg.federation
    if key is not None and fed.aggregator_compose_hashes and key.tee.compose_hash not in fed.aggregator_compose_hashes:
        problems.append(f"the aggregator's compose-hash {key.tee.compose_hash[:16]}… is not in "
                        "federation.aggregator_compose_hashes")
    if problems or key is None:
        raise TeeError(f"round {round_}: the aggregator's key is not attested: {'; '.join(problems[:2]) or 'no key'}",
                       fix=fix)
    return key.recipient


def _policy(cfg: Config) -> Policy:
    if cfg.federation.aggregator_policy is not None:
        return load_policy(cfg.federation.aggregator_policy)
    if cfg.tee.mode == "embedded-simulator":
        from app.simulator import GuestAgentSimulator

        return simulator_policy(GuestAgentSimulator().test_root_ca_der)
    return load_policy(None)
