"""A data owner's CVM: a Flower ``ClientApp`` (Message API) that trains one round with the cvm-tune pipeline.

For each ``train`` message it takes the round number, the aggregator's nonce and the global adapter (an empty
``ArrayRecord`` in a round that starts from the base model), runs :func:`app.run.pipeline.run_once` with a warm start
from that adapter, and replies with the exported bundle's adapter weights (``arrays``), its trainable-token count
(``metrics``, a claim the aggregator replaces by its own reading of the verified manifest) and the whole bundle as
tar bytes with the client's name (``bundle``). The dataset never leaves the CVM: only the bundle does.

Its cvm-tune config: see :func:`node_config_path`.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
from contextlib import ExitStack
from collections.abc import Callable
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from attestation.bundle import manifest as B
from attestation.io.hashing import sha256_hex

from app.config import load_config
from app.errors import ConfigError, DataError
from app.federated.admission import WEIGHT_KEY
from app.federated.aggregator_check import aggregator_recipient, check_global_adapter
from app.federated.secure import GLOBAL_FIELD, decrypt_global
from app.run.inputs import scratch_dir
from app.federated.round_input import RoundInput
from app.federated.transport import arrays_to_safetensors, pack_bundle, safetensors_to_arrays

DEFAULT_CONFIG = "/etc/cvm-tune/config.yaml"
log = logging.getLogger("cvm-tune.federated")
ConfigFor = Callable[[Context], Path]


def node_config_path(context: Context) -> Path:
    """This node's cvm-tune config: the node config's ``cvm-tune-config`` (Deployment Engine: one SuperNode per
    data owner's CVM); in Flower's simulation engine, entry ``partition-id`` of the run config's space-separated
    ``client-configs``.

    Raises:
        ConfigError: a simulated node whose partition has no entry in ``client-configs``.
    """
    if "cvm-tune-config" in context.node_config:
        return Path(str(context.node_config["cvm-tune-config"]))
    listed = str(context.run_config.get("client-configs", "")).split()
    if "partition-id" in context.node_config and listed:
        i = int(context.node_config["partition-id"])
        if i >= len(listed):
            raise ConfigError(f"simulated node {i} has no entry in the run config's client-configs ({len(listed)})",
                              fix="list one cvm-tune config per simulated SuperNode in client-configs")
        return Path(listed[i])
    return Path(DEFAULT_CONFIG)


def train_round(msg: Message, config_path: Path) -> Message:
    """Train for the round ``msg`` announces and reply with the adapter and the attested bundle.

    Holds the output volume's run lock for the round (:func:`app.state.claim_volume`).

    Raises:
        CvmTuneError: the round message is malformed, the volume is in use by another cvm-tune process, or the run
            failed (Flower returns it to the aggregator as an error reply, which it records as the rejection reason).
    """
    from app.run.pipeline import RunHooks, run_once
    from app.state import claim_volume

    cfg = load_config(config_path)
    name = cfg.federation.client_name
    if name is None:
        raise ConfigError(f"config {config_path} sets no federation.client_name",
                          fix="set federation.client_name to this CVM's name in the aggregator's federation.clients")
    conf = msg.content.config_records.get("config") or ConfigRecord()
    round_, nonce = int(conf.get("server-round", 0)), str(conf.get("nonce", ""))
    if round_ < 1 or not re.fullmatch(r"[0-9a-f]{64}", nonce):
        raise DataError("the aggregator's train message has no valid round number and nonce")
    arrays = next(iter(msg.content.array_records.values()), ArrayRecord())
    out = cfg.output.dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        claim_volume(stack, out)  # a nightly run on this volume meanwhile would fork its audit chain
        scratch = out / "federated"
        scratch.mkdir(exist_ok=True)
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"round-{round_}-", dir=scratch))
        global_dir, global_sha = None, None
        recipient = aggregator_recipient(cfg, conf, round_, Path(tmp) / "aggregator-key")  # secure aggregation
        if (sealed := conf.get(GLOBAL_FIELD)) is not None:  # the aggregate, encrypted to this CVM's key
            global_dir, weights = decrypt_global(cfg, sealed, scratch_dir(cfg, cfg.output.dir.resolve()).parent)
            stack.callback(shutil.rmtree, global_dir, True)  # plaintext only in RAM, removed after the run
            global_sha = sha256_hex(weights)
        elif len(arrays):
            weights = arrays_to_safetensors(arrays)
            global_sha = sha256_hex(weights)
            global_dir = Path(tmp)
            (global_dir / "adapter_model.safetensors").write_bytes(weights)
        if str(conf.get("global-adapter-sha256", "")) != (global_sha or ""):
            raise DataError("the global adapter received does not hash to the value the aggregator announced")
        check_global_adapter(cfg, conf, round_, global_sha, Path(tmp) / "previous-round")
        ri = RoundInput(round_, nonce, global_dir, global_sha, float(conf.get("proximal-mu", 0.0)), recipient)
        result = run_once(cfg, progress=log.info, run_id=f"fed-r{round_}-{nonce[:16]}", hooks=RunHooks(federation=ri))
    return reply_for(msg, name, result.bundle_dir)


def reply_for(msg: Message, client: str, bundle: Path) -> Message:
    """The reply to ``msg`` carrying ``bundle``."""
    return Message(content=reply_content(client, bundle), reply_to=msg)


def reply_content(client: str, bundle: Path) -> RecordDict:
    """A reply's records: the bundle's adapter as ``arrays``, its token count, the bundle as tar bytes."""
    manifest = json.loads((bundle / B.MANIFEST).read_bytes())
    tokens = int((manifest["dataset"].get("validation") or {}).get("trainable_tokens", 0))
    sealed = manifest.get("confidentiality") is not None  # encrypted weights: the bundle alone, never plaintext
    return RecordDict({
        "arrays": ArrayRecord() if sealed else safetensors_to_arrays(bundle / B.ADAPTER_FILES[1]),
        "metrics": MetricRecord({WEIGHT_KEY: tokens}),
        "bundle": ConfigRecord({"client": client, "tar": pack_bundle(bundle)}),
    })


def make_client_app(config_for: ConfigFor = node_config_path) -> ClientApp:
    """A ClientApp whose cvm-tune config path ``config_for(context)`` gives."""
    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        return train_round(msg, config_for(context))

    return client


app = make_client_app()
