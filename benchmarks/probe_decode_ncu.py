"""Nsight Compute counters of the batch-1 decode attention kernel against the read-only reference.

B1, GQA 32/8, head_dim 128, bf16, block_size 16, a scattered block table, 32 KV splits (the shape of
``probe_decode_timeline.py``). ``--launch`` runs each kernel a few times eagerly (the target of ``ncu``);
without it the script runs ``ncu`` on itself (``--clock-control none``: the clocks stay as they are) with
the sections below and writes the per-kernel metrics it printed (``--csv --page details``) to
``probe_decode_ncu-<date>.json``, printing the rows that differ most between the two kernels.
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_cuda, write_results  # noqa: E402

import bench_decode  # noqa: E402
from hf_accel.kernels.paged_attention import paged_attention  # noqa: E402

H, H_KV, D, BLOCK, S, SPLITS = 32, 8, 128, 16, 32768, 32
SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "MemoryWorkloadAnalysis_Tables", "Occupancy",
            "LaunchStats", "SchedulerStats", "WarpStateStats", "InstructionStats")
KERNELS = "regex:_paged_attention_kernel|_read_kv_kernel|_merge_splits_kernel"


def launch(reps: int) -> None:
    k_cache, v_cache, table, seq_lens, q = bench_decode.b1_case(S, seed=0)
    read_only = bench_decode.read_only_call(k_cache, v_cache, table, S, SPLITS)[0]
    for _ in range(reps):
        paged_attention(q, k_cache, v_cache, table, seq_lens, S, num_splits=SPLITS, check_blocks=False)
        read_only()
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--launch", action="store_true", help="only run the kernels (ncu's target)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    require_cuda(__file__)
    if args.launch:
        launch(args.reps)
        return
    ncu = shutil.which("ncu")
    if ncu is None:
        raise SystemExit("probe_decode_ncu: ncu is not on PATH")
    cmd = [ncu, "--clock-control", "none", "-k", KERNELS, "--csv", "--page", "details"]
    for section in SECTIONS:
        cmd += ["--section", section]
    cmd += [sys.executable, __file__, "--launch", "--reps", str(args.reps)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    text = proc.stdout
    start = text.find('"ID"')
    if proc.returncode or start < 0:
        raise SystemExit(f"ncu failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}\n{text[-3000:]}")
    rows = []
    values = {}
    csv_lines = [line for line in text[start:].splitlines() if line.startswith('"')]  # not the program's output
    for rec in csv.DictReader(io.StringIO("\n".join(csv_lines))):
        if not rec.get("Kernel Name") or not rec.get("Metric Name"):
            continue
        kernel = rec["Kernel Name"].split("(")[0]
        key = (rec["Section Name"], rec["Metric Name"], rec["Metric Unit"])
        values.setdefault(key, {}).setdefault(kernel, []).append(rec["Metric Value"])
    for (section, metric, unit), per_kernel in sorted(values.items()):
        rows.append({"bench": "probe_decode_ncu", "section": section, "metric": metric, "unit": unit,
                     "value": {k: v[-1] for k, v in per_kernel.items()}})
        print(f"{section[:22]:22} {metric[:48]:48} {unit[:10]:10} " + " | ".join(
            f"{k[:22]}={v[-1]}" for k, v in sorted(per_kernel.items())))
    write_results("probe_decode_ncu", rows, {"shape": {"B": 1, "H": H, "H_kv": H_KV, "S": S, "D": D,
                                                       "block_size": BLOCK, "splits": SPLITS},
                                             "ncu": " ".join(cmd[1:-4])})


if __name__ == "__main__":
    main()
