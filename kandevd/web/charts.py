"""SVG pictures drawn on the server: line charts, a timeline of fires, spend bars.

Plain SVG with classes the stylesheet colours (light and dark alike); every
text in it is escaped. No script, no other origin.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

WIDTH, HEIGHT, LEFT, BOTTOM, TOP = 720, 160, 40, 20, 10


@dataclass(frozen=True)
class Series:
    label: str
    css: str  # the class that colours it: ok, bad, info
    values: Sequence[int]


def line_chart(title: str, series: list[Series], *, span_label: str = "24 h") -> Markup:
    """One or more per-minute series over the same span, newest at the right."""
    count = max((len(s.values) for s in series), default=0)
    peak = max([1, *(max(s.values, default=0) for s in series)])
    plot_w, plot_h = WIDTH - LEFT - 10, HEIGHT - BOTTOM - TOP
    parts = [Markup('<svg class="chart" viewBox="0 0 {w} {h}" role="img" aria-label="{t}">'
                    '<title>{t}</title>').format(w=WIDTH, h=HEIGHT, t=title)]
    for fraction in (0, 0.5, 1):
        y = TOP + plot_h * (1 - fraction)
        parts.append(Markup('<line class="grid" x1="{x1}" x2="{x2}" y1="{y:.1f}" y2="{y:.1f}"/>'
                            '<text class="axis" x="{tx}" y="{ty:.1f}">{v}</text>').format(
            x1=LEFT, x2=LEFT + plot_w, y=y, tx=LEFT - 4, ty=y + 4,
            v=_short(peak * fraction)))
    for hours_ago in range(24, -1, -6):
        x = LEFT + plot_w * (1 - hours_ago / 24)
        label = "now" if hours_ago == 0 else f"-{hours_ago}h"
        parts.append(Markup('<text class="axis tick" x="{x:.1f}" y="{y}">{l}</text>').format(
            x=x, y=HEIGHT - 4, l=label))
    for s in series:
        if count < 2:
            continue
        points = " ".join(
            f"{LEFT + plot_w * i / (count - 1):.1f},{TOP + plot_h * (1 - v / peak):.1f}"
            for i, v in enumerate(s.values))
        parts.append(Markup('<polyline class="line {c}" points="{p}"><title>{l}</title>'
                            '</polyline>').format(c=s.css, p=points, l=s.label))
    parts.append(Markup("</svg>"))
    legend = Markup("").join(
        Markup('<span class="legend {c}">{l}: {n}</span>').format(
            c=s.css, l=s.label, n=sum(s.values)) for s in series)
    return Markup('<figure class="chart-box"><figcaption>{t} <small>({span})</small> '
                  '{legend}</figcaption>{svg}</figure>').format(
        t=title, span=span_label, legend=legend, svg=Markup("").join(parts))


def _short(value: float) -> str:
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"


@dataclass(frozen=True)
class Lane:
    label: str
    href: str
    #: Fire times as fractions of the span (0 = now, 1 = its end).
    fires: Sequence[float]
    #: Fires too many to draw one by one: a band from the first, "more than N fires".
    dense: int = 0


def timeline(lanes: list[Lane], *, hours: int = 24) -> Markup:
    """The next fires of each job over the coming ``hours``, one lane per job."""
    lane_h, label_w = 22, 230
    plot_w = WIDTH + 180 - label_w - 60
    height = TOP + lane_h * max(1, len(lanes)) + BOTTOM
    parts = [Markup('<svg class="chart timeline" viewBox="0 0 {w} {h}" role="img" '
                    'aria-label="next fires">').format(w=WIDTH + 180, h=height)]
    for step in range(0, hours + 1, 3):
        x = label_w + plot_w * step / hours
        parts.append(Markup('<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{t}" y2="{b}"/>'
                            '<text class="axis tick" x="{x:.1f}" y="{ty}">+{s}h</text>').format(
            x=x, t=TOP, b=height - BOTTOM, ty=height - 4, s=step))
    for row, lane in enumerate(lanes):
        y = TOP + lane_h * row + lane_h / 2
        label = lane.label if len(lane.label) <= 34 else lane.label[:33] + "…"
        parts.append(Markup('<a href="{h}"><text class="lane" x="4" y="{y:.1f}">{l}</text></a>'
                            ).format(h=lane.href, y=y + 4, l=label))
        if lane.dense and lane.fires:
            start = label_w + plot_w * lane.fires[0]
            parts.append(Markup('<rect class="band" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" '
                                'height="8" rx="4"><title>more than {n} fires</title></rect>'
                                '<text class="axis count" x="{e}" y="{ty:.1f}">{n}+</text>'
                                ).format(x=start, y=y - 4, w=label_w + plot_w - start,
                                         n=lane.dense, e=label_w + plot_w + 50, ty=y + 4))
            continue
        for fraction in lane.fires:
            parts.append(Markup('<circle class="fire" cx="{x:.1f}" cy="{y:.1f}" r="4"/>').format(
                x=label_w + plot_w * fraction, y=y))
    parts.append(Markup("</svg>"))
    return Markup("").join(parts)


def spend_bar(spent_cents: float, limit_cents: float, alert_pct: float | None) -> Markup:
    """A horizontal bar: spend against a budget's limit (and its alert threshold)."""
    ratio = 0.0 if limit_cents <= 0 else spent_cents / limit_cents
    width = 240
    filled = min(1.0, ratio) * width
    css = "bad" if ratio >= 1 else "warn" if alert_pct and ratio * 100 >= alert_pct else "ok"
    marker = Markup("")
    if alert_pct:
        x = min(1.0, alert_pct / 100) * width
        marker = Markup('<line class="threshold" x1="{x:.1f}" x2="{x:.1f}" y1="0" y2="14"/>'
                        ).format(x=x)
    return Markup('<svg class="bar" viewBox="0 0 {w} 14" width="{w}" height="14" role="img" '
                  'aria-label="{p:.0f}% of the limit"><rect class="track" width="{w}" '
                  'height="14" rx="3"/><rect class="fill {c}" width="{f:.1f}" height="14" '
                  'rx="3"/>{m}</svg>').format(w=width, p=ratio * 100, c=css, f=filled,
                                              m=marker)


__all__ = ["Lane", "Series", "escape", "line_chart", "spend_bar", "timeline"]
