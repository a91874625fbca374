"""An ``out_dir`` that can no longer be written when the event comes (its disk full, a file put
in its place after the recorder checked it): the bundle goes to a new private temporary
directory, the error says where and why, and the bundle replays to the planted bug. Only when
that fails too is the bundle lost, and the error says so in one line."""

from __future__ import annotations

import errno
import stat
from pathlib import Path

import pytest
import torch
from torch import nn

import recorder.bundle as bundle_mod
from recorder import FlightRecorder, NonFiniteError
from replay import replay

HERE = Path(__file__).parent
PAD, BAD_STEP, BAD_ROW = 0, 4, 3


class MeanPoolClassifier(nn.Module):
    """Bag of embeddings averaged over the real tokens: 0/0 for a sequence that is all padding."""

    def __init__(self, vocab: int = 60, dim: int = 16, n_classes: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.proj = nn.Sequential(nn.Linear(dim, dim), nn.GELU())
        self.head = nn.Linear(dim, n_classes)

    def forward(self, tokens):
        mask = (tokens != PAD).float().unsqueeze(-1)
        h = self.proj(self.embed(tokens))
        return self.head((h * mask).sum(1) / mask.sum(1))  # BUG: no guard for an empty row


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return MeanPoolClassifier()


def loader(steps: int):
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        lens = torch.randint(2, 10, (8,), generator=g)
        tokens = torch.randint(1, 60, (8, 10), generator=g)
        tokens[torch.arange(10)[None] >= lens[:, None]] = PAD
        if step == BAD_STEP:
            tokens[BAD_ROW] = PAD  # a blank record
        yield tokens, torch.randint(0, 3, (8,), generator=g)


def train(out_dir: Path, break_out_dir, on_event: str = "raise") -> FlightRecorder:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, on_event=on_event,
                        factory="test_out_dir_at_event:make_model") as rec:
        for step, (x, y) in enumerate(loader(8)):
            if step == BAD_STEP:
                break_out_dir()
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
    return rec


@pytest.fixture
def temp_root(tmp_path, monkeypatch) -> Path:
    """The system's temporary directory, here a fresh one of the test's, on a file system of
    its own as far as the recorder can tell (a full out_dir's disk is not the temporary
    directory's: on the same one, the bundle is not written again there)."""
    root = tmp_path / "system-tmp"
    root.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(root))
    monkeypatch.setattr("recorder.partial_writes.same_file_system", lambda a, b: False)
    return root


def file_in_place_of(out_dir: Path):
    def swap():
        for f in out_dir.iterdir():
            f.unlink()
        out_dir.rmdir()
        out_dir.write_text("now a file")
    return swap


def check_replays_to_the_bug(path: Path, monkeypatch) -> None:
    monkeypatch.chdir(HERE)
    report = replay(path)
    assert report["reproduced"] is True
    assert report["event"]["step"] == BAD_STEP
    origin = report["origin"]
    assert (origin["phase"], origin["module"], origin["op"]) == ("forward", "", "aten.div")
    assert origin["samples"] == [BAD_ROW] and report["cause"] == "invalid"


def test_a_file_in_place_of_out_dir_sends_the_bundle_to_a_temporary_directory(
        tmp_path, temp_root, monkeypatch):
    out_dir = tmp_path / "nan-bundles"
    with pytest.raises(NonFiniteError) as info:
        train(out_dir, file_in_place_of(out_dir))
    err = info.value
    assert out_dir.read_text() == "now a file"  # what the user put there is left alone
    path = Path(err.bundle_path)
    assert path.parent.parent == temp_root and path.name == f"step{BAD_STEP:08d}-rank0.nan"
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700  # it holds the batch
    assert isinstance(err.write_error, OSError)
    msg = str(err)
    assert "\n" not in msg and f"Bundle: {path};" in msg
    assert f"out_dir '{out_dir}' could not be written ('{out_dir}' is a file, not a directory)" \
        in msg
    assert "give the recorder an out_dir it can write" in msg
    check_replays_to_the_bug(path, monkeypatch)


def test_a_full_out_dir_in_warn_mode_logs_where_the_bundle_went(
        tmp_path, temp_root, monkeypatch, caplog):
    out_dir = tmp_path / "nan-bundles"
    real = bundle_mod.write_bundle

    def full_disk():
        def write(d, *args, **kwargs):
            if Path(d) == out_dir:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(d, *args, **kwargs)
        monkeypatch.setattr(bundle_mod, "write_bundle", write)

    with caplog.at_level("WARNING", logger="nanreplay"):
        rec = train(out_dir, full_disk, on_event="warn")
    assert rec.bundle_path.parent.parent == temp_root
    msgs = [r.getMessage() for r in caplog.records if r.name == "nanreplay"]
    assert len(msgs) == 1 and "(No space left on device), so the bundle went to" in msgs[0]
    assert list(out_dir.iterdir()) == []
    check_replays_to_the_bug(rec.bundle_path, monkeypatch)


def test_when_the_temporary_directory_fails_too_the_error_says_so(
        tmp_path, temp_root, monkeypatch):
    out_dir = tmp_path / "nan-bundles"

    def full_disks():
        def write(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(bundle_mod, "write_bundle", write)

    with pytest.raises(NonFiniteError) as info:
        train(out_dir, full_disks)
    err = info.value
    assert err.bundle_path is None and err.write_error.errno == errno.ENOSPC
    msg = str(err)
    assert "\n" not in msg and f"step {BAD_STEP}" in msg
    assert msg.endswith(f"Writing the bundle failed: No space left on device (in out_dir "
                        f"'{out_dir}' and in a new temporary directory); free space (or "
                        "raise the quota), or give the recorder an out_dir with room.")
    assert list(temp_root.iterdir()) == []  # no empty directory left behind
