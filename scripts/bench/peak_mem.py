"""Runs a command and reports the peak memory of its whole process tree (main + workers),
sampled every 20 ms from /proc: RSS summed (counts shared file pages once per process) and
PSS summed (shares them fairly). Usage: peak_mem.py -- CMD ARGS..."""
import subprocess
import sys
import time


def tree(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in open(f"/proc/{p}/task/{p}/children").read().split():
                todo.append(int(t))
        except OSError:
            pass
    return out


def rollup(pid):
    rss = pss = 0
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, pss


cmd = sys.argv[sys.argv.index("--") + 1:]
proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
peak_rss = peak_pss = 0
while proc.poll() is None:
    pids = tree(proc.pid)
    tot = [rollup(p) for p in pids]
    peak_rss = max(peak_rss, sum(r for r, _ in tot))
    peak_pss = max(peak_pss, sum(p for _, p in tot))
    time.sleep(0.02)
print(f"peak RSS {peak_rss / 1e6:.0f} MB, peak PSS {peak_pss / 1e6:.0f} MB, exit {proc.returncode}")
