# ruff: noqa: E402, E741, SIM115 (a measurement script: logs opened for the whole run, imports timed)
"""Summarise logs/NAME/* : python analyze.py NAME [NAME ...]"""

import json
import os
import re
import statistics
import sys

LOGS = os.environ.get("TORCHFT_LOGS", "/tmp/torchft-logs")  # as runner.py


def steps(path):
    out = []
    if not os.path.exists(path):
        return out
    for line in open(path):
        if line.startswith("STEP"):
            kv = dict(x.split("=", 1) for x in line.split()[1:])
            out.append({k: (float(v) if k in ("t", "checksum", "loss", "dur") else int(v)) for k, v in kv.items()})
    return out


def first(path, key):
    if not os.path.exists(path):
        return None
    for line in open(path):
        if line.startswith(key):
            return float(re.search(r"t=([\d.]+)", line).group(1))


def analyze(name):
    d = os.path.join(LOGS, name)
    evs = [json.loads(l) for l in open(os.path.join(d, "events.log"))]
    E = {}
    for e in evs:
        E.setdefault(e["event"], e)
    r0 = steps(os.path.join(d, "r0.log"))
    r1 = steps(os.path.join(d, "r1.log"))
    r1b = steps(os.path.join(d, "r1b.log"))
    res = {"name": name}
    com0 = [s for s in r0 if s["committed"]]
    iv = [b["t"] - a["t"] for a, b in zip(com0, com0[1:], strict=False)]
    res["r0_committed_steps"] = len(com0)
    res["r0_failed_attempts"] = len([s for s in r0 if not s["committed"]])
    seq = [s["step"] for s in com0]
    res["r0_step_numbers_consecutive"] = all(b == a + 1 for a, b in zip(seq, seq[1:], strict=False))
    res["r0_final_step"] = seq[-1] if seq else None
    if "fault" in E:
        tf = E["fault"]["t"]
        before = [s for s in com0 if s["t"] <= tf]
        after = [s for s in r0 if s["t"] > tf]
        after_c = [s for s in after if s["committed"]]
        lb, nx = before[-1], after_c[0]
        res["fault"] = E["fault"]["kind"]
        res["fault_r0_step"] = E["fault"]["r0_step"]
        res["r0_last_step_before_fault"] = lb["step"]
        res["r0_next_committed_step"] = nx["step"]
        res["gap_last_to_next_s"] = round(nx["t"] - lb["t"], 3)
        res["gap_fault_to_next_s"] = round(nx["t"] - tf, 3)
        res["r0_failed_attempts_after_fault"] = [
            dict(step=s["step"], t_after_fault=round(s["t"] - tf, 3), dur=s["dur"])
            for s in after
            if not s["committed"] and s["t"] < nx["t"] + 0.001
        ]
        res["participants_next_3"] = [s["participants"] for s in after_c[:3]]
        # lost/repeated step numbers on the survivor
        res["steps_lost_or_repeated"] = "none" if nx["step"] == lb["step"] + 1 else f"{lb['step']} -> {nx['step']}"
        if r1:
            res["r1_last_step_before_fault"] = max([s["step"] for s in r1 if s["t"] <= tf], default=None)
    if "kill_stopped" in E:
        res["stopped_killed_after_s"] = E["kill_stopped"]["after_s"]
    if r1b:
        first(os.path.join(d, "r1b.log"), "START")
        tl = first(os.path.join(d, "r1b.log"), "LOADED_STATE")
        starts = [e for e in evs if e["event"] == "replica_start" and e["tag"] == "r1b"]
        tspawn = starts[0]["t"]
        fp = [s for s in r1b if s["participating"] and s["committed"]]
        f1 = r1b[0]
        res["rejoin_r0_step_at_restart"] = max([s["step"] for s in r0 if s["t"] <= tspawn], default=None)
        res["rejoin_first_step_line_s"] = round(f1["t"] - tspawn, 3)
        res["rejoin_first_step"] = f1["step"]
        res["rejoin_state_loaded_s"] = round(tl - tspawn, 3) if tl else None
        res["rejoin_first_participating_s"] = round(fp[0]["t"] - tspawn, 3) if fp else None
        res["rejoin_first_participating_step"] = fp[0]["step"] if fp else None
        # compare checksums with r0 at the same step
        m0 = {s["step"]: s["checksum"] for s in com0}
        eq = [(s["step"], s["checksum"] == m0.get(s["step"])) for s in r1b if s["committed"]]
        res["rejoin_first_line_checksum_equal_r0"] = (
            f1["checksum"] == m0.get(f1["step"]),
            f1["checksum"],
            m0.get(f1["step"]),
        )
        res["rejoin_all_steps_equal"] = all(e for _, e in eq)
        res["rejoin_n_steps"] = len(eq)
        # survivor pause around the join: largest gap between r0 commits, spawn to 2 s after first participation
        tend = (fp[0]["t"] if fp else tspawn) + 2
        win = [s for s in com0 if tspawn - 0.5 <= s["t"] <= tend]
        wiv = [b["t"] - a["t"] for a, b in zip(win, win[1:], strict=False)]
        res["r0_max_interval_around_join_s"] = round(max(wiv), 3) if wiv else None
        res["r0_participants_after_join"] = (
            [s["participants"] for s in com0 if s["t"] > fp[0]["t"] - 0.01][:3] if fp else None
        )
        res["r1b_final"] = r1b[-1]["step"]
    # steady-state step time (median interval between r0 commits, excluding >1s gaps)
    norm = [x for x in iv if x < 1.0]
    res["r0_median_step_s"] = round(statistics.median(norm), 3) if norm else None
    res["r0_mean_step_s"] = round(statistics.mean(norm), 3) if norm else None
    res["r0_total_s"] = round(com0[-1]["t"] - com0[0]["t"], 3) if com0 else None
    res["final_checksums"] = (
        com0[-1]["checksum"] if com0 else None,
        r1b[-1]["checksum"] if r1b else (r1[-1]["checksum"] if r1 else None),
    )
    return res


if __name__ == "__main__":
    for n in sys.argv[1:]:
        print(json.dumps(analyze(n)))
