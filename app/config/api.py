"""The ``api`` section: the Tinker-compatible training API (``cvm-tune api serve``)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from app.config.base import HEX64, _Closed


class ApiSettings(_Closed):
    """Who may call the training API, and how much one request or session may ask for."""

    key_sha256: tuple[str, ...] = Field((), description="SHA-256 (hex) of each accepted API key (keys start with "
                                        "`tml-`). The keys themselves come through dstack's encrypted environment; "
                                        "env `CVM_TUNE_API_KEYS` (comma-separated) adds keys for local use.")
    max_tokens_per_request: int = Field(65536, ge=1, description="Most tokens (model input, all datums together) "
                                        "one forward_backward or forward request may carry.")
    max_seq_len: int = Field(2048, ge=2, description="Longest model input (tokens) of one datum or sampling prompt.")
    max_queued_futures: int = Field(64, ge=1, description="Most operations of one session waiting to run.")
    max_sample_tokens: int = Field(512, ge=1, description="Largest sampling max_tokens.")
    max_lora_rank: int = Field(64, ge=1, description="Largest LoRA rank create_model accepts.")
    max_models: int = Field(64, ge=1, description="Most models (LoRA adapters with their optimizer state) loaded at "
                            "once, all keys together; one more (create_model, or a load into a new model) is refused "
                            "with 503 until unload_model frees a place. A model is never evicted to make room; one "
                            "whose adapter and Adam state would not fit in the free (GPU or system) memory is refused "
                            "alike.")
    max_sessions_per_key: int = Field(64, ge=1, description="Most open sessions (create_session, until the client "
                                      "closes it) one API key may hold; one more is refused with 429.")
    max_sampling_sessions_per_key: int = Field(1024, ge=1, description="Most sampling sessions "
                                               "(create_sampling_session) one API key may create while the server "
                                               "runs; one more is refused with 429.")
    sampler_ttl_s: int | None = Field(None, ge=3600, le=315_360_000, description="Lifetime (seconds) of a "
                                      "save_weights_for_sampler state saved without ttl_seconds: its sealed state is "
                                      "removed once expired (its export bundle, if one was asked for, stays). None: "
                                      "kept until deleted.")
    max_saved_bytes: int | None = Field(None, ge=1, description="Most bytes the API's saved states and their export "
                                        "bundles may hold on the output volume; a save that would pass it is refused "
                                        "(the save's future fails, category user) and nothing is written. None: no "
                                        "limit.")
    tls_names: tuple[str, ...] = Field((), description="Host names (or IP addresses) the server's TLS certificate "
                                       "names besides 127.0.0.1 and localhost: the names clients connect to.")
    pack_wait_ms: float = Field(10.0, ge=0, le=1000, description="Gather window of the engine's packed passes: "
                                "a pass of forward_backward ops waits at most this long (and no longer than the "
                                "previous pass took) for the next op of every other model that trained in the last "
                                "0.1 s, so that tenants stepping at once share passes. A lone model never waits. 0: "
                                "a pass takes only what is already waiting.")
    sample_wait_ms: float = Field(40.0, ge=0, le=1000, description="Gather window of the engine's sample batches: "
                                  "a batch of sample requests without a seed waits at most this long (and no longer "
                                  "than the previous batch took) for the next request of every other sampler that got "
                                  "its answer in the last 0.1 s, so that tenants sampling in turn decode together. A "
                                  "lone sampler never waits. 0: a batch takes only what is already waiting.")
    long_poll_s: float = Field(5.0, ge=0, le=30, description="How long retrieve_future waits for a result before "
                               "answering try_again.")
    backend: Literal["auto", "hf", "unsloth"] = Field(
        "auto", description="Training backend of the API's engine, chosen as for training.backend: auto: Unsloth when "
        "it imports and a CUDA GPU is present, else transformers+PEFT. unsloth where it cannot run: refused at serve "
        "start (exit 2).")

    @field_validator("key_sha256")
    @classmethod
    def _hex(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [h for h in v if not re.fullmatch(HEX64, h)]
        if bad:
            raise ValueError(f"api.key_sha256: {bad[0]!r} is not a SHA-256 in lowercase hex (printf %s KEY | sha256sum)")
        return v
