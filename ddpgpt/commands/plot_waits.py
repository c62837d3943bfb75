"""`ddpgpt plot`'s waits: the seconds per step a run's loop waited for its data and for
checkpoints (metrics.jsonl's data_wait_s and ckpt_wait_s: run/metrics.py), on a right axis of the
tokens/s panel, one line style each, in each run's colour. Only for runs that logged them: an
older metrics.jsonl without them draws as it always did."""

from __future__ import annotations

WAITS = {"data_wait_s": ("--", "waited for data (s per step, right axis)"),
         "ckpt_wait_s": (":", "waited for checkpoints (s per step, right axis)")}


def draw_waits(speed, runs: list[dict]) -> list:
    """The waits of `runs` (plot.load_run's) on a twin of the `speed` axes; returns their legend
    handles ([] and no axis when no run logged any)."""
    from matplotlib.lines import Line2D

    drawn = [key for key in WAITS if any(key in r for run in runs for r in run["train"])]
    if not drawn:
        return []
    axis = speed.twinx()
    for i, run in enumerate(runs):
        for key in drawn:
            rows = [r for r in run["train"] if isinstance(r.get(key), (int, float))]
            axis.plot([r["step"] for r in rows], [r[key] for r in rows], color=f"C{i}",
                      ls=WAITS[key][0], lw=1, gid=key)
    axis.set_ylabel("waited per step (s)")
    axis.set_ylim(bottom=0)
    return [Line2D([], [], color="0.3", lw=1, ls=WAITS[key][0], label=WAITS[key][1])
            for key in drawn]
