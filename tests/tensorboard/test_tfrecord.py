"""The TFRecord framing read record by record: the same checksums as TensorBoard's, every record of a real file, and
each kind of damage named with its byte offset."""

from __future__ import annotations

import io
import random
import struct
from pathlib import Path

import pytest
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from torch.utils.tensorboard import SummaryWriter

from gradwatch.tensorboard.tfrecord import CRC_INIT, CorruptRecordError, _checksum, _masked, crc_update, records


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 15, 16, 17, 1000, 4099], ids=lambda n: f"{n}-bytes")
def test_checksums_are_tensorboards_whole_or_in_pieces(size: int) -> None:
    data = random.Random(size).randbytes(size)
    assert _checksum(data) == masked_crc32c(data)
    cut = size // 3
    assert _masked(crc_update(crc_update(CRC_INIT, data[:cut]), data[cut:])) == masked_crc32c(data)


def _framed(*payloads: bytes) -> bytes:
    out = b""
    for payload in payloads:
        header = struct.pack("<Q", len(payload))
        out += header + struct.pack("<I", _checksum(header)) + payload + struct.pack("<I", _checksum(payload))
    return out


def test_every_record_of_a_real_event_file(tmp_path: Path) -> None:
    writer = SummaryWriter(str(tmp_path))
    for step in range(5):
        writer.add_scalar("gradwatch/verdict", 0.0, step)
    writer.close()
    (path,) = tmp_path.glob("events.out.tfevents.*")
    data = path.read_bytes()
    found = list(records(io.BytesIO(data), len(data)))
    assert len(found) == 6  # the file-version event and five scalars
    assert sum(len(r or b"") + 16 for r in found) == len(data)


def test_a_long_record_is_verified_and_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradwatch.tensorboard import tfrecord

    monkeypatch.setattr(tfrecord, "MAX_RECORD_BYTES", 100)
    monkeypatch.setattr(tfrecord, "_CHUNK", 64)
    data = _framed(b"short", b"x" * 1000, b"end")
    assert list(records(io.BytesIO(data), len(data))) == [b"short", None, b"end"]
    damaged = bytearray(data)
    damaged[21 + 16 + 500] ^= 1
    with pytest.raises(CorruptRecordError, match=r"damaged record at byte 21 \(checksum mismatch\)"):
        list(records(io.BytesIO(bytes(damaged)), len(damaged)))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: d[:5], r"truncated record header at byte 0"),
        (lambda d: d[:-2], r"past the end of the file|truncated record checksum"),
        (lambda d: d[:8] + bytes([d[8] ^ 1]) + d[9:], r"damaged record header at byte 0"),
        (lambda d: d[:14] + bytes([d[14] ^ 1]) + d[15:], r"damaged record at byte 0"),
    ],
    ids=["cut-header", "cut-footer", "header-checksum", "data"],
)
def test_damage_is_named_with_its_offset(damage: object, message: str) -> None:
    data = damage(_framed(b"payload!"))  # type: ignore[operator]
    with pytest.raises(CorruptRecordError, match=message):
        list(records(io.BytesIO(data), len(data)))
