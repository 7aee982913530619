"""``tee.simulator``: which dstack agent the embedded simulator imitates, and its KMS key epochs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from app.config.base import _Closed


class TeeSimulatorSettings(_Closed):
    """The embedded guest-agent simulator (tee.mode embedded-simulator): which dstack it imitates."""

    dstack: Literal["0.5", "0.6"] = Field(
        "0.6",
        description="Agent line to imitate. 0.6: dstack 0.6.7 (v0 and v1 guest API, EmitEvent refused, Attest, "
        "KMS key epochs that GetKey can select). 0.5: dstack 0.5.11 (EmitEvent extends RTMR3, no epochs).",
    )
    root_epoch: int = Field(0, ge=0, lt=2**32, description="The KMS root key epoch the simulated CVM runs under "
                            "(raise it to simulate a KMS root-key rotation).")
    app_epoch: int = Field(0, ge=0, lt=2**32, description="The app key epoch the simulated CVM runs under "
                           "(raise it to simulate an app-key rotation).")
    gpu: bool = Field(False, description="0.6 only: simulate one H100 that dstack's boot gate attested (an RTMR3 "
                      "gpu-attestation event, boot-time GPU evidence from Attest, AttestGpu evidence made of TEST bytes). "
                      "No effect on 0.5, which attaches GPUs unverified.")
