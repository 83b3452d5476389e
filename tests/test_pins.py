"""Persisted pins (fleet.pins): a damaged file is set aside once, never an error for its readers."""

from __future__ import annotations

import logging
import threading

import pytest

from fleet.pins import PinStore


def test_pins_round_trip(tmp_path):
    store = PinStore(tmp_path)
    assert store.load() == {}
    store.add("tiny-a", "cpu")
    store.add("tiny-b", "cuda:1")
    assert set(store.load()) == {"tiny-a", "tiny-b"}
    assert store.for_device("cpu") == ["tiny-a"]
    assert store.remove("tiny-a").device == "cpu"
    assert store.remove("tiny-a") is None
    assert set(store.load()) == {"tiny-b"}


@pytest.mark.parametrize("content", [
    b"{not json",
    b'{"format": 1, "pins": {"tiny-a": {"device": "cpu"}}}',            # a field missing
    b'{"format": 1, "pins": {"../etc": {"device": "cpu", "at": "x"}}}',  # a name that is a path
    b"\xff\xfe garbage",
])
def test_a_damaged_file_is_set_aside_once_and_logged_once(tmp_path, caplog, content):
    (tmp_path / "pins.json").write_bytes(content)
    with caplog.at_level(logging.ERROR, logger="fleet.pins"):
        assert PinStore(tmp_path).load() == {}
        assert PinStore(tmp_path).load() == {}
    (aside,) = tmp_path.glob("pins.json.damaged-*")
    assert aside.read_bytes() == content  # kept for the operator, byte for byte
    assert not (tmp_path / "pins.json").exists()
    lines = [r.getMessage() for r in caplog.records if r.name == "fleet.pins"]
    assert len(lines) == 1 and "set aside as pins.json.damaged-" in lines[0]
    # Pinning works again at once, into a fresh file.
    PinStore(tmp_path).add("tiny-a", "cpu")
    assert set(PinStore(tmp_path).load()) == {"tiny-a"}


def test_a_writer_meeting_a_damaged_file_starts_a_fresh_one(tmp_path):
    (tmp_path / "pins.json").write_bytes(b"[]")
    PinStore(tmp_path).remove("tiny-a")
    assert len(list(tmp_path.glob("pins.json.damaged-*"))) == 1
    PinStore(tmp_path).add("tiny-b", "cpu")
    assert set(PinStore(tmp_path).load()) == {"tiny-b"}


def test_every_damaged_copy_is_kept(tmp_path):
    for content in (b"one", b"two", b"three"):
        (tmp_path / "pins.json").write_bytes(content)
        assert PinStore(tmp_path).load() == {}
    kept = sorted(p.read_bytes() for p in tmp_path.glob("pins.json.damaged-*"))
    assert kept == [b"one", b"three", b"two"]


def test_concurrent_readers_set_it_aside_exactly_once(tmp_path, caplog):
    (tmp_path / "pins.json").write_bytes(b"{damaged")
    results: list[dict] = []
    barrier = threading.Barrier(8)

    def read() -> None:
        barrier.wait()
        results.append(PinStore(tmp_path).load())

    with caplog.at_level(logging.ERROR, logger="fleet.pins"):
        threads = [threading.Thread(target=read) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    assert results == [{}] * 8
    assert len(list(tmp_path.glob("pins.json.damaged-*"))) == 1
    assert sum(r.name == "fleet.pins" for r in caplog.records) == 1
