"""How N busy processes scale on this machine: the ceiling any N-worker tool meets."""
import json, multiprocessing as mp, os, sys, time
def work(_):
    t = time.perf_counter(); s = 0
    for i in range(12_000_000): s += i * i
    return time.perf_counter() - t
if __name__ == "__main__":
    rows = {}
    for n in (1, 2, 4, 8, 12, 16):
        with mp.get_context("fork").Pool(n) as pool:
            per = pool.map(work, range(n))
        rows[n] = round(sum(per) / n, 3)
        print(n, rows[n], "s per task; efficiency", round(rows[1] / rows[n], 3), flush=True)
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "cpu_ceiling.json"), "w"))
