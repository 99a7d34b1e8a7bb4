"""Grouped bar charts as PNG files, with nothing but the Python standard library.

``bar_chart`` draws one group of bars per entry of ``groups`` (e.g. model sizes) and one bar per
series (e.g. training systems) in each group, on a y axis from 0 to a rounded maximum with 4-6
labelled ticks and light grid lines. The value is printed above each bar (3 significant digits,
k/M/G suffixes; left out where bars are too narrow for it); a missing value (``None``: out of
memory, skipped) is a short hatched stub labelled "x". The title is at the top, the y label at
the top left of the axis, the group labels under the groups and the legend (colour -> series
name) at the bottom. Text uses an embedded 5x7 bitmap font (ASCII 32..126). ``read_png`` reads
back what ``bar_chart`` writes (for the tests).
"""

from __future__ import annotations

import math
import os
import struct
import tempfile
import zlib

# 5x8 glyphs for ASCII 32..126, 5 columns each (2 hex digits per column, bit 0 = top row,
# bit 7 = descender row).
_FONT = bytes.fromhex(
    "0000000000" "00005f0000" "0007000700" "147f147f14" "242a7f2a12" "2313086462" "3649552250"
    "0005030000" "001c224100" "0041221c00" "082a1c2a08" "08083e0808" "0050300000" "0808080808"
    "0060600000" "2010080402" "3e5149453e" "00427f4000" "4261514946" "2141454b31" "1814127f10"
    "2745454539" "3c4a494930" "0171090503" "3649494936" "064949291e" "0036360000" "0056360000"
    "0008142241" "1414141414" "4122140800" "0201510906" "324979413e" "7e1111117e" "7f49494936"
    "3e41414122" "7f4141221c" "7f49494941" "7f09090101" "3e41415132" "7f0808087f" "00417f4100"
    "2040413f01" "7f08142241" "7f40404040" "7f0204027f" "7f0408107f" "3e4141413e" "7f09090906"
    "3e4151215e" "7f09192946" "4649494931" "01017f0101" "3f4040403f" "1f2040201f" "7f2018207f"
    "6314081463" "0304780403" "6151494543" "007f414100" "0204081020" "0041417f00" "0402010204"
    "4040404040" "0001020400" "2054545478" "7f48444438" "3844444420" "384444487f" "3854545418"
    "087e090102" "18a4a4a47c" "7f08040478" "00447d4000" "4080847d00" "007f102844" "00417f4000"
    "7c04180478" "7c08040478" "3844444438" "fc24242418" "18242418fc" "7c08040408" "4854545420"
    "043f444020" "3c4040207c" "1c2040201c" "3c4030403c" "4428102844" "1ca0a0a07c" "4464544c44"
    "0008364100" "00007f0000" "0041360800" "0804081008"
)
PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40),
           (148, 103, 189), (140, 86, 75), (227, 119, 194), (23, 190, 207)]
_BG, _TEXT, _AXIS, _GRID = (255, 255, 255), (30, 30, 30), (90, 90, 90), (222, 222, 222)


def _fmt(v: float) -> str:
    """Compact number: 3 significant digits, k/M/G suffixes (1234 -> '1.23k')."""
    if v == 0:
        return "0"
    v = float(f"{v:.3g}")
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.3g}{suffix}"
    return f"{v:.3g}"


def _nice_axis(vmax: float) -> tuple[float, int]:
    """(step, n) with n * step >= vmax and 3 <= n <= 5, step in {1, 2, 2.5, 5} * 10^k."""
    vmax = vmax if vmax > 0 else 1.0
    k = math.floor(math.log10(vmax / 5))
    for e in (k - 1, k, k + 1):
        for m in (1, 2, 2.5, 5):
            step = m * 10.0**e
            n = math.ceil(vmax / step - 1e-9)
            if n <= 5:
                return step, max(n, 3)
    raise AssertionError("unreachable")


class _Canvas:
    def __init__(self, w: int, h: int):
        self.w, self.h = w, h
        self.buf = bytearray(bytes(_BG) * (w * h))

    def rect(self, x0: int, y0: int, x1: int, y1: int, c) -> None:
        """Fill [x0, x1) x [y0, y1), clipped."""
        x0, x1 = max(0, x0), min(self.w, x1)
        if x1 <= x0:
            return
        row = bytes(c) * (x1 - x0)
        for y in range(max(0, y0), min(self.h, y1)):
            i = 3 * (y * self.w + x0)
            self.buf[i:i + len(row)] = row

    def text(self, x: int, y: int, s: str, c, scale: int = 1) -> None:
        for ch in s:
            o = ord(ch) - 32 if 32 <= ord(ch) <= 126 else 31  # unknown -> '?'
            for col in range(5):
                bits = _FONT[5 * o + col]
                for row in range(8):
                    if bits >> row & 1:
                        self.rect(x + col * scale, y + row * scale,
                                  x + (col + 1) * scale, y + (row + 1) * scale, c)
            x += 6 * scale


def _tw(s: str, scale: int = 1) -> int:
    return (6 * len(s) - 1) * scale if s else 0


def bar_chart(path, *, title: str, groups: list[str], series: dict[str, list[float | None]],
              ylabel: str, width: int = 900, height: int = 500) -> None:
    """Write a grouped bar chart to the PNG file ``path`` (see the module docstring).

    ``series[name][i]`` is the value of series ``name`` in group ``groups[i]``; ``None`` means
    no result and is drawn as a hatched stub labelled "x". Raises ValueError on bad input."""
    if not groups:
        raise ValueError("bar_chart: `groups` is empty")
    if not series:
        raise ValueError("bar_chart: `series` is empty")
    for name, vals in series.items():
        if len(vals) != len(groups):
            raise ValueError(f"bar_chart: series {name!r} has {len(vals)} values for "
                             f"{len(groups)} groups")
        for v in vals:
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not math.isfinite(v) or v < 0):
                raise ValueError(f"bar_chart: series {name!r} has value {v!r}; values must be "
                                 "finite numbers >= 0 or None")
    if width < 300 or height < 200:
        raise ValueError(f"bar_chart: {width}x{height} is too small (at least 300x200)")

    vmax = max((v for vals in series.values() for v in vals if v is not None), default=0.0)
    step, nticks = _nice_axis(vmax)
    top = step * nticks
    cv, m = _Canvas(width, height), 16

    # legend rows at the bottom: swatch, name, gap; wrapped to the width
    names = list(series)
    rows, cur, cur_w = [], [], 0
    for i, name in enumerate(names):
        w = 14 + _tw(name) + 18
        if cur and cur_w + w > width - 2 * m:
            rows.append((cur, cur_w))
            cur, cur_w = [], 0
        cur.append(i)
        cur_w += w
    rows.append((cur, cur_w))

    tick_labels = [_fmt(step * t) for t in range(nticks + 1)]
    left = m + max(_tw(s) for s in tick_labels) + 8
    right = width - m
    y_title = m // 2 + 2
    y_ylabel = y_title + 16 + 10
    plot_top = y_ylabel + 8 + 20  # headroom for the value label over the tallest bar
    legend_top = height - m - 16 * len(rows) + 4
    base = legend_top - 30  # y of the x axis; group labels below it
    if base - plot_top < 40 or right - left < 40:
        raise ValueError(f"bar_chart: {width}x{height} is too small for this chart")
    scale_px = (base - plot_top) / top

    cv.text((width - _tw(title, 2)) // 2, y_title, title, _TEXT, 2)
    cv.text(m, y_ylabel, ylabel, _TEXT)
    for t, label in enumerate(tick_labels):
        y = base - round(step * t * scale_px)
        cv.rect(left, y, right, y + 1, _GRID if t else _AXIS)
        cv.rect(left - 4, y, left, y + 1, _AXIS)
        cv.text(left - 6 - _tw(label), y - 3, label, _TEXT)
    cv.rect(left, plot_top - 8, left + 1, base + 1, _AXIS)

    gw = (right - left) / len(groups)
    bw = max(1, min(120, int(gw * 0.8 / len(names))))
    for g, gname in enumerate(groups):
        gx = left + gw * g + (gw - bw * len(names)) / 2
        for i, name in enumerate(names):
            c, v = PALETTE[i % len(PALETTE)], series[name][g]
            x0 = round(gx + i * bw)
            x1 = x0 + max(1, bw - 2)
            if v is None:  # hatched stub: outline plus diagonal lines
                y0 = base - 8
                cv.rect(x0, y0, x1, base, c)
                for y in range(y0 + 1, base - 1):
                    for x in range(x0 + 1, x1 - 1):
                        if (x + y) % 4 >= 2:
                            cv.rect(x, y, x + 1, y + 1, _BG)
                label = "x"
            else:
                y0 = base - round(v * scale_px)
                cv.rect(x0, y0, x1, base, c)
                label = _fmt(v)
            if _tw(label) <= bw + 2:  # values of bars too narrow for them would overlap
                cv.text((x0 + x1) // 2 - _tw(label) // 2, y0 - 11, label, _TEXT)
        label = gname[: max(1, int(gw) // 6)]
        cv.text(round(left + gw * (g + 0.5)) - _tw(label) // 2, base + 8, label, _TEXT)

    for r, (idx, row_w) in enumerate(rows):
        x, y = (width - row_w + 18) // 2, legend_top + 16 * r
        for i in idx:
            cv.rect(x, y - 2, x + 10, y + 8, PALETTE[i % len(PALETTE)])
            cv.text(x + 14, y, names[i], _TEXT)
            x += 14 + _tw(names[i]) + 18
    _write_png(path, width, height, cv.buf)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _write_png(path, w: int, h: int, rgb: bytearray) -> None:
    stride = 3 * w
    raw = b"".join(b"\x00" + bytes(rgb[y * stride:(y + 1) * stride]) for y in range(h))
    data = (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b""))
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=".chart-", suffix=".png",
                               dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_png(path) -> tuple[int, int, list[bytes]]:
    """(width, height, RGB rows) of an 8-bit RGB PNG whose scanlines all use filter type 0."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG file")
    pos, idat, w = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0] != zlib.crc32(kind + body):
            raise ValueError(f"{path}: bad CRC in {kind!r} chunk")
        if kind == b"IHDR":
            w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
            if (depth, ctype) != (8, 2):
                raise ValueError(f"{path}: only 8-bit RGB is supported")
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
        pos += 12 + n
    if w is None:
        raise ValueError(f"{path}: no IHDR chunk")
    raw, stride = zlib.decompress(idat), 3 * w + 1
    if len(raw) != stride * h:
        raise ValueError(f"{path}: image data has {len(raw)} bytes, expected {stride * h}")
    if any(raw[y * stride] != 0 for y in range(h)):
        raise ValueError(f"{path}: only filter type 0 is supported")
    return w, h, [raw[y * stride + 1:(y + 1) * stride] for y in range(h)]
