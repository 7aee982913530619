"""DCAP quote bytes -> a frozen :class:`Quote` (header, TD report, signature-data bounds). No I/O.

Layout (all integers little-endian; offsets verified against dcap-qvl, see
``shared/reference/attestation.md`` §4): a 48-byte header, then the report body (TDX v4: TD 1.0
report at 48; TDX v5: ``body_type u16 @48``, ``body_size u32 @50``, body at 54; SGX v3: the
384-byte enclave report), then ``u32`` signature-data length ``L`` and ``L`` bytes of signature data.
Signature checks are dcap-qvl's job; this parser locates fields so the verifier can read
measurements, and for TDX it insists that the signature data is exactly the structure dcap-qvl reads
(``attestation.md`` §4.3), because dcap-qvl tolerates bytes it does not use::

    sig(64) att_key(64) u16 cert_type=6 u32 size  QE report(384) QE sig(64) u16 A auth(A)
    u16 inner_type=5 u32 n  PEM chain(n, ends in one NUL)

so ``L`` = 134 + size and size = 456 + A + n exactly. Flipped type or length fields (which dcap-qvl
accepts) are parse errors. What follows the signature data is padding: real dstack quotes carry
70 zero bytes there; the verifier accepts zero bytes only (``quote.padding``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from attestation.errors import QuoteParseError

TEE_TYPE_SGX = 0x00000000
TEE_TYPE_TDX = 0x00000081
HEADER_LEN = 48
TD10_BODY_LEN = 584
TD15_BODY_LEN = 648
SGX_BODY_LEN = 384
INTEL_QE_VENDOR_ID = bytes.fromhex("939a7233f79c4ca9940a0db3957f0607")
CERT_TYPE_QE_REPORT = 6  # certification data: QE report + signature + auth data + inner data
CERT_TYPE_PCK_CHAIN = 5  # inner certification data: PEM PCK chain (leaf, intermediate, root) + NUL
_QE_REPORT_LEN = 384
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
    pck_chain_offset: int | None = None  # TDX: where the inner PEM chain starts
    pck_chain: bytes | None = None  # TDX: the inner PEM chain bytes, exactly as in the quote

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
        td, chain_at, chain = None, None, None
        if tee_type == TEE_TYPE_TDX:
            td = _parse_td(raw, body_offset, body_type)
            chain_at, chain = _tdx_certification_data(raw, sig_len_off + 4, signed_end)
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
            pck_chain_offset=chain_at,
            pck_chain=chain,
        )


def _tdx_certification_data(raw: bytes, start: int, end: int) -> tuple[int, bytes]:
    """Walk the TDX signature data ``raw[start:end]``; every declared size must fit exactly.

    Returns:
        ``(offset, bytes)`` of the inner PEM PCK chain.
    """
    # ECDSA signature (64) + attestation public key (64), then the QE-report certification data
    pos = _typed_block(raw, start + 128, end, CERT_TYPE_QE_REPORT, "certification data")
    pos += _QE_REPORT_LEN + 64  # QE report + its signature by the PCK key
    if end < pos + 2:
        raise QuoteParseError("QE report certification data truncated before the QE auth data")
    (auth_len,) = struct.unpack_from("<H", raw, pos)
    pos = _typed_block(raw, pos + 2 + auth_len, end, CERT_TYPE_PCK_CHAIN, "inner certification data (PCK chain)")
    return pos, raw[pos:end]


def _typed_block(raw: bytes, pos: int, end: int, want: int, what: str) -> int:
    """A ``u16 type, u32 size`` header at ``pos`` whose data must run exactly to ``end``; returns the data offset."""
    if end < pos + 6:
        raise QuoteParseError(f"{what} header runs past the signature data")
    kind, size = struct.unpack_from("<HI", raw, pos)
    if kind != want:
        raise QuoteParseError(f"{what} type {kind}; TDX quotes carry type {want}")
    if pos + 6 + size != end:
        raise QuoteParseError(f"{what} declares {size} bytes but the signature data leaves {end - pos - 6}")
    return pos + 6


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
