"""What the running container was built from, for the manifest's ``build`` section.

* **image**: the ``cvm-tune`` service's image in the app-compose the guest agent measured (its compose-hash is
  in RTMR3 and MRCONFIGID), so the digest is the measured one, not a claim the image makes about itself (an image
  cannot contain its own digest). The verifier re-reads it from the bundle's ``app-compose.json``.
* **lock**: ``$CVM_TUNE_LOCK_FILE`` (set by the Dockerfile to the lock it installed), hashed now, and every pin in it
  compared with the installed distributions: ``lock_mismatches`` lists any difference (empty = the environment is
  the lock). Local version labels (``+cu126``) are ignored, as pip does for ``==`` pins.
* **base_image**: ``$CVM_TUNE_BASE_IMAGE`` (the Dockerfile's pinned base), for the record.

Outside an image (a checkout, CI) the lock and base are absent and ``image`` is whatever the agent's compose says.
"""

from __future__ import annotations

import os
import re
from importlib import metadata
from pathlib import Path
from typing import Any

from attestation.compose import app_compose as C
from attestation.io.hashing import sha256_file

from app.errors import ConfigError

LOCK_ENV = "CVM_TUNE_LOCK_FILE"
BASE_ENV = "CVM_TUNE_BASE_IMAGE"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")


def lock_pins(path: Path) -> dict[str, str]:
    """``name -> version`` of a lock file, following ``-r`` includes (relative to the file)."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.startswith("-r "):
            pins.update(lock_pins(path.parent / line[3:].strip()))
        elif m := _PIN.match(line):
            pins[m.group(1)] = m.group(2)
    return pins


def lock_mismatches(path: Path) -> list[str]:
    """Pins of ``path`` that the running environment does not satisfy."""
    out = []
    for name, want in sorted(lock_pins(path).items()):
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            out.append(f"{name}: not installed (lock {want})")
            continue
        if have.split("+")[0] != want.split("+")[0]:
            out.append(f"{name}: {have} installed, lock {want}")
    return out


def build_info(app_compose: str) -> dict[str, Any] | None:
    """The manifest's ``build`` section; None when nothing is known (no image, no lock).

    Raises:
        ConfigError: ``$CVM_TUNE_LOCK_FILE`` names a file that does not exist (a broken image).
    """
    image = None
    try:
        image = C.images(C.load(app_compose.encode())).get(C.SERVICE)
    except C.ComposeError:
        pass
    lock = os.environ.get(LOCK_ENV)
    info: dict[str, Any] = {"image": image, "image_digest": C.image_digest(image), "base_image": os.environ.get(BASE_ENV),
                            "lock_file": None, "lock_sha256": None, "lock_mismatches": []}
    if lock:
        path = Path(lock)
        if not path.is_file():
            raise ConfigError(f"{LOCK_ENV}={lock} does not exist", fix="rebuild the image (the Dockerfile copies the lock it installed)")
        info.update(lock_file=path.name, lock_sha256=sha256_file(path), lock_mismatches=lock_mismatches(path))
    return info if image or lock else None
