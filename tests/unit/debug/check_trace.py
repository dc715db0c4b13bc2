#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""Checks a meshlib trace file with Python's JSON parser: every device has exactly one thread_name
record and the expected complete events, each with name, ph, ts, dur, pid and tid.

    check_trace.py FILE DEVICES NAME[,NAME...] [--pid P]
"""
import json
import sys

path, devices, names = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
pid = int(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[4] == "--pid" else 0
with open(path) as f:
    doc = json.load(f)
events = doc["traceEvents"]
errors = []
for e in events:
    for key in ("name", "ph", "pid", "tid"):
        if key not in e:
            errors.append(f"event without '{key}': {e}")
    if e.get("pid") != pid:
        errors.append(f"event of pid {e.get('pid')}, expected {pid}: {e}")
    if e.get("ph") == "X" and not ("ts" in e and "dur" in e and e["dur"] >= 0):
        errors.append(f"complete event without ts/dur: {e}")
for d in range(devices):
    thread_names = [e for e in events if e["ph"] == "M" and e["name"] == "thread_name" and e["tid"] == d]
    if len(thread_names) != 1:
        errors.append(f"device {d}: {len(thread_names)} thread_name records, expected 1")
    elif not thread_names[0]["args"]["name"].startswith(f"device {d} ("):
        errors.append(f"device {d}: thread named {thread_names[0]['args']['name']!r}")
    for n in names:
        if not any(e["ph"] == "X" and e["tid"] == d and e["name"] == n for e in events):
            errors.append(f"device {d}: no '{n}' event")
if errors:
    print("\n".join(errors))
    sys.exit(1)
print(f"{path}: {len(events)} events, {devices} devices, each with {', '.join(names)}: OK")
