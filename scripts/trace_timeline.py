#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""Draws a meshlib trace (Chrome trace event JSON, as written by meshlib::stop_trace) as an SVG
timeline: one row per device, regions and collectives as nested slices, flow arrows joining the
devices of each collective. For machines without Perfetto's UI or chrome://tracing at hand; the
picture in docs/debugging.md was made this way (then rendered to PNG by headless Chromium).

    python3 scripts/trace_timeline.py trace.json out.svg [--from-us T0] [--to-us T1]
"""
import argparse
import html
import json
import sys

PALETTE = {"region": ["#9ecae1", "#c6dbef", "#deebf7"], "collective": "#f28e2b"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("svg")
    ap.add_argument("--from-us", type=float, default=None, help="start of the window, microseconds")
    ap.add_argument("--to-us", type=float, default=None, help="end of the window, microseconds")
    ap.add_argument("--width", type=int, default=1500)
    a = ap.parse_args()

    with open(a.trace) as f:
        events = json.load(f)["traceEvents"]
    names, slices, flows = {}, [], {}
    for e in events:
        if e["ph"] == "M" and e["name"] == "thread_name":
            names[e["tid"]] = e["args"]["name"]
        elif e["ph"] == "X":
            slices.append(e)
        elif e["ph"] in ("s", "t", "f"):
            flows.setdefault(e["id"], []).append(e)
    if not slices:
        sys.exit("no slices in " + a.trace)
    t0 = a.from_us if a.from_us is not None else min(s["ts"] for s in slices)
    t1 = a.to_us if a.to_us is not None else max(s["ts"] + s["dur"] for s in slices)
    tids = sorted(names, key=lambda t: (t == 1000000, t))
    tids = [t for t in tids if any(s["tid"] == t for s in slices)]

    label_w, row_h, slice_h, top = 230, 74, 20, 40
    plot_w = a.width - label_w - 20
    height = top + row_h * len(tids) + 30
    x = lambda t: label_w + (t - t0) / (t1 - t0) * plot_w  # noqa: E731
    row_y = {t: top + i * row_h for i, t in enumerate(tids)}

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{a.width}" height="{height}" '
           'font-family="DejaVu Sans, sans-serif" font-size="12">',
           f'<rect width="{a.width}" height="{height}" fill="white"/>',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
           'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#444"/></marker></defs>']
    # Time axis: about ten ticks on round microsecond values.
    span = t1 - t0
    step = 10 ** len(str(int(span / 10))) / 10
    for mult in (1, 2, 5, 10):
        if span / (step * mult) <= 10:
            step *= mult
            break
    tick = (t0 // step + 1) * step
    while tick < t1:
        out.append(f'<line x1="{x(tick):.1f}" y1="{top - 8}" x2="{x(tick):.1f}" y2="{height - 30}" stroke="#e6e6e6"/>')
        out.append(f'<text x="{x(tick):.1f}" y="{top - 12}" text-anchor="middle" fill="#555">'
                   f'{tick / 1000:.3f} ms</text>')
        tick += step
    for t in tids:
        y = row_y[t]
        out.append(f'<rect x="0" y="{y}" width="{a.width}" height="{row_h - 4}" fill="#fafafa"/>')
        out.append(f'<text x="8" y="{y + 16}" font-weight="bold">{html.escape(names[t])}</text>')
        rows = sorted((s for s in slices if s["tid"] == t), key=lambda s: (s["ts"], -s["dur"]))
        stack = []  # end times of the enclosing slices: nesting depth
        for s in rows:
            while stack and stack[-1] <= s["ts"]:
                stack.pop()
            depth = len(stack)
            stack.append(s["ts"] + s["dur"])
            if s["ts"] + s["dur"] < t0 or s["ts"] > t1:
                continue
            xa, xb = max(x(s["ts"]), label_w), min(x(s["ts"] + s["dur"]), a.width - 20)
            yy = y + 22 + depth * (slice_h + 2)
            coll = s.get("cat") == "collective"
            fill = PALETTE["collective"] if coll else PALETTE["region"][min(depth, 2)]
            tip = s["name"] + (f' over {s["args"]["axes"]}, {s["args"]["bytes"]} B, wait '
                               f'{s["args"]["wait_us"]} us' if coll else "")
            out.append(f'<rect x="{xa:.1f}" y="{yy}" width="{max(xb - xa, 1.5):.1f}" height="{slice_h}" '
                       f'fill="{fill}" stroke="#555" stroke-width="0.5"><title>{html.escape(tip)}</title></rect>')
            label = s["name"] + (f' [{s["args"]["axes"]}]' if coll else "")
            if xb - xa > 7 * len(label):
                out.append(f'<text x="{xa + 3:.1f}" y="{yy + 14}">{html.escape(label)}</text>')
            if coll and s["args"]["wait_us"] > 0 and xb - xa > 2:
                wa = x(s["ts"] + min(s["args"]["wait_us"], s["dur"]))
                out.append(f'<rect x="{xa:.1f}" y="{yy + slice_h - 4}" width="{max(wa - xa, 0.5):.1f}" height="4" '
                           'fill="#b22222"><title>waiting for the last device</title></rect>')
    for chain in flows.values():
        chain.sort(key=lambda e: row_y.get(e["tid"], 0))
        for p, q in zip(chain, chain[1:]):
            if p["tid"] not in row_y or q["tid"] not in row_y or not (t0 <= p["ts"] <= t1):
                continue
            out.append(f'<line x1="{x(p["ts"]):.1f}" y1="{row_y[p["tid"]] + 32}" x2="{x(q["ts"]):.1f}" '
                       f'y2="{row_y[q["tid"]] + 30}" stroke="#444" stroke-width="1.2" marker-end="url(#arrow)"/>')
    out.append(f'<text x="8" y="{height - 10}" fill="#555">blue: regions (trace_region), orange: collectives, '
               'red underline: waiting for the last device, arrows: the devices of one collective</text>')
    out.append("</svg>")
    with open(a.svg, "w") as f:
        f.write("\n".join(out))


if __name__ == "__main__":
    main()
