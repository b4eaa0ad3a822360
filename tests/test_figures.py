"""A figure that cannot be drawn never fails a run (ssl_vit/figures.py): one warning, no file."""

from __future__ import annotations

import json
import logging
import sys

import matplotlib.figure

from ssl_vit.engine.trainer import write_loss_plot
from ssl_vit.figures import optional_figure


def _metrics(tmp_path):
    rows = [{"step": s, "train/loss": 1.0 / s, "train/acc": s / 10} for s in (1, 2, 3)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_loss_plot_is_drawn(tmp_path):
    out = optional_figure("loss plot", write_loss_plot, _metrics(tmp_path), tmp_path / "l.png")
    assert out == tmp_path / "l.png" and out.read_bytes().startswith(b"\x89PNG")


def test_without_matplotlib_one_warning_and_no_file(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    with caplog.at_level(logging.WARNING, logger="ssl_vit.figures"):
        got = optional_figure("loss plot", write_loss_plot, _metrics(tmp_path), tmp_path / "l.png")
    assert got is None and list(tmp_path.glob("*.png")) == []
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("loss plot not drawn (ModuleNotFoundError: ") and "goes on" in line


def test_a_save_that_raises_leaves_no_half_written_file(tmp_path, monkeypatch, caplog):
    def full_disk(self, fname, **kw):
        open(fname, "wb").write(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    with caplog.at_level(logging.WARNING, logger="ssl_vit.figures"):
        got = optional_figure("loss plot", write_loss_plot, _metrics(tmp_path), tmp_path / "l.png")
    assert got is None and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    assert "No space left on device" in caplog.records[-1].getMessage()
