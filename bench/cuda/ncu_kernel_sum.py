#!/usr/bin/python3
"""Sums an ncu CSV (`ncu --csv --metrics gpu__time_duration.sum ...`) per kernel name, template
arguments dropped, and prints one row per kernel (ms, launches) for each file side by side,
largest first, with the files' totals. Used for the step breakdowns in bench/cuda/NOTES.md:

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \\
        ./bench_model_cuda --preset 1b --T 32768 --steps 3 --forward 0 --precision fp8 > fp8.csv
    bench/cuda/ncu_kernel_sum.py fp8.csv [bf16.csv ...]
"""
import collections, csv, re, sys


def load(path):
    rows = list(csv.reader(line for line in open(path) if line.startswith('"')))
    head = rows[0]
    name_at, value_at = head.index("Kernel Name"), head.index("Metric Value")
    sums = collections.defaultdict(lambda: [0.0, 0])
    for r in rows[1:]:
        name = re.sub(r"\(.*", "", r[name_at]).replace("void ", "")
        name = re.sub(r"<.*", "", name.replace("<unnamed>::", "").replace("(anonymous namespace)::", ""))
        sums[name][0] += float(r[value_at].replace(",", "")) / 1e6  # ns -> ms
        sums[name][1] += 1
    return sums


def main():
    files = [load(p) for p in sys.argv[1:]]
    if not files:
        print(__doc__)
        return 2
    names = sorted(set().union(*files), key=lambda n: -max(f.get(n, [0, 0])[0] for f in files))
    print("| kernel | " + " | ".join(f"{p} ms | launches" for p in sys.argv[1:]) + " |")
    print("|---|" + "---|---|" * len(files))
    print("| total | " + " | ".join(f"{sum(v[0] for v in f.values()):.1f} | "
                                     f"{sum(v[1] for v in f.values())}" for f in files) + " |")
    for n in names:
        print(f"| {n} | " + " | ".join(f"{f.get(n, [0, 0])[0]:.2f} | {f.get(n, [0, 0])[1]}"
                                        for f in files) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
