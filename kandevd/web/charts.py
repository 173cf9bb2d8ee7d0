"""Pictures drawn on the server: line charts, a timeline of fires, spend bars.

The marks are plain SVG stretched to the width of their box
(``preserveAspectRatio="none"``, strokes that do not scale); every text
(titles, axis ticks and units, legends) is HTML beside the SVG, so it keeps
the page's font size from a phone to a wide screen. Classes colour them
(light and dark alike); every text is escaped. No script, no inline style,
no other origin.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

#: The plot's own coordinates (the SVG is stretched to its box).
PLOT_W, PLOT_H = 1000, 100


@dataclass(frozen=True)
class Series:
    label: str
    css: str  # the class that colours it: ok, bad, info
    values: Sequence[int]
    #: What the legend says beside the label (None: the sum over the span).
    legend: str | None = None


def count_ticks(peak: float, most: int = 4) -> list[int]:
    """Whole-number ticks from 0 up to at least ``peak`` (counts have no halves):
    a step of 1, 2 or 5 times a power of ten, at most ``most`` steps."""
    peak = max(1.0, float(peak))
    magnitude = 1
    while True:
        for factor in (1, 2, 5):
            step = factor * magnitude
            if math.ceil(peak / step) <= most:
                top = math.ceil(peak / step) * step
                return list(range(0, top + 1, step))
        magnitude *= 10


def _short(value: int) -> str:
    if value >= 10_000:
        return f"{value / 1000:.0f}k"
    if value >= 1000:
        return f"{value / 1000:.1f}k".replace(".0k", "k")
    return str(value)


def line_chart(title: str, series: list[Series], *, unit: str, span_label: str = "last 24 h",
               hours: int = 24) -> Markup:
    """Per-minute series over the same span, newest at the right; ``unit`` names the
    vertical axis ("runs per minute")."""
    count = max((len(s.values) for s in series), default=0)
    ticks = count_ticks(max([0, *(max(s.values, default=0) for s in series)]))
    top = ticks[-1]
    marks = [Markup('<svg class="chart" viewBox="0 0 {w} {h}" preserveAspectRatio="none" '
                    'role="img" aria-label="{t}, {u}"><title>{t}</title>').format(
        w=PLOT_W, h=PLOT_H, t=title, u=unit)]
    for tick in ticks:
        y = PLOT_H * (1 - tick / top)
        marks.append(Markup('<line class="grid" x1="0" x2="{w}" y1="{y:.2f}" y2="{y:.2f}"/>'
                            ).format(w=PLOT_W, y=y))
    for s in series:
        if count < 2:
            continue
        points = " ".join(
            f"{PLOT_W * i / (count - 1):.2f},{PLOT_H * (1 - v / top):.2f}"
            for i, v in enumerate(s.values))
        marks.append(Markup('<polyline class="line {c}" points="{p}"><title>{l}</title>'
                            '</polyline>').format(c=s.css, p=points, l=s.label))
    marks.append(Markup("</svg>"))
    y_ticks = Markup("").join(Markup("<span>{}</span>").format(_short(t))
                              for t in reversed(ticks))
    step = 6 if hours % 6 == 0 else max(1, hours // 4)
    x_ticks = Markup("").join(
        Markup("<span>{}</span>").format("now" if h == 0 else f"\u2212{h} h")
        for h in range(hours, -1, -step))
    legend = Markup("").join(
        Markup('<span class="legend {c}"><span class="key"></span>{l}: {n}</span>').format(
            c=s.css, l=s.label, n=s.legend if s.legend is not None else sum(s.values))
        for s in series)
    return Markup(
        '<figure class="chart-box"><figcaption>{t} <small>({span})</small>'
        '<span class="legends">{legend}</span></figcaption>'
        '<div class="plot"><span class="unit y-unit">{u}</span>'
        '<div class="y-ticks" aria-hidden="true">{yt}</div>{svg}'
        '<div class="x-ticks" aria-hidden="true">{xt}</div>'
        '<span class="unit x-unit">hours before now</span></div></figure>').format(
        t=title, span=span_label, legend=legend, u=unit, yt=y_ticks,
        svg=Markup("").join(marks), xt=x_ticks)


@dataclass(frozen=True)
class Lane:
    label: str
    href: str
    #: Fire times as fractions of the span (0 = now, 1 = its end).
    fires: Sequence[float]
    #: Fires too many to draw one by one: a band from the first, "more than N fires".
    dense: int = 0


def timeline(lanes: list[Lane], *, hours: int = 24) -> Markup:
    """The next fires of each job over the coming ``hours``, one lane per job: its name
    (a link), its fires as dots, and a count where they are too many to draw."""
    grid = Markup("").join(
        Markup('<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="0" y2="10"/>').format(
            x=PLOT_W * step / hours) for step in range(0, hours + 1, 3))
    rows = []
    for lane in lanes:
        marks = [grid]
        note = Markup("")
        if lane.dense and lane.fires:
            marks.append(Markup('<line class="band" x1="{x:.1f}" x2="{w}" y1="5" y2="5">'
                                '<title>more than {n} fires</title></line>').format(
                x=PLOT_W * lane.fires[0], w=PLOT_W, n=lane.dense))
            note = Markup('<span class="count" title="more than {n} fires">{n}+</span>'
                          ).format(n=lane.dense)
        else:
            marks.extend(Markup('<line class="fire" x1="{x:.1f}" x2="{x:.1f}" y1="5" '
                                'y2="5.01"/>').format(x=PLOT_W * f) for f in lane.fires)
        rows.append(Markup(
            '<a class="lane" href="{h}" title="{full}">{l}</a>'
            '<svg class="lane" viewBox="0 0 {w} 10" preserveAspectRatio="none" role="img" '
            'aria-label="{n} fire(s) of {full}">{m}</svg><span class="lane-note">{note}</span>'
        ).format(h=lane.href, full=lane.label, n=lane.dense or len(lane.fires),
                 l=lane.label if len(lane.label) <= 40 else lane.label[:39] + "…",
                 w=PLOT_W, m=Markup("").join(marks), note=note))
    ticks = Markup("").join(Markup("<span>{}</span>").format("now" if s == 0 else f"+{s} h")
                            for s in range(0, hours + 1, 3))
    return Markup('<div class="timeline">{rows}<span></span>'
                  '<div class="x-ticks" aria-hidden="true">{t}</div><span></span>'
                  '<span></span><span class="unit x-unit">hours from now</span><span></span>'
                  '</div>').format(rows=Markup("").join(rows), t=ticks)


def spend_bar(spent_cents: float, limit_cents: float, alert_pct: float | None) -> Markup:
    """Spend against a budget's limit as a bar with its percentage written beside it; the
    alert threshold is a mark on the bar, named in words next to the percentage."""
    ratio = 0.0 if limit_cents <= 0 else spent_cents / limit_cents
    width = 240
    filled = min(1.0, ratio) * width
    css = "bad" if ratio >= 1 else "warn" if alert_pct and ratio * 100 >= alert_pct else "ok"
    marker = Markup("")
    threshold = Markup("")
    if alert_pct:
        x = min(1.0, alert_pct / 100) * width
        marker = Markup('<line class="threshold" x1="{x:.1f}" x2="{x:.1f}" y1="0" y2="14">'
                        '<title>alert at {p:g}%</title></line>').format(x=x, p=alert_pct)
        threshold = Markup(' <small class="muted"><span class="threshold-key"></span>'
                           'alert at {p:g}%</small>').format(p=alert_pct)
    return Markup('<span class="spend"><svg class="bar" viewBox="0 0 {w} 14" role="img" '
                  'aria-label="{p:.0f}% of the limit"><rect class="track" width="{w}" '
                  'height="14" rx="3"/><rect class="fill {c}" width="{f:.1f}" height="14" '
                  'rx="3"/>{m}</svg> <span class="pct {c}">{p:.0f}%</span>{t}</span>').format(
        w=width, p=ratio * 100, c=css, f=filled, m=marker, t=threshold)


__all__ = ["Lane", "Series", "count_ticks", "escape", "line_chart", "spend_bar", "timeline"]
