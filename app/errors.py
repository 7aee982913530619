"""The app's one exception hierarchy.

Every error a user can cause or fix derives from :class:`CvmTuneError`. The CLI catches it
once, prints ``error: <message>`` and ``fix: <what to do>`` and exits with the category's code
(documented in docs/exit-codes.md). Anything else is a bug: the CLI prints one line and
exits 70 (a traceback only with ``--debug``).
"""

from __future__ import annotations


class CvmTuneError(Exception):
    """Base class: an error with a one-line message and a fix for the user."""

    exit_code = 70
    category = "internal"
    default_fix = "rerun with --debug and report the traceback"

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix or self.default_fix


class ConfigError(CvmTuneError):
    """The configuration file or a command-line argument is invalid."""

    exit_code = 2
    category = "config"
    default_fix = "correct the configuration (fields: docs/configuration.md, `cvm-tune schema`) or the command's arguments (`cvm-tune COMMAND --help`)"


class DataError(CvmTuneError):
    """The dataset cannot be read, authenticated or validated."""

    exit_code = 3
    category = "data"
    default_fix = "check the dataset file and re-encrypt it with `cvm-tune` if needed"


class DatasetFormatError(DataError):
    """The file is not a cvm-tune encrypted dataset, or its header is malformed."""


class DatasetIntegrityError(DataError):
    """Authentication failed: the ciphertext was modified, truncated, reordered or extended."""

    default_fix = "the encrypted dataset was modified or damaged in transit: copy it again from the data owner"


class HeaderIntegrityError(DatasetIntegrityError):
    """The header MAC does not match (header edited)."""


class ChunkIntegrityError(DatasetIntegrityError):
    """A chunk failed AEAD authentication (bit flip, reorder, duplicate)."""


class TruncatedDatasetError(DatasetIntegrityError):
    """The stream ended without an authenticated final chunk."""


class TrailingDataError(DatasetIntegrityError):
    """Bytes follow the authenticated final chunk."""


class RowError(DataError):
    """A JSONL row is malformed or has the wrong schema (message names file and line, never content)."""


class TableError(DataError):
    """A Parquet or Arrow dataset cannot be read (truncated, corrupt) or has columns rows cannot use."""


class EmptyDatasetError(DataError):
    """No trainable rows are left."""


class AllRowsFilteredError(EmptyDatasetError):
    """Rows were read, but the row policies (too long, duplicates, nothing to learn) left none."""

    default_fix = "check dataset.too_long, dataset.dedup and training.max_length against the dataset"


class ZeroTrainableTokensError(DataError):
    """Rows remain, but none has a token that contributes to the loss (all labels masked)."""

    default_fix = "raise training.max_length or set training.assistant_only_loss: false"


class DatasetTooLargeError(DataError):
    """The plaintext is larger than dataset.max_plaintext_bytes (training keeps rows in memory)."""

    default_fix = "split the dataset or raise dataset.max_plaintext_bytes on a machine with enough memory"


class DatasetSignatureError(DatasetIntegrityError):
    """The data owner's signature is invalid, from another key, or does not match the content."""

    default_fix = "ask the data owner for the dataset signed with the key pinned in dataset.owner_public_key"


class UnsignedDatasetError(DatasetSignatureError):
    """The configuration pins an owner key, but the dataset carries no owner signature (format v1)."""


class DatasetRollbackError(DataError):
    """The dataset is older than the last one trained on (or reuses its version for other content)."""

    default_fix = "use the newest dataset version from the data owner (versions only move forward)"


class KeySourceError(CvmTuneError):
    """The dataset key cannot be obtained or is the wrong key."""

    exit_code = 4
    category = "key"
    default_fix = "check the key source in the configuration (dataset.key)"


class WrongKeyError(KeySourceError):
    """The key does not open this dataset (key check failed before any plaintext was released)."""

    default_fix = "use the key the data owner encrypted this dataset for (GetKey path or key file)"


class KeyReleasePendingError(KeySourceError):
    """Attested key release: a key request was written; the owner's grant has not arrived yet."""

    default_fix = "send the key request to the data owner, place their grant where dataset.key.grant_file points, run again"


class KeyGrantError(KeySourceError):
    """The owner's key grant is malformed, not for this request, not signed by the pinned owner, or does not open."""

    default_fix = "ask the data owner for a new grant for the current key request (cvm-tune dataset release)"


class NotARecipientError(KeySourceError):
    """Confidential weights: none of the age identities given is a recipient of the bundle's weight files."""

    default_fix = "pass the age identity file (age-keygen) of a recipient the dataset's owner or export.recipients named"


class CiphertextRejected(CvmTuneError):
    """Confidential weights: a weight file is not the ciphertext its manifest binds (altered or truncated), or it
    decrypts to other bytes than the manifest's plaintext hash. Nothing was written."""

    exit_code = 1
    category = "rejected"
    default_fix = "fetch the bundle again (cvm-tune bundles fetch) and run `cvm-tune verify` on it"


class KeyReleaseRefusedError(CvmTuneError):
    """Owner side: the CVM's quote or key request does not satisfy the owner's policy; no key was released."""

    exit_code = 1
    category = "rejected"
    default_fix = "release only to a CVM running the code your policy allows (compose-hash, measurements, TCB)"


class TeeError(CvmTuneError):
    """The guest agent (dstack or simulator) is unreachable or refused a request."""

    exit_code = 5
    category = "attestation"
    default_fix = "run inside a dstack CVM with /var/run/dstack.sock mounted, or start `cvm-tune simulator`"


class NoTeeError(TeeError):
    """No guest agent is configured or reachable: nothing will be exported unattested."""


class TrainingError(CvmTuneError):
    """Training could not start or failed."""

    exit_code = 6
    category = "training"
    default_fix = "check the training and base_model settings"


class BaseModelError(TrainingError):
    """Base model files are missing or do not match the pinned hash."""


class RoundFailedError(TrainingError):
    """A federated round admitted fewer verified client bundles than ``federation.min_clients`` (nothing aggregated)."""


class StateError(CvmTuneError):
    """Output volume state (checkpoints, runs, exports) is inconsistent or cannot be written."""

    exit_code = 7
    category = "state"
    default_fix = "check free space and permissions on the output volume"


class ExportError(StateError):
    """The export bundle could not be written; no partial bundle is left behind."""


class PrivacyLedgerError(StateError):
    """``state/privacy-budget.json`` is damaged, or records less than the audit chain and the exported bundles."""

    default_fix = ("restore state/privacy-budget.json from a backup of the output volume, or delete it: it is then "
                   "rebuilt from the audit chain and the exported bundles")


class PromotionStateError(StateError):
    """``exports/PROMOTED`` (or the bundle it names) disagrees with the audit chain's record of promotions, or the
    promoted adapter was trained on another dataset."""

    default_fix = ("restore exports/PROMOTED and the promoted bundle from a backup of the output volume (the error "
                   "names the run the audit chain promoted last)")


_DISK_ERRNOS = frozenset({28, 122, 30, 5, 27})  # ENOSPC, EDQUOT, EROFS, EIO, EFBIG
_DISK_WORDS = ("No space left on device", "Disk quota exceeded", "failed writing file", "Read-only file system")


def disk_error(exc: BaseException, where: str) -> StateError | None:
    """A StateError (exit 7, "free space") when ``exc`` or its cause is a full, read-only or failing disk.

    Libraries wrap the OSError (torch's serializer raises RuntimeError "failed writing file"): the cause chain
    and the message are both looked at. None when it is not a disk problem (the caller keeps its own category).
    """
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            break
        if (isinstance(seen, OSError) and seen.errno in _DISK_ERRNOS) or any(w in str(seen) for w in _DISK_WORDS):
            detail = seen.strerror if isinstance(seen, OSError) and seen.strerror else "write failed"
            return StateError(f"{where}: {detail}",
                              fix="free space on the output volume and the scratch tmpfs (/dev/shm), then run again: "
                              "the run resumes from its last sealed checkpoint")
        seen = seen.__cause__ or seen.__context__
    return None


class InputsUnchanged(Exception):
    """Not an error: a continual run found nothing new to train on (same dataset, base model, settings and code as
    the promoted run, or as a refused candidate from the same parent). The service records the slot ``skipped``;
    ``cvm-tune run`` prints the reason and exits 0."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class PrivacyBudgetError(ConfigError):
    """training.privacy: the run would spend more than the dataset version's lifetime epsilon allows."""

    default_fix = ("lower training.privacy.target_epsilon, raise training.privacy.lifetime_epsilon deliberately, or "
                   "train on a new dataset version (the budget is kept per dataset version)")
