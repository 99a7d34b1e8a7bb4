"""benchmarks/chart.py: the PNG it writes decodes, and the bars are where and how tall they should be."""

import importlib.util
from pathlib import Path

import pytest

# benchmarks/ is not an installed package: load the module from its file
_spec = importlib.util.spec_from_file_location(
    "benchmarks_chart", Path(__file__).resolve().parents[1] / "benchmarks" / "chart.py")
chart = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chart)

GROUPS = ["tiny", "1.1B", "7B"]
SERIES = {  # maxima 100 > 80 > 50; "pytorch" has no result for 1.1B
    "protrain-core": [40.0, 100.0, 60.0],
    "pytorch": [20.0, None, 80.0],
    "fsdp2-offload": [50.0, 30.0, 10.0],
}


def _pixels(rows, colour):
    """(row, column) of every pixel of the given RGB colour."""
    c = bytes(colour)
    return [(y, x // 3) for y, row in enumerate(rows) for x in range(0, len(row), 3)
            if row[x:x + 3] == c]


def _tallest_run(rows, colour):
    """(top row, height) of the colour's vertical run that starts highest in the image."""
    y, x = min(_pixels(rows, colour))
    c, h = bytes(colour), 0
    while y + h < len(rows) and rows[y + h][3 * x:3 * x + 3] == c:
        h += 1
    return y, h


@pytest.fixture(scope="module")
def png(tmp_path_factory):
    path = tmp_path_factory.mktemp("chart") / "chart.png"
    chart.bar_chart(path, title="Throughput (tokens/s)", groups=GROUPS, series=SERIES,
                    ylabel="tokens/s", width=600, height=400)
    return path


def test_png_file(png):
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    w, h, rows = chart.read_png(png)
    assert (w, h) == (600, 400) and len(rows) == 400 and all(len(r) == 3 * 600 for r in rows)
    assert not [p for p in png.parent.iterdir() if p != png]  # no temporary file left behind


def test_every_series_colour_is_drawn(png):
    _, _, rows = chart.read_png(png)
    for i in range(len(SERIES)):
        assert len(_pixels(rows, chart.PALETTE[i])) > 200, f"series {i} is missing"
    assert not _pixels(rows, chart.PALETTE[len(SERIES)])  # a colour no series uses


def test_bar_heights_follow_the_values(png):
    _, _, rows = chart.read_png(png)
    (top_a, h_a), (top_b, h_b), (top_c, h_c) = (_tallest_run(rows, chart.PALETTE[i])
                                                for i in range(3))
    assert top_a < top_b < top_c  # tallest bar (100) reaches highest, then 80, then 50
    assert h_a > 100
    assert h_b / h_a == pytest.approx(0.8, abs=0.03)
    assert h_c / h_a == pytest.approx(0.5, abs=0.03)
    assert top_a + h_a == top_b + h_b == top_c + h_c  # all bars stand on the same axis


def test_bad_input(tmp_path):
    kw = dict(title="t", ylabel="y")
    with pytest.raises(ValueError, match="2 values for 3 groups"):
        chart.bar_chart(tmp_path / "a.png", groups=GROUPS, series={"s": [1.0, 2.0]}, **kw)
    with pytest.raises(ValueError, match="finite numbers >= 0"):
        chart.bar_chart(tmp_path / "b.png", groups=GROUPS, series={"s": [1.0, -2.0, 3.0]}, **kw)
    with pytest.raises(ValueError, match="empty"):
        chart.bar_chart(tmp_path / "c.png", groups=[], series={}, **kw)
    with pytest.raises(ValueError, match="empty"):
        chart.bar_chart(tmp_path / "d.png", groups=GROUPS, series={}, **kw)
    assert not list(tmp_path.iterdir())  # nothing written
