"""DCAP quote bytes -> a frozen :class:`Quote` (header, TD report, signature-data bounds). No I/O.

Layout (all integers little-endian; offsets verified against dcap-qvl, see
``shared/reference/attestation.md`` §4): a 48-byte header, then the report body (TDX v4: TD 1.0
report at 48; TDX v5: ``body_type u16 @48``, ``body_size u32 @50``, body at 54; SGX v3: the
384-byte enclave report), then ``u32`` signature-data length ``L`` and ``L`` bytes of signature data.
Signature checks are dcap-qvl's job; this parser only locates fields so the verifier can read
measurements and refuse quotes whose bytes extend past the signed region with anything but zeros.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from attestation.errors import QuoteParseError

TEE_TYPE_SGX = 0x00000000
TEE_TYPE_TDX = 0x00000081
HEADER_LEN = 48
TD10_BODY_LEN = 584
TD15_BODY_LEN = 648
SGX_BODY_LEN = 384
INTEL_QE_VENDOR_ID = bytes.fromhex("939a7233f79c4ca9940a0db3957f0607")
MAX_QUOTE_BYTES = 64 * 1024  # real quotes are ~5 KB; anything far larger is not a quote

# (name, size) of the TD 1.0 report body, in order.
_TD10_FIELDS = (
    ("tee_tcb_svn", 16),
    ("mr_seam", 48),
    ("mr_signer_seam", 48),
    ("seam_attributes", 8),
    ("td_attributes", 8),
    ("xfam", 8),
    ("mr_td", 48),
    ("mr_config_id", 48),
    ("mr_owner", 48),
    ("mr_owner_config", 48),
    ("rt_mr0", 48),
    ("rt_mr1", 48),
    ("rt_mr2", 48),
    ("rt_mr3", 48),
    ("report_data", 64),
)

# TDATTRIBUTES bits (Intel TDX module ABI): TUD byte 0 bit 0 = DEBUG; bits 1..7 of byte 0 reserved;
# SEC bits 8..31 with SEPT_VE_DISABLE = bit 28; OTHER bits 32..63 (PKS = 30, KL = 31 are allowed).
DEBUG_BIT = 1 << 0
SEPT_VE_DISABLE_BIT = 1 << 28
_TUD_RESERVED = 0xFE  # other reserved bits are checked by dcap-qvl (validate_attrs)


@dataclass(frozen=True)
class TdReport:
    """The TD report body of a TDX quote (all fields raw bytes)."""

    tee_tcb_svn: bytes
    mr_seam: bytes
    mr_signer_seam: bytes
    seam_attributes: bytes
    td_attributes: bytes
    xfam: bytes
    mr_td: bytes
    mr_config_id: bytes
    mr_owner: bytes
    mr_owner_config: bytes
    rt_mr0: bytes
    rt_mr1: bytes
    rt_mr2: bytes
    rt_mr3: bytes
    report_data: bytes
    mr_service_td: bytes | None = None  # TD 1.5 only

    @property
    def rtmrs(self) -> tuple[bytes, bytes, bytes, bytes]:
        """RTMR0..3 in order."""
        return (self.rt_mr0, self.rt_mr1, self.rt_mr2, self.rt_mr3)

    @property
    def td_attributes_u64(self) -> int:
        """TDATTRIBUTES as a little-endian integer."""
        return int.from_bytes(self.td_attributes, "little")

    def attribute_problems(self) -> list[str]:
        """Reasons the TD attributes are unacceptable (empty list = fine): debug, reserved bits, #VE."""
        attrs = self.td_attributes_u64
        problems = []
        if attrs & DEBUG_BIT:
            problems.append("TD is in DEBUG mode (TDATTRIBUTES.TUD.DEBUG=1): its memory is readable by the host")
        if attrs & _TUD_RESERVED:
            problems.append("reserved TUD attribute bits are set")
        if not attrs & SEPT_VE_DISABLE_BIT:
            problems.append("SEPT_VE_DISABLE is 0 (the TD accepts #VE on EPT violations)")
        if any(self.mr_signer_seam):
            problems.append("MRSIGNERSEAM is not zero (not the Intel TDX module)")
        if self.mr_service_td is not None and any(self.mr_service_td):
            problems.append("MRSERVICETD is not zero")
        return problems


@dataclass(frozen=True)
class Quote:
    """A parsed DCAP quote. ``raw`` is kept byte-exact for dcap-qvl and proof.t16z.com."""

    raw: bytes
    version: int
    attestation_key_type: int
    tee_type: int
    qe_vendor_id: bytes
    user_data: bytes
    body_offset: int
    body_type: int  # 2 = TD1.0, 3 = TD1.5 (v5); 2 for v4; 0 for SGX
    td: TdReport | None  # None for SGX quotes
    sig_data_len: int
    signed_end: int  # offset just past the declared signature data

    @property
    def is_tdx(self) -> bool:
        """True for TDX quotes (TEE type 0x81)."""
        return self.tee_type == TEE_TYPE_TDX

    @property
    def tee_name(self) -> str:
        """"TDX", "SGX" or the hex TEE type."""
        return {TEE_TYPE_TDX: "TDX", TEE_TYPE_SGX: "SGX"}.get(self.tee_type, f"0x{self.tee_type:08x}")

    @property
    def trailing(self) -> bytes:
        """Bytes after the declared signature data (unsigned; real dstack quotes pad with zeros)."""
        return self.raw[self.signed_end :]

    @property
    def report_data_offset(self) -> int:
        """Absolute offset of REPORTDATA (568 in a v4 TDX quote)."""
        return self.body_offset + 520

    @classmethod
    def from_bytes(cls, raw: bytes) -> Quote:
        """Parse quote bytes.

        Raises:
            QuoteParseError: too short, unsupported version/TEE type/body type, or a signature-data
                length that runs past the end.
        """
        raw = bytes(raw)
        if len(raw) > MAX_QUOTE_BYTES:
            raise QuoteParseError(f"quote is {len(raw)} bytes; a DCAP quote is a few KB")
        if len(raw) < HEADER_LEN:
            raise QuoteParseError(f"quote is {len(raw)} bytes, shorter than the 48-byte header")
        version, key_type, tee_type = struct.unpack_from("<HHI", raw, 0)
        qe_vendor_id, user_data = raw[12:28], raw[28:48]
        if tee_type == TEE_TYPE_SGX and version == 3:
            body_offset, body_type, body_len = HEADER_LEN, 0, SGX_BODY_LEN
        elif tee_type == TEE_TYPE_TDX and version == 4:
            body_offset, body_type, body_len = HEADER_LEN, 2, TD10_BODY_LEN
        elif tee_type == TEE_TYPE_TDX and version == 5:
            if len(raw) < HEADER_LEN + 6:
                raise QuoteParseError("v5 quote truncated in its body descriptor")
            body_type, body_len = struct.unpack_from("<HI", raw, HEADER_LEN)
            if (body_type, body_len) not in ((2, TD10_BODY_LEN), (3, TD15_BODY_LEN)):
                raise QuoteParseError(f"unsupported v5 body type {body_type} / size {body_len}")
            body_offset = HEADER_LEN + 6
        else:
            raise QuoteParseError(f"unsupported quote: version {version}, TEE type 0x{tee_type:08x}")
        sig_len_off = body_offset + body_len
        if len(raw) < sig_len_off + 4:
            raise QuoteParseError(f"quote truncated: {len(raw)} bytes, body needs {sig_len_off + 4}")
        (sig_len,) = struct.unpack_from("<I", raw, sig_len_off)
        signed_end = sig_len_off + 4 + sig_len
        if signed_end > len(raw):
            raise QuoteParseError(
                f"quote truncated: signature data declares {sig_len} bytes, only {len(raw) - sig_len_off - 4} present"
            )
        td = _parse_td(raw, body_offset, body_type) if tee_type == TEE_TYPE_TDX else None
        return cls(
            raw=raw,
            version=version,
            attestation_key_type=key_type,
            tee_type=tee_type,
            qe_vendor_id=qe_vendor_id,
            user_data=user_data,
            body_offset=body_offset,
            body_type=body_type,
            td=td,
            sig_data_len=sig_len,
            signed_end=signed_end,
        )


def _parse_td(raw: bytes, offset: int, body_type: int) -> TdReport:
    fields: dict[str, bytes] = {}
    pos = offset
    for name, size in _TD10_FIELDS:
        fields[name] = raw[pos : pos + size]
        pos += size
    if body_type == 3:
        pos += 16  # TEE_TCB_SVN_2
        fields["mr_service_td"] = raw[pos : pos + 48]
    return TdReport(**fields)


def decode_quote_input(data: bytes, *, source: str = "quote") -> bytes:
    """Accept raw quote bytes, hex text (``0x`` prefix and whitespace allowed) or a dstack GetQuote
    JSON response (``{"quote": "<hex>", ...}``) and return the raw bytes.

    Raises:
        QuoteParseError: empty, odd-length/invalid hex, JSON without a ``quote`` string, or too large.
    """
    if not data:
        raise QuoteParseError(f"{source} is empty")
    if len(data) > 4 * MAX_QUOTE_BYTES:
        raise QuoteParseError(f"{source} is {len(data)} bytes; a DCAP quote is a few KB")
    head = data.lstrip()[:1]
    if head == b"{":
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise QuoteParseError(f"{source} looks like JSON but does not parse: {exc}") from exc
        if not isinstance(obj, dict) or not isinstance(obj.get("quote"), str):
            raise QuoteParseError(f"{source} is JSON without a \"quote\" hex string (expected a GetQuote response)")
        return _from_hex(obj["quote"].encode(), source)
    if _looks_like_hex(data):
        return _from_hex(data, source)
    return bytes(data)


def _looks_like_hex(data: bytes) -> bool:
    text = data.strip()
    if text[:2] in (b"0x", b"0X"):
        return True
    return bool(text) and all(c in b"0123456789abcdefABCDEF \t\r\n" for c in text)


def _from_hex(text: bytes, source: str) -> bytes:
    cleaned = b"".join(text.split())
    if cleaned[:2] in (b"0x", b"0X"):
        cleaned = cleaned[2:]
    if len(cleaned) % 2:
        raise QuoteParseError(f"{source}: hex text has an odd number of digits ({len(cleaned)})")
    try:
        return bytes.fromhex(cleaned.decode("ascii"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise QuoteParseError(f"{source}: not valid hex") from exc


def read_quote_file(path: Path) -> bytes:
    """Read a quote file in any accepted form (see :func:`decode_quote_input`).

    Raises:
        QuoteParseError: missing/unreadable file or undecodable content.
    """
    try:
        with open(path, "rb") as fh:
            data = fh.read(4 * MAX_QUOTE_BYTES + 1)  # bounded: never slurp a huge file
    except OSError as exc:
        raise QuoteParseError(f"cannot read {path}: {exc.strerror}", fix="pass an existing quote file") from exc
    return decode_quote_input(data, source=str(path))
