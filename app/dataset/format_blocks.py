"""Decoding stage one: read each ciphertext block, hash it and open it, on a worker thread.

Decryption runs as two stages on two cores. Stage one reads every ``chunk_size + 16`` block
into one reused buffer, feeds it to the ciphertext SHA-256, looks one byte ahead to learn whether
end-of-file follows, and opens it with AES-GCM (the ``open_block`` callback, which also classifies
failures). Stage two, the consumer (:class:`app.dataset.format_read.DecryptedStream`), hashes the
plaintext and hands it on. hashlib and file reads release the GIL on large buffers, so the two
SHA-256 passes proceed in parallel. Stage one opens block ``i + 1`` only after the
consumer resumed past block ``i - 1``: memory stays at one ciphertext block and two plaintext
chunks (the one the caller holds and the next). With ``threaded`` false stage one runs inline.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import BinaryIO

from app.dataset.format_header import _fill

# (block, index, byte offset, is_final) -> plaintext; raises the classified error.
OpenBlock = Callable[[memoryview, int, int, bool], bytes]


class BlockReader:
    """Iterate ``(plaintext, last)`` over the blocks of ``src`` opened by ``open_block``.

    ``last`` marks the block after which end-of-file follows; a file with no block at all yields
    ``(None, True)``. Errors (reads, authentication) surface in order, in place of their block.
    Call :meth:`advance` once the caller no longer needs the chunk before the one just received
    (threaded, stage one waits for it before opening the next block). The ciphertext hash
    (:meth:`hexdigest`) covers ``prefix`` and every byte read, complete once the last block
    arrived; ``size`` counts the same bytes. :meth:`close` stops and joins the worker: no thread
    outlives the stream.
    """

    def __init__(self, src: BinaryIO, block_size: int, prefix: bytes, open_block: OpenBlock, *, threaded: bool) -> None:
        self._src = src
        self._size = block_size
        self._open = open_block
        self._buf = bytearray(block_size)  # reused: the only ciphertext buffer
        self._hash = hashlib.sha256(prefix)
        self.size = len(prefix)
        self._stop = threading.Event()
        self._credit = threading.Semaphore(1)  # one plaintext opened ahead of the consumer
        self._ready: queue.SimpleQueue[tuple[bytes | None, bool] | BaseException] | None = None
        self._thread: threading.Thread | None = None
        if threaded:  # started on first iteration: a stream never read holds no thread
            self._ready = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._work, name="cvm-tune-decrypt", daemon=True)

    def _produce(self, wait: Callable[[], None]) -> Iterator[tuple[bytes | None, bool]]:
        view, peek, index = memoryview(self._buf), b"", 0
        while True:
            view[: len(peek)] = peek
            n = len(peek) + _fill(self._src, view[len(peek) :])
            if n == 0:
                yield None, True
                return
            self._hash.update(view[:n])
            peek = self._src.read(1) if n == self._size else b""  # look ahead: does end-of-file follow?
            offset, self.size = self.size, self.size + n
            wait()
            yield self._open(view[:n], index, offset, not peek), not peek
            if not peek:
                return
            index += 1

    def _wait_credit(self) -> None:
        self._credit.acquire()
        if self._stop.is_set():
            raise _Stopped

    def _work(self) -> None:
        assert self._ready is not None
        try:
            for item in self._produce(self._wait_credit):
                self._ready.put(item)
        except _Stopped:
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there in order
            self._ready.put(exc)

    def __iter__(self) -> Iterator[tuple[bytes | None, bool]]:
        if self._ready is None:
            yield from self._produce(lambda: None)
            return
        assert self._thread is not None
        self._thread.start()
        while True:
            item = self._ready.get()
            if isinstance(item, BaseException):
                raise item
            if item[1]:
                self._thread.join()  # the worker is done with the hash: the caller may extend it
            yield item
            if item[1]:
                return

    def advance(self) -> None:
        """The consumer's caller moved past the previous chunk: stage one may open one more."""
        if self._ready is not None:  # inline, the consumer's own pace is the limit
            self._credit.release()

    def hexdigest(self) -> str:
        """SHA-256 of the prefix and every block read (after the last block)."""
        return self._hash.hexdigest()

    def update(self, data: bytes) -> None:
        """Extend the hash and size past the blocks (the version-2 trailer), after the last block."""
        self._hash.update(data)
        self.size += len(data)

    def close(self) -> None:
        """Stop the worker and wait for it (idempotent)."""
        self._stop.set()
        self._credit.release()
        if self._thread is not None and self._thread.ident is not None:
            self._thread.join()
        self._thread = None


class _Stopped(Exception):
    """The consumer closed the reader; the worker ends quietly."""
