import csv, sys, collections
rows = collections.OrderedDict()
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
for r in csv.DictReader(lines):
  k = rows.setdefault(r["ID"], {"grid": r["Grid Size"], "block": r["Block Size"]})
  k[r["Metric Name"]] = (r["Metric Value"], r.get("Metric Unit", ""))
want = ["Duration", "Registers Per Thread", "Achieved Occupancy", "Memory Throughput", "DRAM Throughput", "L1/TEX Cache Throughput", "L2 Cache Throughput", "Compute (SM) Throughput", "Executed Ipc Active", "Warp Cycles Per Issued Instruction"]
print("id", *want, sep=" | ")
for i, k in rows.items():
  print(i, k["grid"], k["block"], *[k.get(w, ("-", ""))[0] + k.get(w, ("", ""))[1] for w in want], sep=" | ")
