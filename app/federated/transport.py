"""What travels in Flower messages: LoRA weights as an ``ArrayRecord`` (and as safetensors bytes on disk), and a
client's export bundle as tar bytes in a ``ConfigRecord``.

The global adapter's identity is ``sha256(safetensors.numpy.save(arrays))``: both sides serialise the same arrays
the same way, so the hash a client records is the hash of the file the round bundle holds.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path, PurePosixPath
from typing import Any

from app.errors import DataError

MAX_BUNDLE_BYTES = 2 << 30  # a client bundle (adapter, tokenizer, evidence), not a merged model
MAX_MEMBERS = 10_000  # an export bundle has a few dozen files
MAX_TENSORS = 100_000  # LoRA on every projection of a large model: a few thousand
_ALLOWED_DTYPES = ("float32", "float64", "float16")


def arrays_to_safetensors(record: Any) -> bytes:
    """Serialise an ``ArrayRecord`` (name -> Array) to safetensors bytes.

    Raises:
        DataError: an array of a dtype a LoRA adapter never has.
    """
    from safetensors.numpy import save

    arrays = {name: arr.numpy() for name, arr in record.items()}
    if odd := sorted(n for n, a in arrays.items() if a.dtype.name not in _ALLOWED_DTYPES):
        raise DataError(f"adapter tensor {odd[0]!r} has dtype {arrays[odd[0]].dtype.name}, not a float type")
    return save(arrays)


def safetensors_to_arrays(path: Path) -> Any:
    """The tensors of a safetensors file as an ``ArrayRecord`` (names sorted).

    Raises:
        DataError: unreadable, or a tensor NumPy has no type for (bfloat16).
    """
    return to_record(load_adapter(path))


def decode_arrays(record: Any) -> dict[str, Any]:
    """The NumPy arrays of an ``ArrayRecord`` a client sent, each checked to be a float adapter tensor.

    Raises:
        DataError: not an ``ArrayRecord``, too many tensors, or a tensor that does not decode (bad dtype, shape or
            bytes) or is not float16/32/64.
    """
    from flwr.app import ArrayRecord

    if not isinstance(record, ArrayRecord) or len(record) > MAX_TENSORS:
        raise DataError(f"the reply's adapter is not an ArrayRecord of at most {MAX_TENSORS} tensors")
    out = {}
    for name in record:
        try:
            arr = record[name].numpy()
        except Exception as exc:  # noqa: BLE001 - any undecodable array (dtype, shape, npy bytes) is the client's fault
            raise DataError(f"adapter tensor {str(name)[:100]!r} cannot be decoded ({type(exc).__name__})") from None
        if arr.dtype.name not in _ALLOWED_DTYPES:
            raise DataError(f"adapter tensor {str(name)[:100]!r} has dtype {arr.dtype.name}, not a float type")
        out[str(name)] = arr
    return out


def load_adapter(path: Path | bytes) -> dict[str, Any]:
    """The float tensors of a safetensors file (or of its bytes, decrypted in memory: secure aggregation).

    Raises:
        DataError: unreadable or damaged, or a tensor that is not float16/32/64 (bfloat16 has no NumPy type).
    """
    from safetensors.numpy import load, load_file

    name = "update" if isinstance(path, bytes) else path.name
    try:
        tensors = load(path) if isinstance(path, bytes) else load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - SafetensorError, bfloat16 (TypeError), OSError: all unreadable
        raise DataError(f"the adapter {name} is unreadable or holds tensors NumPy cannot represent "
                        f"({type(exc).__name__}: {str(exc)[:100]})",
                        fix="train the federation's adapters in float32 (PEFT's default for LoRA weights)") from None
    if odd := sorted(n for n, a in tensors.items() if a.dtype.name not in _ALLOWED_DTYPES):
        raise DataError(f"adapter tensor {odd[0]!r} has dtype {tensors[odd[0]].dtype.name}, not a float type")
    return tensors


def to_record(tensors: dict[str, Any]) -> Any:
    """NumPy arrays as an ``ArrayRecord`` (names sorted)."""
    from flwr.app import Array, ArrayRecord

    return ArrayRecord({name: Array(tensors[name]) for name in sorted(tensors)})


def diff_arrays(sent: dict[str, Any], bundle: dict[str, Any]) -> str | None:
    """``None`` when ``sent`` holds exactly the tensors ``bundle`` holds; else what differs."""
    import numpy as np

    if set(sent) != set(bundle):
        return f"tensor names differ ({len(set(sent) ^ set(bundle))} not in both)"
    for name in sorted(sent):
        a, b = sent[name], bundle[name]
        if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(a, b):
            return f"tensor {name[:100]!r} differs from the bundle's adapter"
    return None


def pack_bundle(bundle: Path, names: tuple[str, ...] | None = None) -> bytes:
    """A bundle directory (or just the files ``names`` in it) as uncompressed tar bytes (sorted, regular files and
    directories only)."""
    buf = io.BytesIO()
    paths = sorted(Path(bundle).rglob("*")) if names is None else [Path(bundle) / n for n in names]
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in paths:
            if path.is_symlink() or not (path.is_file() or path.is_dir()):
                raise DataError(f"bundle entry {path.relative_to(bundle)} is not a plain file or directory")
            tar.add(path, arcname=path.relative_to(bundle).as_posix(), recursive=False)
    return buf.getvalue()


def unpack_bundle(data: bytes, dest: Path) -> Path:
    """Extract tar bytes from a client into the new directory ``dest`` (regular files and directories only,
    no absolute or escaping names: tarfile's ``data`` filter) and return it.

    Raises:
        DataError: not tar bytes, too large or too many entries, or an entry that is not a plain file or
            directory.
    """
    if not isinstance(data, bytes):
        raise DataError(f"the bundle is a {type(data).__name__}, not tar bytes")
    if len(data) > MAX_BUNDLE_BYTES:
        raise DataError(f"bundle of {len(data)} bytes is larger than {MAX_BUNDLE_BYTES}")
    dest.mkdir(parents=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members = []
            for member in tar:
                members.append(member)
                if len(members) > MAX_MEMBERS:
                    raise DataError(f"the bundle has more than {MAX_MEMBERS} entries")
            if odd := [m.name for m in members if not (m.isfile() or m.isdir()) or m.name.startswith("/")
                       or ".." in PurePosixPath(m.name).parts]:
                raise DataError(f"bundle entry {odd[0][:100]!r} is not a plain file or directory inside the bundle")
            if sum(m.size for m in members) > MAX_BUNDLE_BYTES:
                raise DataError("bundle unpacks to more than the size limit")
            tar.extractall(dest, members=members, filter="data")
    except (tarfile.TarError, OSError, ValueError) as exc:  # ValueError: a NUL in a name
        raise DataError(f"the bundle is not a readable tar archive ({type(exc).__name__}: {str(exc)[:100]})") from exc
    return dest
