"""Predicted GPU time saved by grouping sibling reductions (compile/siblings.py), from a
roofline JSON of the plan before the change (per-label mean µs measured on the device) and a
``plan_fingerprint.py`` dump of the plan after it.  Model: a multi_reduce dispatch of
latency-bound members costs what its slowest member cost alone, so each group saves the sum
of its members' times minus the largest.

  python bench/multi_reduce_predict.py ROOFLINE.json FINGERPRINT_DIR/resnet50-train_sgd.txt
"""
import json
import re
import sys


def main(roofline: str, dump: str) -> None:
    d = json.load(open(roofline))
    times = {}
    for w in d["workloads"].values():
        for k in w["rows"]:
            times[k["label"]] = k["mean_us"]
    saved, groups, missing = 0.0, 0, 0
    for line in open(dump):
        m = re.match(r"KERNEL multi_reduce\[(\d+)\] (.*?) \{(.*)\} strict ", line)
        if not m:
            continue
        shape, tails = m.group(2), m.group(3).split("; ")
        labels = [f"reduce_sum {shape}" + ("" if t == "plain" else f" {t}") for t in tails]
        us = [times.get(lbl) for lbl in labels]
        if None in us:
            missing += 1
            continue
        groups += 1
        saved += sum(us) - max(us)
    print(f"{groups} groups priced ({missing} with a member not in the roofline): "
          f"predicted saving {saved / 1000:.2f} ms per step")


if __name__ == "__main__":
    main(*sys.argv[1:3])
