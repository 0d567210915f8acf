"""app/checkpoints/atomic.py: a file is replaced whole or not at all."""

import multiprocessing
import os
import random
import signal
import stat
import time

import pytest

from app.checkpoints.atomic import atomic_path, atomic_write, write_bytes, write_text


def test_a_block_that_raises_leaves_the_old_file_and_nothing_else(tmp_path):
    target = tmp_path / "rows.csv"
    target.write_text("old\n")
    with pytest.raises(RuntimeError), atomic_write(target, "w", newline="") as f:
        f.write("half of the new")
        raise RuntimeError("the writer failed")
    assert target.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["rows.csv"]


def test_a_complete_write_replaces_the_file_with_a_plain_files_permissions_or_private_ones(tmp_path):
    old_umask = os.umask(0o022)
    try:
        write_text(tmp_path / "marker.json", "{}\n")
        write_bytes(tmp_path / "results.pkl", b"\x80", private=True)
    finally:
        os.umask(old_umask)
    assert (tmp_path / "marker.json").read_text() == "{}\n" and (tmp_path / "results.pkl").read_bytes() == b"\x80"
    assert stat.S_IMODE((tmp_path / "marker.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "results.pkl").stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marker.json", "results.pkl"]


def test_a_path_for_writers_that_want_one_keeps_the_suffix_they_read_the_format_from(tmp_path):
    out = tmp_path / "sub" / "plot.png"
    with atomic_path(out) as partial:
        assert partial.parent == out.parent and partial.name.startswith(".plot.png.") and partial.suffix == ".png"
        partial.write_bytes(b"png")
        assert not out.exists()
    assert out.read_bytes() == b"png" and not partial.exists()


def _write_forever(path: str, done) -> None:
    for i in range(10**6):
        write_text(path, str(i % 10) * 1_000_000)  # 1 MB of one digit: a torn file would mix two
        done.put(i)


def test_a_writer_killed_at_any_moment_leaves_a_whole_file(tmp_path):
    path = tmp_path / "state.txt"
    rng = random.Random(0)
    fork = multiprocessing.get_context("fork")
    for _ in range(5):
        done = fork.Queue()
        writer = fork.Process(target=_write_forever, args=(str(path), done))
        writer.start()
        done.get(timeout=60)
        time.sleep(rng.uniform(0.0, 0.2))
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(timeout=30)
        text = path.read_text()
        assert len(text) == 1_000_000 and len(set(text)) == 1
    # a kill between the write and the rename may leave a hidden temporary beside it, never a torn file
    assert {p.name for p in tmp_path.iterdir() if not p.name.startswith(".state.txt.")} == {"state.txt"}


def test_under_the_suite_a_checkpoint_written_from_another_thread_fails_its_save(tmp_path):
    """tests/conftest.py sets TEMPLATE_SAVE_ON_TRAINING_THREAD for every process of the suite: a save from any thread
    but the main one (the rank watchdog's, before issue 71) raises, and writes nothing."""
    import threading

    from app.checkpoints.io import TRAINING_THREAD_CHECK, SafeCheckpointIO

    assert os.environ.get(TRAINING_THREAD_CHECK) == "1"
    io, failed = SafeCheckpointIO(), []

    def save() -> None:
        try:
            io.save_checkpoint({"state_dict": {}}, tmp_path / "from_thread.ckpt")
        except RuntimeError as err:
            failed.append(str(err))

    thread = threading.Thread(target=save, name="rank-watchdog-0")
    thread.start()
    thread.join()
    assert failed and "written from thread 'rank-watchdog-0', not the one that runs training" in failed[0]
    assert not (tmp_path / "from_thread.ckpt").exists()
    io.save_checkpoint({"state_dict": {}}, tmp_path / "from_main.ckpt")  # the training thread's save
    assert (tmp_path / "from_main.ckpt").is_file()
