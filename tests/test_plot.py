"""sparsepipe_hpc.plot: a trace drawn as a timeline picture (matplotlib, the plot extra), the
clear error without matplotlib, and the command line."""

from __future__ import annotations

import json
import sys

import pytest

from sparsepipe_hpc.plot import COLORS, PlotError, _depths, main, plot_trace, require_matplotlib
from sparsepipe_hpc.tracing import Span, to_chrome_trace
from sparsepipe_hpc.train.config import ConfigError, parse_config


def trace():
    return to_chrome_trace(
        [[Span("F0", "forward", 0.0, 1.0), Span("SA0>1", "send", 1.0, 1.1),
          Span("B0", "backward", 3.0, 4.0)],
         [Span("RA0<0", "recv", 0.0, 1.2), Span("rebuild down1", "kmap", 1.1, 1.2),
          Span("F0", "forward", 1.2, 2.0), Span("B0", "backward", 2.0, 3.0)]],
        ["rank 0: stage 0", "rank 1: stage 1"])


def test_depths_nest_spans_by_containment():
    spans = [e for e in trace()["traceEvents"] if e["ph"] == "X" and e["tid"] == 1]
    assert [(e["name"], d) for e, d in _depths(spans)] == [
        ("RA0<0", 0), ("rebuild down1", 1), ("F0", 0), ("B0", 0)]


def has_color(pixels, hex_color, tol=0.02):
    import numpy as np

    rgb = np.array([int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return bool((np.abs(pixels[..., :3] - rgb).max(-1) < tol).any())


def test_plot_trace_draws_every_category_present(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    out = plot_trace(trace(), tmp_path / "t.png", title="two stages")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(out)
    for cat in ("forward", "backward", "send", "recv", "kmap", "idle"):
        assert has_color(pixels, COLORS[cat]), cat
    for cat in ("halo", "allreduce"):  # not in this trace: neither bars nor legend entries
        assert not has_color(pixels, COLORS[cat]), cat


def test_plot_of_an_empty_trace_is_an_error(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(PlotError, match="no spans to draw"):
        plot_trace(to_chrome_trace([[], []]), tmp_path / "t.png")


def test_missing_matplotlib_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    with pytest.raises(PlotError, match=r"needs matplotlib.*pip install 'sparsepipe_hpc\[plot\]'"):
        require_matplotlib()
    with pytest.raises(ConfigError, match=r"^drawing a timeline \(--plot\) needs matplotlib"):
        parse_config(["--plot", str(tmp_path / "t.png")])


def test_plot_option(tmp_path):
    pytest.importorskip("matplotlib")
    assert parse_config(["--plot", str(tmp_path / "t.png")]).plot == str(tmp_path / "t.png")
    assert parse_config([]).plot is None
    with pytest.raises(ConfigError, match=r"^--plot .* is a directory but names the picture"):
        parse_config(["--plot", str(tmp_path)])


def test_command_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    src = tmp_path / "trace.json"
    src.write_text(json.dumps(trace()))
    assert main([str(src), str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").stat().st_size > 0
    assert main([str(tmp_path / "missing.json"), str(tmp_path / "u.png")]) == 2
    assert "cannot read the trace" in capsys.readouterr().err
