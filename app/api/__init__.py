"""The attested Tinker-compatible training API (``cvm-tune api serve``; docs/api.md).

:func:`open_service` loads the configured base model once, opens the guest agent and the state database and
returns the :class:`~app.api.service.Service` the routes (:mod:`app.api.http.server`) call; :func:`serve` runs it with
uvicorn, with TLS that terminates inside the CVM (:mod:`app.api.http.tls`); plain HTTP only on loopback with the simulator.

Both choose the training backend (``api.backend``, :mod:`app.api.engine.backend`) before anything else is imported: Unsloth
must be imported before transformers, peft and trl.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Callable, Iterator
from contextlib import ExitStack

from app.config import Config
from app.errors import ConfigError

Progress = Callable[[str], None]
STOP_WAIT_S = 30.0  # at shutdown, how long the operation running may take to finish (compose: 60 s to stop)


@contextlib.contextmanager
def open_service(cfg: Config, progress: Progress = lambda _m: None, *, export: bool = True) -> Iterator[object]:
    """The service for ``cfg`` (base model loaded, state database migrated, guest agent open), closed after."""
    from app.api.engine.backend import prepare

    backend = prepare(cfg)  # first: Unsloth (GPU) is imported before anything imports transformers/peft/trl
    from app.api.proof.bundle import Exporter
    from app.api.engine.engine import Engine
    from app.api.service import Service
    from app.api.proof.store import Store
    from app.api.proof.vault import open_vault
    from app.fsutil import remove_stale_temps
    from app.run.stages import agent_stage, base_model_stage
    from app.state import claim_volume
    from app.training import threads
    from app.training.options import imported_versions, library_names

    out = cfg.output.dir.resolve()
    for sub in ("state", "models", "exports", "api"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        claim_volume(stack, out)  # one writer of the audit chain and exports/ per volume
        remove_stale_temps(out / "exports")  # an export (or a withdrawal) cut short by a kill
        ag = agent_stage(cfg, stack, progress)
        if ag.simulated:  # the simulator's test policy next to exports/, as `cvm-tune run` writes it
            from attestation.policy import policy_file_text, simulator_policy

            from app.export.stage import SIMULATOR_POLICY_FILE
            from app.fsutil import atomic_write_bytes

            policy = policy_file_text(simulator_policy(ag.agent.simulator_root_der())).encode()
            atomic_write_bytes(out / SIMULATOR_POLICY_FILE, policy)
            progress(f"simulator test policy: {out / SIMULATOR_POLICY_FILE}")
        vault = open_vault(cfg, out, ag)  # before the base model loads: a missing RAM directory is refused first
        base = base_model_stage(cfg, out, progress)
        name = cfg.base_model.hub_id or base.name
        if backend == "hf":  # auto leaves one CPU to request handling: torch's threads on every CPU wait on the HTTP loop
            cpu = threads.apply(cfg.training.cpu_threads, reserve=1)
            why = f"of {cpu['available']}, {cpu['busy']} busy, 1 left to request handling" if cpu["setting"] == "auto" \
                else "training.cpu_threads"
            progress(f"cpu threads: {cpu['threads']} ({why})")
        engine = Engine(base.dir, backend, cfg)
        engine.base_name = name
        stack.callback(engine.stop)
        progress("packed passes: " + (f"forward_backward ops of different models waiting together share one "
                                      f"base-model pass, up to {engine.pass_budget >> 20} MiB of activations and "
                                      f"logits (about {engine.pass_budget // engine.token_bytes} tokens) and at least "
                                      f"{engine.pad_rows} rows a pass"
                                      if engine.packed else f"off (backend {backend})"))
        stack.callback(lambda: progress("engine batching: {passes} packed passes of {packed_ops} ops, at most "
                                        "{largest} ops a pass; {sample_batches} sample batches of {batched_samples} "
                                        "requests, at most {largest_sample_batch} a batch".format(**engine.batching)))
        libraries = imported_versions(library_names(backend))
        progress(f"training backend: {backend} ({', '.join(f'{k} {v}' for k, v in sorted(libraries.items()))})")
        store = Store(out)
        stack.callback(store.close)
        stack.callback(engine.stop, STOP_WAIT_S)  # first: the op running commits before the database closes
        exporter = Exporter(cfg, out, ag, base, backend=backend) if export else None
        progress(saves_line(tuple(cfg.export.recipients), ag.agent.get_key))

        def collateral(quote: bytes) -> str | None:
            return ag.agent.bundle_collateral(quote, mode=cfg.tee.collateral, pccs_url=cfg.tee.pccs_url,
                                              timeout_s=cfg.tee.timeout_s)[0]

        yield Service(out=out, engine=engine, store=store, exporter=exporter, base_name=name, limits=cfg.api,
                      agent=ag, collateral=collateral, vault=vault)


def saves_line(recipients: tuple[str, ...], get_key: Callable[[str, str], bytes]) -> str:
    """The start line that says how saves are kept: states sealed to the app; export bundles' weights in the clear,
    or age ciphertext to ``export.recipients`` and the CVM's own key (its age recipient, derived from ``get_key``)."""
    sealed = "saves: training states sealed to this app (api/checkpoints/); export bundles' weights "
    if not recipients:
        return sealed + "in the clear (no export.recipients)"
    from attestation.outputs import confidential

    from app.export.confidential import cvm_identity

    cvm = confidential.recipient_of(cvm_identity(get_key))
    return sealed + (f"age-encrypted to {len(recipients)} export.recipients ({', '.join(sorted(recipients))}) "
                     f"and the CVM's key {cvm}")


def check_listen(listen: str) -> tuple[str, int, bool]:
    """(host, port, loopback) of ``HOST:PORT``.

    Raises:
        ConfigError: not HOST:PORT.
    """
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    try:
        number = int(port)
        if not host or not 0 <= number <= 65535:
            raise ValueError(listen)
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        if not host or not port.isdigit():
            raise ConfigError(f"--listen {listen!r} is not HOST:PORT", fix="e.g. --listen 127.0.0.1:8443") from None
        loopback = False  # a host name
    return host, number, loopback


def serve(cfg: Config, listen: str, progress: Progress = print, *, plain_http: bool = False) -> None:
    """Serve until stopped: TLS with the CVM-derived key (:mod:`app.api.http.tls`), or plain HTTP on loopback with the
    simulator.

    Raises:
        ConfigError: plain HTTP asked for off loopback or in a real CVM, bad --listen, no API key accepted, or
            ``api.backend: unsloth`` where it cannot run (before anything is loaded or listens).
    """
    from app.api.engine.backend import prepare

    host, port, loopback = check_listen(listen)
    if plain_http and not loopback:
        raise ConfigError(f"--plain-http on {host}: plain HTTP is served on loopback only", fix="drop --plain-http")
    prepare(cfg)  # the backend decision, and Unsloth's import, before uvicorn, FastAPI, tinker and the engine
    import uvicorn

    import sys

    # The engine's thread holds the GIL through Python for up to the switch interval (5 ms by default) while a
    # request waits on it; 1 ms lets request handling in sooner (docs/performance.md: many tenants).
    sys.setswitchinterval(0.001)

    from app.api.http.server import accepted_keys, create_app
    from app.api.http.tls import tls_identity

    keys = accepted_keys(cfg.api.key_sha256)
    if not keys:
        raise ConfigError("no API key is accepted", fix="set CVM_TUNE_API_KEYS=tml-... or api.key_sha256 in the config")
    with open_service(cfg, progress) as svc, ExitStack() as files:
        if plain_http and not svc.agent.simulated:  # type: ignore[attr-defined]
            raise ConfigError("--plain-http in a CVM: the API is served with TLS that terminates inside it",
                              fix="drop --plain-http; clients check the server with `cvm-tune api attest`")
        ssl: dict[str, str] = {}
        if not plain_http:
            svc.tls = tls_identity(svc.agent.agent, cfg.api.tls_names, svc.out / "api")  # type: ignore[attr-defined]
            ssl["ssl_keyfile"], ssl["ssl_certfile"] = files.enter_context(svc.tls.files())  # type: ignore[attr-defined]
        config = uvicorn.Config(create_app(svc, keys), host=host, port=port, log_level="warning", access_log=False,
                                proxy_headers=False, **ssl)  # no proxy's headers are trusted, none are parsed
        config.load()  # reads the key and certificate now
        files.close()  # ... which then leave the disk
        if config.ssl is not None:  # a client that does not trust the certificate is named, with the fix
            from app.api.http.tls import log_refused_handshakes

            log_refused_handshakes(config.ssl, progress, f"https://{host}:{port}")
        server = uvicorn.Server(config)
        original = server.startup
        scheme = "http" if plain_http else "https"

        async def startup(sockets: object = None) -> None:
            await original(sockets)
            bound = server.servers[0].sockets[0].getsockname()[1] if server.servers else port
            progress(f"listening on {scheme}://{host}:{bound} (base model {svc.base_name})")  # type: ignore[attr-defined]

        server.startup = startup  # type: ignore[method-assign]
        from app.api.http.server import run_until_stopped

        run_until_stopped(server)  # SIGTERM / SIGINT: a graceful stop, exit 0 as documented
