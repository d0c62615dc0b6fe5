"""runtime/beats.py: slots handed out, reused and read, the file grown under workers that map it."""

import math
import os
import subprocess
import sys
import time

import pytest
from harness import REPO

from runtime import heartbeat
from runtime.beats import BEATS_NAME, BeatFile
from workers import protocol


@pytest.fixture
def beats(tmp_path):
    beats = BeatFile(str(tmp_path))
    yield beats
    beats.close()


def test_a_stamp_a_worker_writes_is_what_the_front_reads(beats):
    before = time.monotonic()
    first, second = beats.allocate(), beats.allocate()
    assert (first, second) == (0, 1)
    assert before <= beats.last_beat(first) <= time.monotonic(), "a new slot is not stamped with its start"
    worker_side = protocol.map_beats(beats.path)
    worker_side[protocol.beat_index(first)], worker_side[protocol.beat_index(second)] = 5.0, 7.0
    assert (beats.last_beat(first), beats.last_beat(second)) == (5.0, 7.0)
    assert beats.oldest() == 5.0


def test_a_freed_slot_is_reused_lowest_first_and_stamped_anew(beats):
    slots = [beats.allocate() for _ in range(4)]
    worker_side = protocol.map_beats(beats.path)
    for slot in slots:
        worker_side[protocol.beat_index(slot)] = 123.0
    worker_side[protocol.beat_index(0)] = 100.0
    beats.free(2)
    beats.free(1)
    assert beats.oldest() == 100.0, "a freed slot still counts among the stamps"
    assert beats.allocate() == 1
    assert beats.last_beat(1) > 123.0, "the reused slot kept its earlier worker's stamp"
    assert beats.allocate() == 2
    assert beats.allocate() == 4, "a slot still in use was handed out again"


def test_no_slot_in_use_has_no_oldest_stamp(beats):
    assert beats.oldest() == math.inf
    beats.free(beats.allocate())
    assert beats.oldest() == math.inf


def test_the_file_grows_under_a_worker_that_mapped_it_small(beats):
    per_page = os.path.getsize(beats.path) // protocol.BEAT_BYTES
    first_worker = protocol.map_beats(beats.path)  # mapped before the file grows
    slots = [beats.allocate() for _ in range(per_page + 1)]
    assert slots == list(range(per_page + 1))
    assert os.path.getsize(beats.path) >= (per_page + 1) * protocol.BEAT_BYTES
    late_worker = protocol.map_beats(beats.path)  # forked after the file grew
    first_worker[protocol.beat_index(0)] = 1.5
    late_worker[protocol.beat_index(per_page)] = 2.5
    assert beats.last_beat(0) == 1.5, "the front lost a slot when it remapped the grown file"
    assert beats.last_beat(per_page) == 2.5


def test_a_file_an_earlier_front_left_is_replaced_not_shared(tmp_path):
    earlier = BeatFile(str(tmp_path))
    leftover_worker = protocol.map_beats(earlier.path)
    earlier.close()
    beats = BeatFile(str(tmp_path))
    try:
        slot = beats.allocate()
        leftover_worker[protocol.beat_index(slot)] = 9.0
        assert beats.last_beat(slot) != 9.0, "a process of the earlier front stamped our slot"
        assert os.stat(beats.path).st_mode & 0o777 == 0o600
        assert os.listdir(tmp_path) == [BEATS_NAME]
    finally:
        beats.close()


@pytest.mark.parametrize(
    ("limit_ms", "beat_ms"),
    [(10_000, 7_500), (20_000, 17_500), (5_000, 2_500), (2_000, 1_000), (1_000, 500)],
)
def test_an_idle_worker_beats_as_seldom_as_leaves_a_margin_and_twice_per_short_limit(limit_ms, beat_ms):
    assert heartbeat.idle_beat_ms(limit_ms) == beat_ms
    assert limit_ms - beat_ms >= min(heartbeat.BEAT_MARGIN_MS, limit_ms / 2)


def test_a_slot_says_which_model_its_pack_runs_and_starts_running_nothing(beats):
    slot = beats.allocate()
    worker_side = protocol.map_beats(beats.path)
    worker_side[protocol.running_index(slot)] = protocol.model_tag("m")
    worker_side[protocol.beat_index(slot)] = 4.0
    assert beats.running(slot) == protocol.model_tag("m") and beats.last_beat(slot) == 4.0
    assert protocol.model_tag("m") != protocol.model_tag("n")
    assert protocol.model_tag("") != protocol.NOTHING_RUNNING
    beats.free(slot)
    assert beats.allocate() == slot and beats.running(slot) == protocol.NOTHING_RUNNING
    assert beats.oldest() > 4.0, "a running field was read as a beat"


FILL_THEN_GROW = r"""
import errno, os, sys
from runtime.beats import BeatFile
folder = sys.argv[1]
beats = BeatFile(folder)
beats.allocate()
with open(os.path.join(folder, "filler"), "wb", buffering=0) as filler:
    try:
        while True:
            filler.write(bytes(4096))
    except OSError:
        pass
try:
    for _ in range(600):  # past the file's first page, which the disk could hold
        beats.allocate()
except OSError as error:
    sys.exit(0 if error.errno == errno.ENOSPC else 1)
sys.exit(2)
"""


def test_a_full_disk_refuses_a_slot_rather_than_killing_the_front_with_sigbus(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    mount_tmpfs = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)]
    made = subprocess.run(mount_tmpfs, capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"no tmpfs can be mounted here: {made.stderr.decode().strip()}")
    try:
        child = [sys.executable, "-c", FILL_THEN_GROW, str(mount)]
        ran = subprocess.run(child, cwd=REPO, capture_output=True)
        assert ran.returncode == 0, (ran.returncode, ran.stderr.decode()[-2000:])
    finally:
        subprocess.run(["umount", str(mount)], check=True)
