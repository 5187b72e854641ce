"""checkpoint.py: atomic writes (temp file beside the target, fsync, rename), stale temp files,
permissions, checksums, finiteness and step checks on load."""

import json
import os
import stat
import struct
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from meganeura.checkpoint import FORMAT, load_checkpoint, read_checkpoint, save_checkpoint
from meganeura.dtypes import f32
from meganeura.errors import CheckpointError
from meganeura.graph import TensorType

TENSORS = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": np.float32(7.0)}
EXPECTED = {"w": TensorType((3, 4), f32), "step": TensorType((), f32)}


def _foreign(path, tensors, **meta):
    """A checkpoint written without our writer (no checksums unless given): older files, or
    files corrupted in ways our writer never produces."""
    stored = {k: np.asarray(v).reshape(np.shape(v) or (1,)) for k, v in tensors.items()}
    save_file(stored, str(path), metadata={"format": FORMAT, "fingerprint": "fp", "step": "3",
                                           "scalars": "step", **meta})
    return path


def _data_offset(path, name):
    """Absolute file offset of tensor ``name``'s first byte."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n + json.loads(raw[8:8 + n])[name]["data_offsets"][0]


def test_round_trip_with_extra_metadata(tmp_path):
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, TENSORS, "fp", 5, extra={"cli.epoch": "2"})
    tensors, step = load_checkpoint(path, EXPECTED, "fp")
    assert step == 5 and tensors["step"].shape == ()
    np.testing.assert_array_equal(tensors["w"], TENSORS["w"])
    assert read_checkpoint(path)[1]["cli.epoch"] == "2"
    with pytest.raises(CheckpointError, match="reserved"):
        save_checkpoint(path, TENSORS, "fp", 5, extra={"step": "9"})


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_tensors_are_refused_on_load_and_save(tmp_path, bad):
    w = TENSORS["w"].copy()
    w[1, 2] = bad
    path = _foreign(tmp_path / "nan.safetensors", {"w": w, "step": TENSORS["step"]})
    with pytest.raises(CheckpointError, match=r"non-finite tensors: 'w' \(1 of 12"):
        load_checkpoint(path, EXPECTED, "fp")
    good = tmp_path / "good.safetensors"
    save_checkpoint(good, TENSORS, "fp", 1)
    before = good.read_bytes()
    with pytest.raises(CheckpointError, match="refusing to save .*'w'"):
        save_checkpoint(good, {"w": w, "step": TENSORS["step"]}, "fp", 2)
    assert good.read_bytes() == before  # a diverged run keeps the last good checkpoint


def test_a_flipped_bit_in_tensor_data_is_detected(tmp_path):
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, TENSORS, "fp", 1)
    raw = bytearray(path.read_bytes())
    raw[_data_offset(path, "w") + 17] ^= 0x04  # a finite value, just a different one
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"checksum mismatch in tensors \['w'\]"):
        load_checkpoint(path, EXPECTED, "fp")


def test_checksum_table_must_cover_the_tensors_and_old_files_still_load(tmp_path):
    old = _foreign(tmp_path / "old.safetensors", TENSORS)  # written before checksums
    assert load_checkpoint(old, EXPECTED, "fp")[1] == 3
    partial = _foreign(tmp_path / "p.safetensors", TENSORS, crc32=json.dumps({"w": "0"}))
    with pytest.raises(CheckpointError, match=r"disagree on \['step'\]"):
        load_checkpoint(partial, EXPECTED, "fp")
    junk = _foreign(tmp_path / "j.safetensors", TENSORS, crc32="[not json")
    with pytest.raises(CheckpointError, match="corrupt checksum table"):
        load_checkpoint(junk, EXPECTED, "fp")


@pytest.mark.parametrize("step", ["-3", "1e9", "3.5", "99999999999999999999", "", " +4"])
def test_negative_or_absurd_steps_are_refused(tmp_path, step):
    path = _foreign(tmp_path / "s.safetensors", TENSORS, step=step)
    with pytest.raises(CheckpointError, match="bad step"):
        load_checkpoint(path, EXPECTED, "fp")


def test_saving_a_negative_step_is_refused(tmp_path):
    for step in (-1, 2**60):
        with pytest.raises(CheckpointError, match="bad step"):
            save_checkpoint(tmp_path / "s.safetensors", TENSORS, "fp", step)
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_files_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        save_checkpoint(tmp_path / "ck.safetensors", TENSORS, "fp", 1)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "ck.safetensors").st_mode) == 0o666 & ~umask


def test_write_goes_through_a_fsynced_temp_file_in_the_target_directory(tmp_path, monkeypatch):
    target = tmp_path / "sub" / "ck.safetensors"
    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    def replace(src, dst):
        assert "file" in synced  # data durable before the rename
        renamed.append((os.fspath(src), os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    save_checkpoint(target, TENSORS, "fp", 1)
    [(src, dst)] = renamed
    assert os.path.dirname(src) == str(target.parent) and dst == str(target)
    assert os.path.basename(src).startswith(".tmp-ck.safetensors-")
    assert synced == ["file", "dir"]  # the file, then the directory holding the rename
    assert os.listdir(target.parent) == ["ck.safetensors"]


def test_temp_files_of_killed_saves_are_cleaned_up_by_the_next_save(tmp_path):
    """A save SIGKILLed between write and rename leaves its temp file; the next save of the
    same target removes it, but not temp files of other targets or of live writers."""
    target = tmp_path / "ck.safetensors"
    code = ("import os, signal, numpy as np\n"
            "from meganeura.checkpoint import save_checkpoint\n"
            "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
            f"save_checkpoint({str(target)!r}, {{'w': np.ones(3, np.float32)}}, 'fp', 1)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert r.returncode == -9, r.stderr.decode()
    [orphan] = os.listdir(tmp_path)
    assert orphan.startswith(".tmp-ck.safetensors-")
    own_stale = tmp_path / f".tmp-ck.safetensors-{os.getpid()}-deadbeef"
    live = tmp_path / f".tmp-ck.safetensors-{os.getppid()}-0badf00d"
    other = tmp_path / f".tmp-other.safetensors-{os.getppid() + 10**7}-00000000"
    for p in (own_stale, live, other):
        p.write_bytes(b"x")
    save_checkpoint(target, TENSORS, "fp", 1)
    assert sorted(os.listdir(tmp_path)) == sorted(["ck.safetensors", live.name, other.name])


def test_read_metadata_without_tensors(tmp_path):
    from meganeura.checkpoint import read_metadata

    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, TENSORS, "fp", 4, extra={"cli.epoch": "1"})
    meta = read_metadata(path)
    assert meta["cli.epoch"] == "1" and meta["step"] == "4" and meta["fingerprint"] == "fp"
    with pytest.raises(CheckpointError, match="does not exist"):
        read_metadata(tmp_path / "none.safetensors")
    (tmp_path / "junk").write_bytes(b"junk" * 10)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        read_metadata(tmp_path / "junk")


def test_a_failed_write_names_the_target_and_leaves_no_temp_file(tmp_path, monkeypatch):
    """Disk full at the fsync: the error names the checkpoint (not the temp file) with the OS's
    reason and errno, the temp file is removed, and an older checkpoint stays intact."""
    import errno

    target = tmp_path / "ck.safetensors"
    save_checkpoint(target, TENSORS, "fp", 1)
    before = target.read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/somewhere/.tmp-file")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as info:
        save_checkpoint(target, {"w": np.zeros(5, np.float32)}, "fp", 2)
    assert str(info.value) == f"cannot save checkpoint {str(target)!r}: {os.strerror(28)}"
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == ["ck.safetensors"] and target.read_bytes() == before


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
def test_probing_a_live_writer_does_not_signal_it(tmp_path):
    """The stale-temp cleanup asks whether a writer is alive with signal 0, which delivers
    nothing: a live writer (here a sleeping process) survives the probe and keeps its file."""
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        live = tmp_path / f".tmp-ck.safetensors-{writer.pid}-0badf00d"
        live.write_bytes(b"x")
        save_checkpoint(tmp_path / "ck.safetensors", TENSORS, "fp", 1)
        assert writer.poll() is None and live.exists()
    finally:
        writer.kill()
        writer.wait()


def test_load_names_every_kind_of_mismatch(tmp_path):
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, TENSORS, "fp", 1)
    wrong = {"w": TensorType((4, 3), f32), "step": TensorType((), f32)}
    with pytest.raises(CheckpointError, match=r"mismatched tensors \[w: file float32\[3, 4\] "
                                              r"vs graph") as info:
        load_checkpoint(path, wrong, "fp")
    assert "missing" not in str(info.value) and "unexpected" not in str(info.value)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, {**EXPECTED, "b": TensorType((2,), f32)}, "fp")
    assert "missing tensors ['b']" in str(info.value) and "mismatched" not in str(info.value)


def test_the_largest_step_is_2_to_the_53(tmp_path):
    """Steps up to 2**53 (where a float64 counter still counts by ones) load; one more does not
    (16 digits, so the regex alone would let it through)."""
    ok = _foreign(tmp_path / "ok.safetensors", TENSORS, step=str(2**53))
    assert load_checkpoint(ok, EXPECTED, "fp")[1] == 2**53
    bad = _foreign(tmp_path / "bad.safetensors", TENSORS, step=str(2**53 + 1))
    with pytest.raises(CheckpointError, match="bad step .* to 9007199254740992"):
        load_checkpoint(bad, EXPECTED, "fp")


def test_fingerprint_mismatch_is_refused_unless_asked(tmp_path):
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, TENSORS, "fp-a", 3)
    with pytest.raises(CheckpointError, match="written by a different graph"):
        load_checkpoint(path, EXPECTED, "fp-b")
    tensors, step = load_checkpoint(path, EXPECTED, "fp-b", strict_fingerprint=False)
    assert step == 3 and tensors["w"].shape == (3, 4)


def test_a_writer_owned_by_another_user_counts_as_alive(tmp_path, monkeypatch):
    """Probing another user's process fails with EPERM (never as root, so it is simulated):
    that process exists, so its temp file is left alone."""
    other = tmp_path / ".tmp-ck.safetensors-4242-0badf00d"
    other.write_bytes(b"x")

    def kill(pid, sig):
        assert sig == 0
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", kill)
    save_checkpoint(tmp_path / "ck.safetensors", TENSORS, "fp", 1)
    assert other.exists()


def test_stored_checksums_are_the_plain_crc32_of_the_little_endian_bytes(tmp_path):
    """The checksum table is a file format: any tool (or an older or newer meganeura) must be
    able to write and check it as zlib's CRC-32 of each tensor's stored bytes, 8 hex digits.
    Big-endian input is stored little-endian and checksummed as stored."""
    import zlib

    from meganeura.checkpoint import read_metadata

    w = np.arange(4, 16, dtype=">f4").reshape(3, 4)
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, {"w": w, "step": TENSORS["step"]}, "fp", 1)
    table = json.loads(read_metadata(path)["crc32"])
    expect = {"w": zlib.crc32(w.astype("<f4").tobytes()),
              "step": zlib.crc32(np.float32(7.0).tobytes())}
    assert any(c & 1 for c in expect.values())  # a low bit to lose, were it masked away
    assert table == {k: f"{c:08x}" for k, c in expect.items()}


def test_an_absurd_step_is_quoted_cut_to_40_characters(tmp_path):
    """A corrupt step may be megabytes of junk: the message quotes its first 40 characters."""
    path = _foreign(tmp_path / "s.safetensors", TENSORS, step="12345678" * 1000)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, EXPECTED, "fp")
    assert f"bad step '{('12345678' * 5)}' (expected" in str(info.value)


def test_a_temp_name_in_use_by_another_writer_is_never_opened(tmp_path, monkeypatch):
    """Temp files are created exclusively (O_EXCL): when the random name is already taken (by
    another thread's save of the same target), the writer draws another name and leaves that
    file alone instead of writing into it and renaming it away."""
    import secrets

    import meganeura.checkpoint as ck

    base = "ck.safetensors"
    taken = tmp_path / f".tmp-{base}-{os.getpid()}-aaaaaaaa"
    taken.write_bytes(b"another writer's data")
    names = iter(["aaaaaaaa", "bbbbbbbb"])
    monkeypatch.setattr(secrets, "token_hex", lambda n: next(names))
    monkeypatch.setattr(ck, "_ACTIVE", {str(taken)})  # being written by another thread
    save_checkpoint(tmp_path / base, TENSORS, "fp", 1)
    assert taken.read_bytes() == b"another writer's data"
    assert load_checkpoint(tmp_path / base, EXPECTED, "fp")[1] == 1
    assert next(names, None) is None  # the second name was drawn


def test_a_stale_temp_name_that_cannot_be_removed_does_not_stop_a_save(tmp_path):
    """Cleaning up is best effort: a dead writer's temp name that cannot be unlinked (here a
    directory of that name) is left where it is and the save goes on."""
    stuck = tmp_path / f".tmp-ck.safetensors-{os.getppid() + 10**7}-deadbeef"
    stuck.mkdir()
    save_checkpoint(tmp_path / "ck.safetensors", TENSORS, "fp", 1)
    assert stuck.is_dir() and load_checkpoint(tmp_path / "ck.safetensors", EXPECTED, "fp")


def test_extra_metadata_values_must_be_strings_too(tmp_path):
    with pytest.raises(CheckpointError, match="must map str to str"):
        save_checkpoint(tmp_path / "ck.safetensors", TENSORS, "fp", 1, extra={"cli.epoch": 2})
    assert not os.listdir(tmp_path)


def test_temp_names_carry_the_pid_and_32_random_bits(tmp_path, monkeypatch):
    """``.tmp-<target>-<pid>-<8 hex digits>``: what the stale-temp cleanup of every version
    parses, and 32 random bits keep concurrent saves of one process apart."""
    import re

    seen, real_replace = [], os.replace
    monkeypatch.setattr(os, "replace", lambda s, d: (seen.append(os.path.basename(s)),
                                                     real_replace(s, d)))
    save_checkpoint(tmp_path / "ck.safetensors", TENSORS, "fp", 1)
    [name] = seen
    assert re.fullmatch(rf"\.tmp-ck\.safetensors-{os.getpid()}-[0-9a-f]{{8}}", name), name


@pytest.mark.parametrize("refuses", ["open", "fsync", "listdir"])
def test_a_directory_that_cannot_be_synced_or_listed_does_not_fail_the_save(tmp_path, monkeypatch,
                                                                           refuses):
    """Syncing the directory and sweeping stale temp files are best effort (some systems cannot
    open or fsync a directory; a directory may be writable but not readable): the file itself
    is durable, so the save succeeds."""
    real = {"open": os.open, "fsync": os.fsync}

    def fail(*a):
        raise PermissionError(13, "Permission denied")

    def no_dirs(path, flags, *a):
        return fail() if os.path.isdir(path) else real["open"](path, flags, *a)

    def no_dir_fsync(fd):
        return fail() if stat.S_ISDIR(os.fstat(fd).st_mode) else real["fsync"](fd)

    monkeypatch.setattr(os, refuses, {"open": no_dirs, "fsync": no_dir_fsync,
                                      "listdir": fail}[refuses])
    save_checkpoint(tmp_path / "ck.safetensors", TENSORS, "fp", 1)
    monkeypatch.undo()
    assert load_checkpoint(tmp_path / "ck.safetensors", EXPECTED, "fp")[1] == 1
    assert os.listdir(tmp_path) == ["ck.safetensors"]


def test_a_truncated_file_is_reported_as_corrupt(tmp_path):
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, TENSORS, "fp", 1)
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(CheckpointError, match="is corrupt or truncated"):
        read_checkpoint(path)


def test_a_scalars_list_naming_other_tensors_changes_nothing(tmp_path):
    """Only listed tensors of one element become rank 0; a wrong list (a missing name, a
    matrix) leaves the tensors as stored, for the shape check to judge."""
    path = _foreign(tmp_path / "s.safetensors", TENSORS, scalars="step,w,gone")
    tensors, _ = read_checkpoint(path)
    assert tensors["step"].shape == () and tensors["w"].shape == (3, 4)


def test_on_windows_other_writers_are_never_signalled(tmp_path, monkeypatch):
    """On Windows ``os.kill(pid, 0)`` would terminate the process: the cleanup does not probe
    there, it tries to unlink (which the OS refuses for a file still open)."""
    import meganeura.checkpoint as ck

    other = tmp_path / f".tmp-ck.safetensors-{os.getppid()}-0badf00d"
    other.write_bytes(b"x")

    class WindowsOs:  # the checkpoint module's view of ``os`` only (pytest keeps the real one)
        name = "nt"

        def __getattr__(self, attr):
            return getattr(os, attr)

        @staticmethod
        def kill(pid, sig):
            raise AssertionError(f"os.kill({pid}, {sig}) on Windows")

    monkeypatch.setattr(ck, "os", WindowsOs())
    save_checkpoint(tmp_path / "ck.safetensors", TENSORS, "fp", 1)
    assert not other.exists()  # unlinkable here: the writer was not holding it open


def test_the_stale_temp_sweep_looks_past_other_files(tmp_path, monkeypatch):
    """Unrelated files and live writers' temps listed first do not end the sweep."""
    stale = tmp_path / f".tmp-ck.safetensors-{os.getppid() + 10**7}-deadbeef"
    live = tmp_path / f".tmp-ck.safetensors-{os.getppid()}-0badf00d"
    for p in (stale, live, tmp_path / "notes.txt"):
        p.write_bytes(b"x")
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda d: sorted(real(d), key=lambda n: n == stale.name))
    save_checkpoint(tmp_path / "ck.safetensors", TENSORS, "fp", 1)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == sorted(["ck.safetensors", live.name, "notes.txt"])
